"""The event loop keeps turning while collectives run (docs/design.md, "The loop's turns").

Two ranks as real processes (through the launcher), each with a 1 ms ticker task in its loop beside
back-to-back small calls (1.2 s of them) and large ones, over shared memory and over TCP. The bound
asserted is loose on purpose (a 1 s gap, or a hang, fails; the machine may be loaded): the fine
figures, the largest gap per row beside the idle floor, come from bench/collectives.py's tick(ms).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("ticker_rank.py"))
BOUND_MS = 1000.0

pytestmark = pytest.mark.timeout(150)


def test_other_tasks_run_while_collectives_are_in_flight():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RINGWEAVE_SHM", None)
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "2", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    gaps = {}
    for line in proc.stdout.splitlines():
        words = line.split()
        if "GAP" in words:
            i = words.index("GAP")
            gaps[(int(words[i + 1]), words[i + 2])] = float(words[i + 3])
    assert sorted(k for k in gaps if k[0] == 0) == sorted((0, p) for p in ("shm-small", "shm-large", "tcp-small",
                                                                             "tcp-large")), out[-3000:]
    assert len(gaps) == 8, out[-3000:]
    slow = {k: v for k, v in gaps.items() if v >= BOUND_MS}
    assert not slow, f"the loop stood still for {slow} ms while collectives ran:\n{out[-2000:]}"
