"""Smoke tests of bench/collectives.py: the harness launches, validates, prints its table and
writes its JSON (and plot). They assert that the harness works, never a speed: the machine is
shared, and speed is claimed only from a full run's ratios (bench/README.md)."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "collectives.py"
ALL_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
           "all_to_all", "barrier"]


def run_bench(tmp_path, *extra, timeout_s=300, out_dir=False):
    """``out_dir``: name no files, only ``--out-dir``; else name both files, from the repository."""
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    names = ["--json", str(out_json), "--plot", str(out_png)]
    if out_dir:
        out_json, out_png = tmp_path / "out" / "collectives.json", tmp_path / "out" / "collectives.png"
        names = ["--out-dir", str(tmp_path / "out")]
    cmd = [sys.executable, str(SCRIPT), "-n", "2", "--sizes", "4,4096", "--iters", "2", *names, *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK")}
    proc = subprocess.run(cmd, cwd=tmp_path if out_dir else ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc.stdout, json.loads(out_json.read_text()), out_png


def table_rows(stdout: str) -> list[list[str]]:
    rows = []
    for line in stdout.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[rank") else line
        cells = line.split()
        if cells and cells[0].isdigit() and cells[-1] == "ok":
            rows.append(cells)
    return rows


def check_timings(data: dict, timing: str = "call") -> None:
    """Every row (and peer) carries both timings, ``last`` (max t1 - max t0 over the ranks) never
    above ``call`` (the slowest rank's t1 - t0); ``time_us`` is the one the run was told to use."""
    assert data["meta"]["timing"] == timing
    assert data["meta"]["last"].startswith("recorded"), data["meta"]["last"]  # the ranks share this host's clock
    for r in data["rows"]:
        for fig in [r] + [r[p] for p in ("gloo", "mpi-sm") if p in r]:
            assert 0 < fig["time_last_us"] <= fig["time_call_us"] and 0 < fig["min_last_us"] <= fig["min_call_us"], fig
            assert fig["time_us"] == fig[f"time_{timing}_us"] and fig["min_us"] == fig[f"min_{timing}_us"], fig
        for p in ("gloo", "mpi-sm"):
            if p in r:
                for k in ("call", "last"):
                    assert r[p][f"ratio_{k}"] == pytest.approx(r[p][f"time_{k}_us"] / r[f"time_{k}_us"])
                assert r[p]["ratio"] == r[p][f"ratio_{timing}"]


def check_plot(stdout: str, png: Path) -> None:
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
        assert "plot skipped" not in stdout
    else:
        assert "plot skipped" in stdout


@pytest.mark.timeout(360)
def test_table_json_and_plot(tmp_path):
    """Files under --out-dir, said where; nothing written into the source tree."""
    def tree():  # bench/'s files, byte code aside
        return {p for p in (ROOT / "bench").rglob("*") if "__pycache__" not in p.parts}
    before = tree()
    stdout, data, png = run_bench(tmp_path, out_dir=True)
    assert f"# json: {tmp_path / 'out' / 'collectives.json'}" in stdout, stdout[-2000:]
    assert tree() == before
    assert "busbw" in stdout and "algbw" in stdout and "memory reference" in stdout
    rows = table_rows(stdout)
    assert sorted({r[3] for r in rows}) == sorted(ALL_OPS)
    assert len(rows) == 2 * (len(ALL_OPS) - 1) + 1  # two sizes per op, one barrier row
    assert data["meta"]["world"] == 2 and data["meta"]["dtype"] == "float32"
    assert len(data["rows"]) == len(rows)
    for r in data["rows"]:
        assert r["iters"] == 2 and r["time_us"] > 0 and r["busbw_gbps"] >= 0
        assert r["tick_gap_ms"] > 0 and r["idle_gap_ms"] > 0  # the ticker beside every row
    assert "tick(ms)" in stdout and "idle(ms)" in stdout
    assert {r["bytes"] for r in data["rows"] if r["op"] == "all_reduce"} == {4, 4096}
    check_timings(data)
    assert "median over iterations of the slowest rank's own t1 - t0 (timing call)" in stdout
    check_plot(stdout, png)


@pytest.mark.timeout(360)
def test_blocks_of_one_variant_still_time_every_iteration(tmp_path):
    """--block 3 with 5 timed and 1 untimed iterations: blocks of 3, 3 (the last one cut short);
    every variant still gets exactly 5 timed calls, also in an order of its own per round
    (every rank the same one, else the calls would not match). Timed by ``last``."""
    stdout, data, _ = run_bench(tmp_path, "--ops", "all_reduce", "--algorithm", "all", "--block", "3",
                                "--iters", "5", "--warmup", "1", "--timing", "last", "--shuffle")
    assert data["meta"]["block"] == 3 and data["meta"]["shuffle"] is True
    check_timings(data, "last")
    assert "(timing last)" in stdout and "comparison (rows of the default algorithm, timing last;" in stdout
    assert len(data["rows"]) >= 2 * 3  # two sizes, every algorithm
    assert all(r["iters"] == 5 for r in data["rows"])


@pytest.mark.timeout(360)
def test_small_rows_take_at_least_small_iters(tmp_path):
    """--small-iters 6 with --iters 2: the rows of at most 64 KiB time 6 calls, the larger 2."""
    _, data, _ = run_bench(tmp_path, "--ops", "all_reduce", "--sizes", "4,65536,262144", "--small-iters", "6")
    assert data["meta"]["small_iters"] == 6
    assert {r["bytes"]: r["iters"] for r in data["rows"]} == {4: 6, 65536: 6, 262144: 2}


@pytest.mark.timeout(360)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (optional peer)")
def test_compare_gloo(tmp_path):
    stdout, data, png = run_bench(tmp_path, "--ops", "all_reduce,all_gather,reduce_scatter,broadcast,reduce",
                                  "--compare", "gloo")
    assert "xgloo" in stdout and "vs gloo" in stdout
    assert len(table_rows(stdout)) == 10
    for r in data["rows"]:
        assert r["gloo"]["time_us"] > 0 and r["gloo"]["ratio"] > 0
    assert any(c["peer"] == "gloo" for c in data["summary"]["comparisons"])
    check_timings(data)
    check_plot(stdout, png)


def test_busbw_factors_and_sizes():
    sys.path.insert(0, str(ROOT))
    from bench.common import busbw_factor, parse_sizes
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_gather", 4) == busbw_factor("reduce_scatter", 4) == busbw_factor("all_to_all", 4) == 0.75
    assert busbw_factor("broadcast", 4) == busbw_factor("reduce", 4) == 1.0
    assert parse_sizes("4:64M:4")[0] == 4 and parse_sizes("4:64M:4")[-1] == 64 << 20 and len(parse_sizes("4:64M:4")) == 13
    assert parse_sizes("4,4K,1M") == [4, 4096, 1 << 20]


def _rank_that_dies_or_waits(n, rank, out):
    if rank == 0:
        raise SystemExit(3)  # as a rank whose bind or connect failed
    time.sleep(120)  # as its peer, waiting on a connection that never comes


@pytest.mark.timeout(60)
def test_floor_fails_a_mode_at_once_when_a_rank_dies():
    """A rank of bench/floor.py that exits before reporting (a port of its block taken by another
    program) fails the mode with RankFailed naming it, its peer stopped; it used to wait 300 s."""
    from bench import floor
    t0 = time.monotonic()
    with pytest.raises(floor.RankFailed, match=r"\(0, 3\)"):
        floor._in_processes(2, _rank_that_dies_or_waits)
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(300)
def test_floor_runs_every_mode():
    """bench/floor.py (ringweave's small all_reduce beside the bare protocols) prints a row of
    positive times per mode; each mode checks its own sums. No speed is asserted."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "floor.py"), "-n", "2", "--calls", "30"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = {cells[0]: cells[1:] for cells in (line.split() for line in proc.stdout.splitlines())
            if cells and not cells[0].startswith("#")}
    expected = ["ringweave-tcp", "ringweave-shm", "ringweave-inproc", "bare-tcp-block", "bare-tcp-uvloop", "bare-shm"]
    if importlib.util.find_spec("torch") is not None:  # the Gloo peer, where torch is installed
        expected.append("gloo")
    assert sorted(rows) == sorted(expected)
    assert all(float(wall) > 0 and float(cpu) > 0 for wall, cpu, *_ in rows.values()), rows
    for mode in rows:  # user + system: about the row's CPU
        user, system = map(float, rows[mode][2:])
        assert user >= 0 and system >= 0 and user + system > 0, rows[mode]


def test_the_summary_compares_without_goals():
    """bench/collectives.py ends with each peer's ratios per op over the default rows: the
    comparison, never a target or a verdict."""
    spec = importlib.util.spec_from_file_location("bench_collectives", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]

    def row(op, nbytes, ratio, default=True):
        return {"op": op, "bytes": nbytes, "default": default, "algorithm": "ring", "time_us": 100.0,
                "busbw_gbps": 1.0, "gloo": {"ratio": ratio, "time_us": 100.0 * ratio}}

    rows = [row("all_reduce", 4, 1.5), row("all_reduce", 16 << 20, 0.9), row("all_reduce", 16 << 20, 9.0, False),
            row("broadcast", 4, 2.0), row("barrier", 0, 3.0)]
    membw = {"one_core": {"median_gbps": 10.0}, "all_ranks_gbps": 20.0}
    out = bench.comparison(rows, ["gloo"], membw, 4)
    text = "\n".join(out["lines"])
    assert "vs gloo (this run: ringweave over TCP)" in text
    ar = next(c for c in out["comparisons"] if c["op"] == "all_reduce")
    assert ar["min_ratio"] == 0.9 and ar["median_ratio"] == pytest.approx(1.2)  # the non-default row left out
    assert {c["op"] for c in out["comparisons"]} == {"all_reduce", "broadcast", "barrier"}
    for word in ("goal", "PASS", "FAIL", ">=", "issue"):
        assert word not in text, word


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script, args, row", [
    ("shm_all_reduce.py", ["--sizes", "4,65536", "--reps", "2", "--spins", "0,5"], "shm/spin5"),
    ("measure_all_reduce.py", ["--max-mib", "0.01", "--runs", "3"], "recursive_doubling"),
    ("shm_fastpath.py", ["--calls", "50", "--reps", "1", "--counts", "1"], "all_reduce 4 B"),
])
def test_the_all_reduce_measurements_run_as_written(script, args, row):
    """The scripts behind bench/results/shm.md and all_reduce.md's first table run from bench/
    (named like the package, bench/collectives.py must not shadow it) and print their rows."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK")}
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "2", str(ROOT / "bench" / script), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert row in proc.stdout


def test_before_after_takes_medians_and_marks_a_worse_ratio(tmp_path, capsys):
    """bench/before_after.py: per row and peer the median ratio over the runs, before and after;
    a ratio more than 10% worse after is marked and listed."""
    sys.path.insert(0, str(ROOT))
    from bench import before_after

    def run(name, ratios, tick=None):
        rows = [{"op": "all_reduce", "bytes": 4, "default": True, "time_us": 10.0, "gloo": {"ratio": ratios[0]},
                 "tick_gap_ms": tick, "idle_gap_ms": tick},
                {"op": "all_reduce", "bytes": 1 << 20, "default": True, "time_us": 99.0, "gloo": {"ratio": ratios[1]},
                 "tick_gap_ms": tick, "idle_gap_ms": tick},
                {"op": "all_reduce", "bytes": 4, "default": False, "time_us": 1.0, "gloo": {"ratio": 100.0}}]
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {"command": "c"}, "rows": rows}))
        return str(path)

    before = [run("b1", (2.0, 1.0)), run("b2", (2.2, 1.0)), run("b3", (9.0, 1.0))]  # medians 2.2, 1.0
    after = [run("a1", (2.0, 1.2), 3.0), run("a2", (1.9, 1.2), 4.0)]  # medians 1.95, 1.2
    before_after.main(["--before", *before, "--after", *after])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| all_reduce")]
    assert rows[0].split(" | ")[4:7] == ["2.20", "1.95", "0.89 **"] and "3.5" in rows[0]
    assert rows[1].split(" | ")[4:7] == ["1.00", "1.20", "1.20"]
    assert out.rstrip().endswith("ratios more than 10% worse after (**): all_reduce 4 B xgloo 0.89")
