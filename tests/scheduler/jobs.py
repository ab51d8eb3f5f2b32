"""Helpers for the tests that run real jobs (our launcher, srun, sbatch, mpirun): the small
training run they share, comparing two runs bit for bit, waiting on output, processes.
The README's recipes are read from README.md itself (:func:`recipe`), so what the tests run
is what the README shows."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.faults.harness import alive

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
VENV_BIN = str(Path(sys.executable).parent)  # `python` on PATH is this interpreter (the recipes say `python`)

# Long enough (3 epochs of 100 steps) that a signal sent after the first progress lines lands
# mid-training on a loaded machine, small enough to run in about a second of compute.
TRAIN_ARGS = ["--data", "synthetic", "--size", "4000", "--width", "32", "--epochs", "3", "--batch-size", "32",
              "--log-every", "10", "--no-eval-train"]
SIGNAL_AFTER = "epoch 1/3 step 10/100"  # the progress line after which the tests signal a run
FINAL_STEP = "step-00000300"
# The ranks agree on a signal every 50 ms instead of every second, so that these short runs act
# on it well before their end (about 10 steps later; the default cadence is the same code).
PREEMPT_ENV = {"RINGWEAVE_PREEMPT_CHECK_S": "0.05"}


def recipe(name: str) -> str:
    """The indented block that follows ``<!-- recipe: NAME -->`` in README.md, dedented."""
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- recipe: {re.escape(name)} -->\n\n((?:    .*\n|\n)+)", text)
    assert m, f"README.md has no recipe {name!r}"
    lines = m.group(1).rstrip("\n").split("\n")
    return "\n".join(line[4:] for line in lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what, poll_s: float = 0.05):
    """Polls ``predicate()`` until it returns something true; AssertionError naming ``what`` on timeout
    (a string, or a callable giving one then: the logs as they are at the timeout, not at the start)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(poll_s)


def text_of(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def kill_all(pids) -> list[int]:
    """SIGKILLs those of ``pids`` still alive (processes a test started); returns them."""
    left = [p for p in pids if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def probe_reports(text: str) -> list[dict]:
    """The JSON objects tests/scheduler/probe.py printed, by rank (launchers may run lines together)."""
    decoder, found = json.JSONDecoder(), []
    for m in re.finditer(r'\{"rank"', text):
        try:
            found.append(decoder.raw_decode(text, m.start())[0])
        except json.JSONDecodeError:
            continue
    return sorted(found, key=lambda r: r["rank"])


def assert_ranks_die_with(cmd: list[str], log: Path, ranks: int, **popen) -> int:
    """Starts ``cmd`` (a launcher of ``ranks`` probe.py --wait ranks), SIGKILLs it once they are
    all in the job, and asserts they all exit within 20 s. Returns the launcher's pid."""
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen)
    pids = []
    try:
        wait_for(lambda: text_of(log).count("ready") == ranks, 120, lambda: f"the ranks\n{text_of(log)}")
        pids = [r["pid"] for r in probe_reports(text_of(log))]
        launcher.kill()
        launcher.wait(timeout=30)
        wait_for(lambda: not any(alive(p) for p in pids), 20, "the ranks to exit after their launcher died")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        left = kill_all(pids)
    assert not left
    return launcher.pid


def run_until_signalled(cmd: list[str], log: Path, send, expected_code: int, **popen) -> list[str]:
    """Runs a training job ``cmd`` until SIGNAL_AFTER shows in ``log``, calls ``send(process)``,
    and asserts the job exits with ``expected_code`` having saved a checkpoint before its last
    step. Returns the checkpoints' names (the ``--checkpoint-dir`` after ``cmd``'s flag)."""
    ckpt = Path(cmd[cmd.index("--checkpoint-dir") + 1])
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen)
        try:
            wait_for(lambda: SIGNAL_AFTER in text_of(log), 120, lambda: f"training to start\n{text_of(log)[-2000:]}")
            send(job)
            assert job.wait(timeout=120) == expected_code, text_of(log)[-3000:]
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    stopped_at = sorted(p.name for p in ckpt.glob("step-*"))
    assert stopped_at and stopped_at[-1] < FINAL_STEP, f"not stopped mid-training: {stopped_at}"
    return stopped_at


def load_run(json_path: Path, checkpoint_dir: Path) -> dict:
    """What must be equal between two runs: each epoch's losses and accuracy (exact floats)
    and every array of the final checkpoint (bytes)."""
    history = json.loads(json_path.read_text())["history"]
    epochs = [{k: e[k] for k in ("epoch", "train_loss", "val_loss", "val_acc", "skipped_steps")}
              for e in history["epochs"]]
    final = checkpoint_dir / FINAL_STEP
    arrays = {str(p.relative_to(final)): np.load(p) for p in sorted(final.rglob("*.npy"))}
    assert arrays, f"no arrays in {final}"
    return {"epochs": epochs, "arrays": arrays}


def assert_same_run(a: dict, b: dict) -> None:
    assert a["epochs"] == b["epochs"]
    assert a["arrays"].keys() == b["arrays"].keys()
    for name, x in a["arrays"].items():
        y = b["arrays"][name]
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f"{name} differs"
