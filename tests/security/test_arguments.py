"""Careless arguments get a clear error at once, on every rank and every path, never a silent
wrong answer (collectives/api.py, runtime/group.py).

* Overlapping buffers: all_gather with ``x`` inside another rank's block of ``out`` returned
  rank-dependent wrong data on the shared-memory path (right over TCP). Every call that takes
  two buffers now refuses an overlap, but for its in-place form (``x`` = ``out``'s own block
  in all_gather and gather, ``out`` = ``x``'s own block in scatter), which is right everywhere.
* ``timeout=``: -1 on one rank gave that rank CollectiveTimeoutError and the others a raw
  FileNotFoundError (shared memory) or success (TCP); NaN / inf waited past everyone's
  timeout; "5" gave an unrelated TypeError. Now: a positive finite number or None, checked
  first, before a sequence number is taken or a byte sent.
* ``new_group``: accepted ``[0.9, 1.9]``, ``[True, False]``, ``["0", "1"]`` and ``[]``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import collectives as C
from collectives.registry import ALGORITHMS
from runtime.errors import CollectiveTimeoutError

pytestmark = pytest.mark.timeout(60)
N = 4
K = 3  # elements per block
PATHS = ["shm", "ring", "direct"]  # the default on one host, and TCP algorithms


def gather_algos():
    return sorted({"shm", *ALGORITHMS["all_gather"]})


@pytest.mark.parametrize("algo", gather_algos())
async def test_all_gather_refuses_x_inside_another_ranks_block(ranks, algo):
    """Every rank passes ``x`` = the next rank's block of ``out``: each raises at once (none is
    left waiting, since none took a sequence number); then the in-place form is right."""
    async def body(g):
        out = np.zeros(N * K, np.int64)
        other = (g.rank + 1) % N
        x = out[other * K:(other + 1) * K]
        x[:] = g.rank + 1
        with pytest.raises(ValueError, match=f"the only overlap allowed is x = this rank's block of out exactly "
                                             f"\\(elements {g.rank * K}\\.\\.{g.rank * K + K - 1}"):
            await C.all_gather(out, x, algorithm=algo)
        shifted = g.rank * K + (1 if g.rank < N - 1 else -1)  # our own block, off by one element
        with pytest.raises(ValueError, match="overlaps"):
            await C.all_gather(out, out[shifted:shifted + K], algorithm=algo)
        mine = out[g.rank * K:(g.rank + 1) * K]
        mine[:] = g.rank + 1
        await C.all_gather(out, mine, algorithm=algo)  # in place
        return out.tolist()

    want = [r + 1 for r in range(N) for _ in range(K)]
    assert await ranks(N, body) == [want] * N


@pytest.mark.parametrize("algo", ["tree", "direct"])
async def test_gather_and_scatter_refuse_overlap_but_their_in_place_form(ranks, algo):
    async def body(g):
        buf = np.zeros(N * K, np.int64)
        x = buf[K:2 * K] if g.rank == 0 else np.full(K, g.rank + 1, np.int64)
        if g.rank == 0:
            with pytest.raises(ValueError, match="gather: x overlaps out"):
                await C.gather(buf, x, dst=0, algorithm=algo)
            x = buf[:K]
            x[:] = 1
        await C.gather(buf if g.rank == 0 else None, x, dst=0, algorithm=algo)  # in place on the root
        gathered = buf.tolist() if g.rank == 0 else None
        src = np.arange(N * K, dtype=np.int64) * 10
        out = src[2 * K:3 * K] if g.rank == 0 else np.zeros(K, np.int64)
        if g.rank == 0:
            with pytest.raises(ValueError, match="scatter: out overlaps x"):
                await C.scatter(out, src, src=0, algorithm=algo)
            out = src[:K]
        await C.scatter(out, src if g.rank == 0 else None, src=0, algorithm=algo)  # in place on the root
        return gathered, out.tolist()

    results = await ranks(N, body)
    assert results[0][0] == [r + 1 for r in range(N) for _ in range(K)]
    assert [r[1] for r in results] == [[10 * (p * K + i) for i in range(K)] for p in range(N)]


async def test_v_variants_refuse_overlap_but_their_in_place_form(ranks):
    """The count-per-rank collectives (collectives/uneven.py) follow the same rule, with the
    blocks where the counts put them."""
    counts = [2, 0, 3, 1]
    offsets = [0, 2, 2, 5, 6]

    async def body(g):
        r = g.rank
        out = np.zeros(6, np.int64)
        mine = out[offsets[r]:offsets[r + 1]]
        if counts[r]:  # a block of the right length, but not where the counts put ours
            start = 0 if offsets[r] else 1
            with pytest.raises(ValueError, match="all_gather_v: x overlaps out"):
                await C.all_gather_v(out, out[start:start + counts[r]], counts)
        mine[:] = r + 1
        await C.all_gather_v(out, mine, counts)  # in place
        with pytest.raises(ValueError, match="all_to_all_v: x overlaps out"):
            await C.all_to_all_v(out, out, [1, 1, 2, 2], [1, 1, 2, 2])
        return out.tolist()

    want = [r + 1 for r in range(N) for _ in range(counts[r])]
    assert await ranks(N, body) == [want] * N


async def test_reduce_scatter_and_all_to_all_refuse_any_overlap(ranks):
    async def body(g):
        buf = np.zeros(N * K, np.float32)
        with pytest.raises(ValueError, match="reduce_scatter: out overlaps x"):
            await C.reduce_scatter(buf[g.rank * K:(g.rank + 1) * K], buf)
        with pytest.raises(ValueError, match="all_to_all: x overlaps out"):
            await C.all_to_all(buf, buf)
        return True

    assert await ranks(N, body) == [True] * N


class FakeDeviceArray:
    """What the overlap check reads of a device array: its __cuda_array_interface__."""

    def __init__(self, address: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (address, False),
                                         "strides": None, "version": 3}


async def test_device_arrays_that_overlap_are_refused_before_the_device_path(ranks):
    """Device all_gather and reduce_scatter are pipelined per segment (collectives/device.py):
    their buffers are checked by device address, before anything is copied or sent."""
    async def body(g):
        base = 1 << 32
        out = FakeDeviceArray(base, N * K)
        with pytest.raises(ValueError, match="all_gather: x overlaps out"):
            await C.all_gather(out, FakeDeviceArray(base + 4 * ((g.rank + 1) % N * K), K))
        with pytest.raises(ValueError, match="reduce_scatter: out overlaps x"):
            await C.reduce_scatter(FakeDeviceArray(base + 4, K), out)
        return g._seq

    assert await ranks(N, body) == [0] * N  # no call was opened


BAD_TIMEOUTS = [(-1, ValueError), (0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
                ("5", TypeError), (True, TypeError), ([5], TypeError)]


def calls(g, timeout):
    """Every public call of collectives/api.py, with arguments that are right but for ``timeout``."""
    x = np.ones(N * K, np.float32)
    out = np.zeros(N * K, np.float32)
    block = np.zeros(K, np.float32)
    peer = (g.rank + 1) % g.size
    return {
        "all_reduce": lambda: C.all_reduce(x, timeout=timeout),
        "all_gather": lambda: C.all_gather(out, block, timeout=timeout),
        "reduce_scatter": lambda: C.reduce_scatter(block, x, timeout=timeout),
        "broadcast": lambda: C.broadcast(x, timeout=timeout),
        "reduce": lambda: C.reduce(x, timeout=timeout),
        "gather": lambda: C.gather(out, block, timeout=timeout),
        "scatter": lambda: C.scatter(block, x, timeout=timeout),
        "all_to_all": lambda: C.all_to_all(out, x, timeout=timeout),
        "barrier": lambda: C.barrier(timeout=timeout),
        "send": lambda: C.send(x, peer, timeout=timeout),
        "recv": lambda: C.recv(x, peer, timeout=timeout),
        "all_gather_v": lambda: C.all_gather_v(out, x[:K], [K] * g.size, timeout=timeout),
        "all_to_all_v": lambda: C.all_to_all_v(out[:2], x[:2], [1] * g.size, [1] * g.size, timeout=timeout),
        "gather_v": lambda: C.gather_v(out, x[:K], [K] * g.size, timeout=timeout),
        "scatter_v": lambda: C.scatter_v(block, x[:g.size * K], [K] * g.size, timeout=timeout),
        "broadcast_object": lambda: C.broadcast_object({"a": 1}, timeout=timeout),
        "all_gather_object": lambda: C.all_gather_object(1, timeout=timeout),
        "all_reduce compressed": lambda: C.all_reduce(x, compression="fp16", timeout=timeout),
    }


@pytest.mark.parametrize("bad,error", BAD_TIMEOUTS, ids=[repr(b) for b, _ in BAD_TIMEOUTS])
async def test_a_bad_timeout_is_refused_by_every_call_before_it_sends(ranks, bad, error):
    async def body(g):
        actor = g.runtime.actor
        for name, start in calls(g, bad).items():
            seq, sent = g._seq, actor.statistics().frames_sent
            with pytest.raises(error, match="timeout must be"):
                await start()
            assert (g._seq, actor.statistics().frames_sent) == (seq, sent), name  # nothing taken or sent
        await C.barrier(timeout=5)  # the group is fine
        return True

    assert await ranks(2, body) == [True, True]


@pytest.mark.parametrize("algo", PATHS[:2])
async def test_a_bad_timeout_on_one_rank_fails_it_at_once_and_the_others_normally(ranks, algo):
    """Rank 1 passes -1: it raises ValueError at once, without taking a sequence number or
    sending. The others see a rank that never made the call: after their own timeout (1 s),
    CollectiveTimeoutError naming rank 1 among the ranks that had not reached it, and their
    group is failed from then on (before: FileNotFoundError on the shared-memory path, success
    over TCP, and their group not failed)."""
    async def body(g):
        x = np.ones(1000, np.float32)
        t = -1 if g.rank == 1 else 1.0
        try:
            await C.all_reduce(x, timeout=t, algorithm=algo)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return type(exc).__name__, getattr(exc, "absent", None), g.error is not None
        return "ok", None, g.error is not None

    got = await ranks(3, body)
    assert got[1] == ("ValueError", None, False), got
    for r in (0, 2):
        name, absent, failed = got[r]
        assert name == "CollectiveTimeoutError" and 1 in absent and failed, got


@pytest.mark.parametrize("ranks_arg", [[0.9, 1.9], [True, False], ["0", "1"], [], [0, 0], [0, 4], [-1], "01",
                                       None, [np.int64(1), 2.0]])
async def test_new_group_takes_distinct_int_ranks_in_range(ranks, ranks_arg):
    async def body(g):
        rt = g.runtime
        with pytest.raises((TypeError, ValueError), match="new_group"):
            rt.new_group(ranks_arg)
        sub = rt.new_group([np.int64(1), 2])  # numpy integers are integers
        return sub.ranks

    assert await ranks(N, body) == [[1, 2]] * N


async def test_collective_timeout_error_is_still_what_a_late_peer_causes(ranks):
    """The check does not change the deadline itself: a valid short timeout still times out."""
    async def body(g):
        if g.rank == 0:
            with pytest.raises(CollectiveTimeoutError):
                await C.barrier(timeout=0.3)
            return "timed out"
        return "absent"

    assert await ranks(2, body) == ["timed out", "absent"]
