"""A rank that raises in user code: the others are stopped, not left waiting.

Rank 1 raises ValueError while ranks 0, 2 and 3 wait inside an all_reduce
whose timeout is the runtime's default (300 s). The others behave like any
program (SIGTERM ends them); each says how it ended: PeerLostError (rank 1's
connections closed when its process exited) or the launcher's SIGTERM,
whichever came first. The launcher exits with rank 1's code (1) naming rank 1
and showing its traceback, within seconds, and no process is left.
"""

from __future__ import annotations

import math

import pytest

from tests.faults.harness import assert_no_process_left, launch

RAISE_IN_USER_CODE = r'''
def on_term(signum, frame):
    if not REPORTED:
        print(f"rank {RANK}: SIGTERM after {since_fault()} s: stopped by the launcher", flush=True)
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)   # a plain program: SIGTERM ends it (and says when)


async def body(rt):
    x = np.ones(1 << 20, np.float32)
    await C.all_reduce(x)
    if RANK == 1:
        await asyncio.sleep(0.3)          # the others are inside the next all_reduce
        mark_fault("raise")
        raise ValueError("boom in user code of rank 1")
    await C.all_reduce(x)
    raise SystemExit(f"rank {RANK}: the all_reduce finished without rank 1")

run(body, reporters=3)
'''


@pytest.mark.timeout(60)
def test_rank_raising_stops_the_others(tmp_path):
    result = launch(tmp_path, RAISE_IN_USER_CODE, launcher_args=("--grace-s", "5"), timeout_s=45)
    result.show("rank 1 raises ValueError in user code")
    assert result.returncode == 1, result.explain()
    assert "rank 1 failed first: exit code 1" in result.stderr, result.explain()
    assert "ValueError: boom in user code of rank 1" in result.stderr, result.explain()
    assert "did not stop within" not in result.stderr, result.explain()  # nobody needed SIGKILL
    assert sorted(result.reports) == [0, 2, 3], result.explain()
    for r, rep in result.reports.items():
        assert rep.error in ("PeerLostError", "SIGTERM"), (r, rep)
        if rep.error == "PeerLostError":
            assert "rank 1" in rep.message, (r, rep)
        assert not math.isnan(rep.after_s) and rep.after_s < 5.0, (r, rep)
    assert_no_process_left(result)
