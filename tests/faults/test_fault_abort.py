"""A rank whose program raises aborts the job at once: leaving a ``with Communicator`` block,
or ``try: ... finally: await runtime.shutdown()``, because of an exception tells every peer.

Rank 1 raises ValueError while ranks 0, 2 and 3 wait in an all_reduce whose timeout is the
runtime's default (300 s). Each of them must raise PeerAbortedError (a PeerLostError) naming
rank 1 and ValueError within seconds (it was 30 s: rank 1 sat in the shutdown rendezvous,
the others in their collective); the launcher exits with rank 1's code, names rank 1, prints
rank 1's traceback once and each other rank's error as one line.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.faults.harness import assert_no_process_left, launch

WITH_BLOCK = r'''
from collectives import Communicator
with Communicator.from_env() as comm:
    x = np.ones(1024, np.float32)
    comm.all_reduce(x)
    if RANK == 1:
        time.sleep(0.3)                   # the others are inside the next all_reduce
        mark_fault("raise")
        raise ValueError("boom in rank 1")
    try:
        comm.all_reduce(x)
    except RingweaveError as exc:
        report(exc)
        raise
'''

TRY_FINALLY = r'''
async def main():
    rt = await runtime.init()
    try:
        x = np.ones(1024, np.float32)
        await C.all_reduce(x)
        if RANK == 1:
            await asyncio.sleep(0.3)
            mark_fault("raise")
            raise ValueError("boom in rank 1")
        try:
            await C.all_reduce(x)
        except RingweaveError as exc:
            report(exc)
            raise
    finally:
        await runtime.shutdown()
asyncio.run(main())
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["with_block", "try_finally"])
def test_exception_aborts_the_job_at_once(tmp_path, how):
    body = WITH_BLOCK if how == "with_block" else TRY_FINALLY
    # --timeout-s 25: the old way (a 30 s shutdown rendezvous) cannot pass in time
    result = launch(tmp_path, body, launcher_args=("--grace-s", "5", "--timeout-s", "25"), timeout_s=40)
    result.show(f"rank 1 raises ValueError ({how})")
    assert result.returncode == 1, result.explain()
    assert sorted(result.reports) == [0, 2, 3], result.explain()
    for r, rep in result.reports.items():
        assert rep.error == "PeerAbortedError", (r, rep)
        assert "rank 1" in rep.message and "ValueError: boom in rank 1" in rep.message, (r, rep)
        assert not math.isnan(rep.after_s) and rep.after_s < 5.0, (r, rep)  # measured ~0.01-0.1 s, under load
    err = result.stderr
    # the launcher names rank 1, not a rank that failed because of it and exited sooner
    assert "rank 1 failed first: exit code 1" in err, result.explain()
    assert "after aborting the job (ValueError: boom in rank 1)" in err, result.explain()
    # rank 1's traceback once; no other traceback; each other rank's error in one line
    assert err.count("Traceback (most recent call last):") == 1, result.explain()
    assert err.count('raise ValueError("boom in rank 1")') == 1, result.explain()
    for r in (0, 2, 3):
        lines = [line for line in err.splitlines() if line.startswith(f"[rank {r}] ")]
        assert len(lines) == 1, (r, lines)
        assert re.search(r"PeerAbortedError: rank 1 aborted the job: ValueError: boom in rank 1 "
                         r"\(traceback of \d+ lines not shown", lines[0]), lines
    assert len(err.splitlines()) < 25, result.explain()  # was 136 lines at 4 ranks
    assert_no_process_left(result)
