"""No crash at exit: a program that leaves its Communicator open exits 0, every time.

The cause of the crash this guards against: the communicator's event loop (uvloop) ran on a
daemon thread into the interpreter's teardown; when a peer process exited, a socket of that
loop woke, and uvloop called back into the finalized interpreter: SIGSEGV after the last line
(6 of 25 runs at 4 ranks, shared memory on, where Numba's teardown widens the window). Now a
communicator left open is closed at exit (collectives/blocking.py), and every LoopThread is
stopped before the interpreter goes (runtime/loopthread.py).

exit_without_close.py checks that cause directly in its last exit hook (so one run shows it);
the test runs it 4 times at once. The 50-run loop is a tool (it takes 50-80 s here):
``python -m tools.exitloop tests/launch/exit_without_close.py`` (50 runs x 2 ranks, 5 at once).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.exitloop import run_loop

SCRIPT = str(Path(__file__).with_name("exit_without_close.py"))
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.timeout(180)
def test_leaving_a_communicator_open_never_crashes_the_exit():
    env = dict(os.environ, PYTHONPATH=ROOT)
    runs = run_loop(SCRIPT, runs=4, parallel=4, nproc=2, timeout_s=120, env=env)
    failed = [r.describe() for r in runs if r.failed]
    assert not failed, "\n".join(failed)
    for r in runs:
        assert "rank 0: ok" in r.output and "rank 1: ok" in r.output, r.output
