"""The default GPT model at 4 ranks (float64; global batch 16 windows, so that the test is quick) under
``python -m runtime.launch --elastic 3:4 -n 4 -m trainer``:
a rank SIGKILLed from outside at a random step, its slot restarted by the launcher: the run completes,
its every step's loss and gradient norm and its validation loss equal an undisturbed run's to 1e-12,
and no survivor was restarted.

Under fsdp, whose re-shard moves the most (every unit's shard re-sliced, the joiner's sent live); the
undisturbed run is ddp's, so that the equality holds across strategies too. ddp's kill, shrink and
rejoin, with the check that the step that failed changed no survivor's state, are
test_elastic_ddp.py's (the launcher, the rendezvous and the trainer's elastic loop are the same for
every strategy: only the re-shard differs)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from el_launch import REPO, environ

pytestmark = pytest.mark.timeout(240)
F64 = ["--master-dtype", "float64", "--param-dtype", "float64", "--reduce-dtype", "float64"]
BATCH, STEPS = 16, 30  # windows per step, steps in the one epoch: long enough for the joiner to come back


def trainer(tmp_path: Path, name: str, strategy: str, elastic: bool, kill: tuple[int, int] | None = None):
    """Runs the job; ``kill=(rank, step)``: once rank 0 logged ``step`` steps, SIGKILL that rank's
    process. Returns (exit code, output, metrics rows)."""
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "runtime.launch", *(["--elastic", "3:4"] if elastic else []), "-n", "4",
           "--timeout-s", "30", "--grace-s", "2", "-m", "trainer", "--model", "gpt", "--strategy", strategy, *F64,
           "--epochs", "1", "--batch-size", str(BATCH), "--windows-per-epoch", str(STEPS * BATCH),
           "--metrics", str(metrics), "--log-every", "1"]
    logfile = tmp_path / f"{name}.log"
    with open(logfile, "w") as sink, subprocess.Popen(cmd, cwd=REPO, env=environ(), stdout=sink,
                                                      stderr=subprocess.STDOUT, start_new_session=True) as p:
        try:
            if kill is not None:
                _kill_at(p, metrics, *kill)
            p.wait(timeout=200)
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return p.returncode, logfile.read_text(), rows


def _kill_at(p: subprocess.Popen, metrics: Path, rank: int, step: int) -> None:
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and p.poll() is None:
        if metrics.exists() and sum('"kind": "step"' in line for line in metrics.read_text().splitlines()) >= step:
            os.kill(_rank_pid(p.pid, rank), signal.SIGKILL)
            return
        time.sleep(0.02)
    raise AssertionError(f"rank 0 never logged step {step}")


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of the launcher's child whose environment says RANK=rank (the first: a joiner comes later)."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            if f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    raise AssertionError(f"no child of the launcher {launcher} has RANK={rank}")


def steps_and_val(rows: list[dict]) -> tuple[np.ndarray, float]:
    steps = sorted((r for r in rows if r["kind"] == "step"), key=lambda r: r["step"])
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), [r["step"] for r in steps]
    val = [r["val_loss"] for r in rows if r["kind"] == "epoch"]
    return np.array([(r["loss"], r["grad_norm"]) for r in steps]), val[-1]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> tuple[np.ndarray, float]:
    """ddp without --elastic: every strategy and world size trains the same global batches."""
    tmp = tmp_path_factory.mktemp("gpt")
    code, log, rows = trainer(tmp, "ref", "ddp", elastic=False)
    assert code == 0, log[-3000:]
    return steps_and_val(rows)


def test_the_default_gpt_under_fsdp_killed_and_rejoined_equals_the_undisturbed_run(tmp_path, undisturbed):
    seed = random.randrange(1 << 30)
    pick = random.Random(seed)
    rank, step = pick.randint(1, 3), pick.randint(2, 5)
    code, log, got = trainer(tmp_path, "el", "fsdp", elastic=True, kill=(rank, step))
    where = f"seed {seed}: rank {rank} killed after step {step}\n{log[-4000:]}"
    assert code == 0, where
    assert log.count("starting a joiner in its place") == 1 and f"rank {rank} exited with signal SIGKILL" in log, where
    assert "generation 1: 3 ranks" in log and "4 ranks" in log.split("generation 1: 3 ranks", 1)[1], where
    (want_steps, want_val), (got_steps, got_val) = undisturbed, steps_and_val(got)
    np.testing.assert_allclose(got_steps, want_steps, rtol=1e-12, err_msg=where)
    np.testing.assert_allclose(got_val, want_val, rtol=1e-12, err_msg=where)
