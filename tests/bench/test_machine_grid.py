"""bench/machine.py --grid: the default grid's rows over the target, the median over runs read from
collectives.py --algorithm all JSON, with the default as each run marked it or as this checkout's
table chooses (--table), by the ``last`` timing unless told otherwise; and the grid's goal row in
the machine's file, judged by ``last`` with ``call`` beside it. No speed is measured or asserted:
the rows are made up."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import machine  # noqa: E402
from bench import _machine  # noqa: E402
from runtime import env  # noqa: E402

LAST = "max t1 - max t0 over the ranks, from the last rank's entry to the last rank's exit"
CALL = "the slowest rank's own t1 - t0"


def run_of(times: dict, default: str, op="broadcast", nbytes=4, world=2, call: dict | None = None) -> dict:
    """One collectives.py JSON (run with its default --timing call) with one (op, size) row per
    algorithm: ``times`` {algorithm: last's median, us}; ``call`` the same by call (default: equal)."""
    call = call or times
    return {"rows": [{"op": op, "algorithm": a, "default": a == default, "bytes": nbytes, "count": nbytes // 4,
                      "dtype": "float32", "world": world, "time_us": call[a], "time_call_us": call[a],
                      "time_last_us": t} for a, t in times.items()]}


def write(tmp_path, runs: list[dict]) -> list[str]:
    paths = []
    for i, d in enumerate(runs):
        paths.append(str(tmp_path / f"run{i}.json"))
        Path(paths[-1]).write_text(json.dumps(d))
    return paths


def test_rows_over_the_target_by_the_median_of_runs(tmp_path):
    paths = write(tmp_path, [run_of({"shm": 30.0, "flat": 10.0}, "shm"), run_of({"shm": 12.0, "flat": 10.0}, "shm"),
                             run_of({"shm": 20.0, "flat": 10.0}, "shm")])
    lines = machine.grid(paths, 1.10)
    assert lines[0] == "0 of 1 (op, size) rows within 1.10x, timed last: " + LAST
    assert lines[1].startswith("broadcast 4 B: default 2.00x the fastest"), lines  # median of 3.0, 1.2, 2.0
    assert machine.grid(paths, 3.5) == ["1 of 1 (op, size) rows within 3.50x, timed last: " + LAST]


def test_the_table_option_marks_this_checkouts_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "0")  # restored after: the option sets its own for the look-up
    paths = write(tmp_path, [run_of({"shm": 30.0, "flat": 10.0, "tree": 11.0}, "shm")])
    want = machine.table_choice({"op": "broadcast", "bytes": 4, "count": 1, "dtype": "float32", "world": 2})
    assert want == "flat"  # the table's choice on one host, shared memory on: TCP for a small broadcast
    assert machine.table_choice({"op": "broadcast", "bytes": 64 << 20, "count": 16 << 20, "dtype": "float32",
                                 "world": 2}) == "shm"
    assert machine.table_choice({"op": "scatter", "bytes": 4 << 20, "count": 1 << 18, "dtype": "float32",
                                 "world": 4}) == "direct"
    lines = machine.grid(paths, 1.10, table=True)
    assert lines == ["1 of 1 (op, size) rows within 1.10x, timed last: " + LAST], lines
    assert machine.grid(paths, 1.10)[1].startswith("broadcast 4 B: default 3.00x")
    assert env.SHM.get() is False  # the option's own setting was restored after the look-up


def test_the_command_line_prints_the_rows(tmp_path):
    paths = write(tmp_path, [run_of({"shm": 30.0, "flat": 10.0}, "shm")])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "machine.py"), "--grid", *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[:2] == [
        "0 of 1 (op, size) rows within 1.10x, timed last: " + LAST,
        "broadcast 4 B: default 3.00x the fastest (fastest/default per run: flat/shm)"]


# A 2-rank broadcast row as the barrier's order leaves it: by call, the default flat's median landed
# in the slow mode (the receiver let out first, charged the root's wake-up) and tree's in the fast
# one; from the last rank's entry, the two are the same messages and within 5%.
SPLIT = {"times": {"flat": 42.0, "tree": 40.0, "shm": 90.0}, "default": "flat",
         "call": {"flat": 230.0, "tree": 92.0, "shm": 95.0}}


def test_the_grid_is_judged_by_last_unless_told_and_reads_runs_from_before(tmp_path):
    paths = write(tmp_path, [run_of(**SPLIT)])
    assert machine.grid(paths, 1.10) == ["1 of 1 (op, size) rows within 1.10x, timed last: " + LAST]
    assert machine.grid(paths, 1.10, timing="call") == [
        "0 of 1 (op, size) rows within 1.10x, timed call: " + CALL,
        "broadcast 4 B: default 2.50x the fastest (fastest/default per run: tree/flat)"]
    before = write(tmp_path, [{"rows": [{k: v for k, v in r.items() if not k.startswith("time_") or k == "time_us"}
                                        for r in run_of(**SPLIT)["rows"]]}])  # time_us alone: it was call
    assert machine.grid(before, 1.10, timing="call")[1].startswith("broadcast 4 B: default 2.50x")
    assert machine.grid(before, 1.10) == ["no row has the last timing (" + LAST + ")"]


def test_the_machines_file_judges_the_grid_by_last_and_shows_call_beside_it():
    m = _machine.Machine("AMD EPYC 9B14 96-Core Processor", 2, 24, [])
    peers = {k: _machine.Peer(True, k) for k in ("torch", "mpi", "gpu")}
    goals, jobs = _machine.plan_goals(m, peers)
    wanted = {"grid-2", "tcp-2-64MiB"}
    goals = [g for g in goals if g.id in wanted]
    tcp_row = {"op": "all_reduce", "bytes": 64 << 20, "default": True, "time_us": 100.0,
               "gloo": {"ratio": 1.6, "ratio_call": 1.6, "ratio_last": 1.7}}
    records = []
    for rnd, (call, last) in enumerate(((230.0, 42.0), (220.0, 43.0), (95.0, 41.0)), 1):
        split = dict(SPLIT, times=dict(SPLIT["times"], flat=last), call=dict(SPLIT["call"], flat=call))
        records.append(machine.Record(jobs["grid-2"], rnd, state="ok", data=run_of(**split)))
        records.append(machine.Record(jobs["tcp-2"], rnd, state="ok", data={"rows": [tcp_row]}))
    meta = {"machine": m, "peers": peers, "command": "python bench/machine.py", "quick": False, "budget_s": 480.0,
            "date": "2026-11-28", "start": "09:00:00", "end": "09:08:00", "used_s": 480.0,
            "load_before": "1.00 1.00 1.00", "load_after": "1.00 1.00 1.00", "version": "0", "git": "x",
            "layouts": ["2 ranks, a core each"]}
    text = machine.report(meta, goals, records, {g.id: None for g in goals}, 3)
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert table[0] == "| goal | layout | median | timing | runs | goal value | verdict |"
    rows = {cells[0]: cells[2:] for cells in ([c.strip() for c in ln.strip("|").split(" | ")] for ln in table[2:])}
    # last: flat over tree 1.05x, 1.07x, 1.02x -> 1.05x, met; call: 2.50x, 2.39x, 1.03x -> 2.39x beside it
    assert rows["default algorithm's time / the fastest's, worst of the default grid"] == [
        "1.05x", "last (call 2.39x)", "1.05x, 1.07x, 1.02x", "<= 1.10x", "met"]
    assert rows["TCP all_reduce 64 MiB vs Gloo"] == ["1.60x", "call (last 1.70x)", "1.60x, 1.60x, 1.60x",
                                                     ">= 1.50x", "met"]
    assert "1 of 1 (op, size) rows within 1.10x, timed last: " + LAST in text
    assert "the grid on last, because by call the order in which the barrier lets the ranks out" in text
