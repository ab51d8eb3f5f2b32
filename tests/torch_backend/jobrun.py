"""Runs one of tests/torch_backend/job_*.py at 2 ranks through our launcher, with a deadline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launch(job: str, *args: str, timeout_s: float = 60.0, ranks_timeout_s: int = 20) -> subprocess.CompletedProcess:
    """``python -m runtime.launch -n 2 --timeout-s ranks_timeout_s tests/torch_backend/<job> args``, its output
    captured; the whole run is killed after ``timeout_s``."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "runtime.launch", "-n", "2", "--timeout-s", str(ranks_timeout_s),
           str(ROOT / "tests" / "torch_backend" / job), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
