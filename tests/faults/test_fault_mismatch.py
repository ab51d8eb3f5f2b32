"""Mismatched collectives across ranks, through the real launcher.

One job of 4 ranks per path (TCP only, and with shared memory) runs five
cases one after the other, each on a fresh sub-group of all four ranks (a
group that saw a mismatch stays failed; the world group, used for the
barriers between cases, stays healthy). In each case rank 3 calls something
else than ranks 0-2:

    op      all_reduce op=max        vs  op=sum
    dtype   all_reduce of float64    vs  float32
    length  all_reduce of 1001       vs  1000 elements
    root    broadcast from rank 1    vs  from rank 0
    skip    skips the all_reduce and calls the broadcast that follows it

Every rank must raise CollectiveMismatchError whose message names both calls
(both fingerprints' differing fields), within 5 s of rank 3's call; the job
then shuts down cleanly (exit 0).

A rank whose part of a call only sends cannot know, in that call, that a peer
disagreed (in ``root``, over TCP, ranks 0-2 run a broadcast from rank 0 that
needs nothing from rank 3): its call returns, the rank that saw the mismatch
fails the group on every member, and the rank raises at its next call on the
group (marked "at the next call on the group"). The confused rank itself must
raise at once, not wait for its timeout.
"""

from __future__ import annotations

import math

import pytest

from tests.faults.harness import assert_no_process_left, launch

CASES = {  # case -> words both calls put in the message (one from each side)
    "op": ("op=sum", "op=max"),
    "dtype": ("dtype=float32", "dtype=float64"),
    "length": ("count=1000", "count=1001"),
    "root": ("root=0", "root=1"),
    "skip": ("all_reduce", "broadcast"),
}

MISMATCH = r'''
CASES = ["op", "dtype", "length", "root", "skip"]


async def call(case, odd, g):
    x = np.ones(1000, np.float32)
    if case == "op":
        await C.all_reduce(x, op="max" if odd else "sum", group=g)
    elif case == "dtype":
        await C.all_reduce(x.astype(np.float64) if odd else x, group=g)
    elif case == "length":
        await C.all_reduce(np.ones(1001 if odd else 1000, np.float32), group=g)
    elif case == "root":
        await C.broadcast(x, src=1 if odd else 0, group=g)
    elif case == "skip":
        if not odd:
            await C.all_reduce(x, group=g)
        await C.broadcast(x, src=0, group=g)


async def body(rt):
    for case in CASES:
        g = rt.new_group(range(WORLD))
        await C.barrier()                     # world group: the cases do not overlap
        odd = RANK == 3
        if odd:
            mark_fault(case)
        where = ""
        try:
            try:
                await call(case, odd, g)
            except RingweaveError:
                raise
            else:                             # a rank whose part only sent cannot know yet:
                where = " (at the next call on the group)"
                await C.barrier(group=g)      # it learns it at its next call on the group
        except RingweaveError as exc:         # reported with its type, the case in front
            report(type(exc)(f"[{case}] {exc}{where}"))
        else:
            print(f"rank {RANK}: NoError after {since_fault()} s: [{case}] the mismatch went unnoticed", flush=True)

run(body)
'''


@pytest.fixture(scope="module", params=["tcp", "shm"])
def mismatch_job(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"mismatch_{request.param}")
    env = {"RINGWEAVE_SHM": "0" if request.param == "tcp" else "1"}
    result = launch(tmp, MISMATCH, env=env, timeout_s=60)
    print(f"\n== mismatched collectives, one job of 5 cases ({request.param}): launcher exit "
          f"{result.returncode} after {result.wall_s:.2f} s")
    for rep in result.all_reports:
        print(f"   rank {rep.rank}: {rep.error} after {rep.after_s:.3f} s: {rep.message[:260]}")
    return result


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(CASES))
def test_mismatch_raises_on_every_rank_naming_both_calls(mismatch_job, case):
    result = mismatch_job
    mine = [rep for rep in result.all_reports if rep.message.startswith(f"[{case}] ")]
    assert sorted(rep.rank for rep in mine) == [0, 1, 2, 3], result.explain()
    for rep in mine:
        assert rep.error == "CollectiveMismatchError", (rep, result.explain())
        for word in CASES[case]:
            assert word in rep.message, (word, rep)
        assert not math.isnan(rep.after_s) and rep.after_s < 5.0, rep


@pytest.mark.timeout(90)
def test_mismatch_job_ends_cleanly(mismatch_job):
    assert mismatch_job.returncode == 0, mismatch_job.explain()
    assert_no_process_left(mismatch_job)


# -- the same root disagreement in one process, fast: the rank that waits on a parent that
#    never sends must raise at once (it used to wait for its whole timeout) ---------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_broadcast_root_disagreement_fails_at_once(ranks, transport, monkeypatch):
    import time

    import numpy as np

    import collectives as C
    from runtime.errors import CollectiveMismatchError

    monkeypatch.setenv("RINGWEAVE_SHM", "0")  # the tree broadcast (shared memory compares every rank's call)

    async def body(g):
        x = np.ones(1000, np.float32)
        t0 = time.monotonic()
        try:
            await C.broadcast(x, src=1 if g.rank == 3 else 0, group=g)
            await C.barrier(group=g)  # ranks whose part only sent learn it here
        except CollectiveMismatchError as exc:
            return time.monotonic() - t0, str(exc)
        return None

    results = await ranks(4, body, transport=transport, timeout_s=20)
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} saw no mismatch"
        waited, msg = res
        assert waited < 2.0 and "root=0" in msg and "root=1" in msg, (r, res)
