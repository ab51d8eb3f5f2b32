"""``runtime.run(main())`` with no ``try/finally``, one rank raising: the job is aborted.

README's asyncio example has no ``try/finally``; rank 1 raises while ranks 0 and 2 wait in an
all_reduce. ``runtime.run`` aborts the runtime the exception escaped from, so the others raise
PeerAbortedError naming rank 1 and its exception (not PeerLostError, "connection closed by the
peer"), their tracebacks are written as that one line, and the launcher names rank 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

README_STYLE = r'''
import asyncio
import numpy as np
import runtime
import collectives as C

async def main():
    rt = await runtime.init()
    x = np.ones(4, np.float32)
    await C.all_reduce(x)
    if rt.rank == 1:
        await asyncio.sleep(0.2)          # the others are inside the next all_reduce
        raise ValueError("boom in rank 1")
    await C.all_reduce(x)
    await runtime.shutdown(rt)

if __name__ == "__main__":
    runtime.run(main())
'''


@pytest.mark.timeout(60)
def test_an_exception_escaping_runtime_run_aborts_the_job_naming_its_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(README_STYLE)
    r = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "3", "--grace-s", "5", str(script)],
                       cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=50)
    err = r.stderr
    assert r.returncode == 1, err
    assert "[launch] rank 1 failed first: exit code 1, after aborting the job (ValueError: boom in rank 1)" in err
    for rank in (0, 2):
        assert (f"[rank {rank}] runtime.errors.PeerAbortedError: rank 1 aborted the job: ValueError: boom in rank 1"
                in err), err
    assert "PeerLostError" not in err and "connection closed by the peer" not in err, err
    assert err.count("Traceback (most recent call last)") == 1, err  # rank 1's alone
