"""Running elastic_job.py (or a module) under the real launcher for the elastic tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("elastic_job.py")


def environ(extra: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           **(extra or {})}
    env.pop("RINGWEAVE_SECRET", None)
    return env


def launch(tmp_path: Path, name: str, *flags: str, env: dict | None = None, n: int = 3, timeout_s: float = 20,
           deadline_s: float = 60, wake: tuple[int, float] | None = None, grace_s: float = 2) -> tuple[int, str, Path]:
    """Runs ``python -m runtime.launch FLAGS -n N --timeout-s T --grace-s G elastic_job.py OUT``; returns
    (exit code, output, OUT). ``wake=(slot, after_s)``: once OUT/fault-SLOT names a stopped process,
    SIGCONT it ``after_s`` seconds later. Raises subprocess.TimeoutExpired past ``deadline_s`` (the
    launcher and its ranks are stopped first)."""
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, "-m", "runtime.launch", *flags, "-n", str(n), "--timeout-s", f"{timeout_s:g}",
           "--grace-s", f"{grace_s:g}", str(JOB), str(out)]
    logfile = tmp_path / f"{name}.log"  # a file, not a pipe: nothing blocks the launcher while we wait
    with open(logfile, "w") as sink, subprocess.Popen(cmd, cwd=REPO, env=environ(env), stdout=sink,
                                                      stderr=subprocess.STDOUT, start_new_session=True) as p:
        try:
            if wake is not None:
                _wake(out / f"fault-{wake[0]}", wake[1], p, time.monotonic() + deadline_s)
            p.wait(timeout=deadline_s)
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    return p.returncode, logfile.read_text(), out


def _wake(marker: Path, after_s: float, p: subprocess.Popen, until: float) -> None:
    while not marker.exists() or not marker.read_text().strip():
        if p.poll() is not None or time.monotonic() > until:
            return
        time.sleep(0.05)
    time.sleep(after_s)
    os.kill(int(marker.read_text().split()[0]), signal.SIGCONT)


def undisturbed(out: Path) -> np.ndarray:
    """elastic_job.py's parameters from one process without the launcher: its global batches are the
    same at any world size, so every undisturbed or elastic run of it must equal these (float64)."""
    p = subprocess.run([sys.executable, str(JOB), str(out)], cwd=REPO, env=environ(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return np.load(out / "params.npy")
