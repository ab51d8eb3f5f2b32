"""bench/machine.py --grid: the default grid's rows over the target, the median over runs read from
collectives.py --algorithm all JSON, with the default as each run marked it or as this checkout's
table chooses (--table). No speed is measured or asserted: the rows are made up."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import machine  # noqa: E402
from runtime import env  # noqa: E402


def run_of(times: dict, default: str, op="broadcast", nbytes=4, world=2) -> dict:
    """One collectives.py JSON with one (op, size) row per algorithm: {algorithm: time_us}."""
    return {"rows": [{"op": op, "algorithm": a, "default": a == default, "bytes": nbytes, "count": nbytes // 4,
                      "dtype": "float32", "world": world, "time_us": t} for a, t in times.items()]}


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
    assert lines[0] == "0 of 1 (op, size) rows within 1.10x"
    assert lines[1].startswith("broadcast 4 B: default 2.00x the fastest"), lines  # median of 3.0, 1.2, 2.0
    assert machine.grid(paths, 3.5) == ["1 of 1 (op, size) rows within 3.50x"]


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
    assert lines == ["1 of 1 (op, size) rows within 1.10x"], lines
    assert machine.grid(paths, 1.10)[1].startswith("broadcast 4 B: default 3.00x")
    assert env.SHM.get() is False  # the option's own setting was restored after the look-up


def test_the_command_line_prints_the_rows(tmp_path):
    paths = write(tmp_path, [run_of({"shm": 30.0, "flat": 10.0}, "shm")])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "machine.py"), "--grid", *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[:2] == [
        "0 of 1 (op, size) rows within 1.10x",
        "broadcast 4 B: default 3.00x the fastest (fastest/default per run: flat/shm)"]
