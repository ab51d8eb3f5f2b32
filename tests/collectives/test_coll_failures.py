"""Failures: argument errors before any message, mismatched calls, lost ranks and
timeouts — each raising its typed error on every rank within seconds, never a hang."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import collectives as C
from collectives.registry import ALGORITHMS
from runtime.errors import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError

pytestmark = pytest.mark.timeout(60)


# -- argument errors: raised before the call takes a sequence number ------------------

BAD_CALLS = [  # (description, call on rank's arrays, exception, words the message must hold)
    ("not an array", lambda: C.all_reduce([1.0, 2.0]), TypeError, ["x", "list"]),
    ("unsupported dtype", lambda: C.all_reduce(np.ones(3, np.complex64)), TypeError, ["x", "complex64"]),
    ("non-contiguous", lambda: C.all_reduce(np.ones((4, 4), np.float32)[:, 1]), ValueError, ["x", "C-contiguous"]),
    ("read-only", lambda: C.broadcast(np.frombuffer(b"abcd", np.uint8)), ValueError, ["x", "read-only"]),
    ("unknown op", lambda: C.all_reduce(np.ones(3), op="mean"), ValueError, ["op", "'mean'"]),
    ("out too small", lambda: C.all_gather(np.ones(3), np.ones(3)), ValueError, ["out", "3", "6"]),
    ("dtype differs", lambda: C.all_gather(np.ones(6, np.float32), np.ones(3)), TypeError, ["float32", "float64"]),
    ("x wrong length", lambda: C.reduce_scatter(np.ones(2), np.ones(5)), ValueError, ["x", "5", "4"]),
    ("root out of range", lambda: C.broadcast(np.ones(2), src=2), ValueError, ["src=2", "0..1"]),
    ("gather out missing", lambda: C.gather(None, np.ones(2), dst=0), None, ["out", "None"]),
    ("all_to_all indivisible", lambda: C.all_to_all(np.ones(3), np.ones(3)), ValueError, ["3", "multiple"]),
    ("unknown algorithm", lambda: C.all_reduce(np.ones(2), algorithm="butterfly"), ValueError, ["butterfly", "ring"]),
    ("unknown codec", lambda: C.all_reduce(np.ones(2), compression="zip"), ValueError, ["zip", "int8"]),
    ("compressed max", lambda: C.all_reduce(np.ones(2), op="max", compression="int8"), ValueError, ["'max'"]),
    ("compressed ints", lambda: C.all_reduce(np.ones(2, np.int32), compression="int8"), TypeError, ["int32"]),
    ("p2p tag", lambda: C.send(np.ones(2), dst=1, tag="x"), TypeError, ["tag"]),
]


@pytest.mark.parametrize("what,make,exc,words", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
async def test_bad_arguments_fail_locally_and_leave_the_group_usable(ranks, what, make, exc, words):
    async def body(g):
        if exc is None and g.rank != 0:  # only the root needs out: other ranks are fine
            return
        with pytest.raises(exc or ValueError) as info:
            await make()
        for word in words:
            assert word in str(info.value), (word, str(info.value))
        x = np.full(3, g.rank + 1.0)
        await asyncio.wait_for(C.all_reduce(x), 5)  # nothing was sent, no sequence number taken
        assert (x == 3).all()
    if exc is None:
        async def body2(g):  # the destination fails locally; then every rank runs a good call
            if g.rank == 0:
                with pytest.raises(ValueError, match="out is None"):
                    await C.gather(None, np.ones(2), dst=0)
            x = np.full(3, g.rank + 1.0)
            await C.all_reduce(x)
            assert (x == 3).all()
        await ranks(2, body2)
    else:
        await ranks(2, body)


def test_env_override_names_unknown_algorithm(monkeypatch):
    from collectives import registry
    monkeypatch.setenv("RINGWEAVE_ALGO_ALL_REDUCE", "bogus")
    with pytest.raises(ValueError, match="RINGWEAVE_ALGO_ALL_REDUCE='bogus'"):
        registry.choose("all_reduce", 4, 4)
    monkeypatch.setenv("RINGWEAVE_ALGO_ALL_REDUCE", "ring")
    assert registry.choose("all_reduce", 4, 4)[0] == "ring"
    assert registry.choose("all_reduce", 4, 4, "halving_doubling")[0] == "halving_doubling"


# -- mismatches: every rank raises CollectiveMismatchError naming both calls ---------

def _mismatch(kind: str, rank: int):
    """The call rank ``rank`` makes; rank 1 differs from the others in ``kind``."""
    odd = rank == 1
    x = np.ones(7, np.float32)
    if kind == "op":
        return C.all_reduce(x, op="max" if odd else "sum")
    if kind == "dtype":
        return C.all_reduce(np.ones(7, np.float64) if odd else x)
    if kind == "length":
        return C.all_reduce(np.ones(8, np.float32) if odd else x)
    if kind == "zero_length":
        return C.all_reduce(np.ones(0, np.float32) if odd else x)
    if kind == "root":
        return C.broadcast(x, src=1 if odd else 0)
    if kind == "collective":
        return C.broadcast(x, src=0) if odd else C.all_reduce(x)
    if kind == "algorithm":
        return C.all_reduce(x, algorithm="ring" if odd else "recursive_doubling")
    if kind == "barrier_vs_all_gather":
        return C.barrier() if odd else C.all_gather(np.ones(7 * 3, np.float32), x)
    raise AssertionError(kind)


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("kind", ["op", "dtype", "length", "zero_length", "root", "collective", "algorithm",
                                  "barrier_vs_all_gather"])
async def test_mismatch_raises_on_every_rank(ranks, kind, transport):
    if transport == "tcp" and kind not in ("op", "collective"):
        pytest.skip("a smaller matrix over TCP")

    async def body(g):
        start = time.monotonic()
        # A rank whose part of the call was only sending may finish it before the
        # error reaches it; its next call on the group raises it then.
        with pytest.raises(CollectiveMismatchError) as info:
            await _mismatch(kind, g.rank)
            await C.barrier()
        assert time.monotonic() - start < 5
        return str(info.value)

    messages = await ranks(3, body, transport=transport, timeout_s=20)
    for m in messages:  # names both calls and both ranks
        assert "called" in m and m.count("rank ") >= 2, m
        assert m.count("'") >= 4, m


def _rooted(collective: str, algo: str, root: int, rank: int):
    """``collective`` to/from ``root`` with 7 elements per rank, on 3 ranks."""
    x, out = np.ones(7, np.float32), np.empty(21, np.float32)
    if collective == "gather":
        return C.gather(out if rank == root else None, x, dst=root, algorithm=algo)
    if collective == "scatter":
        return C.scatter(x, out if rank == root else None, src=root, algorithm=algo)
    if collective == "reduce":
        return C.reduce(x, dst=root, algorithm=algo)
    return C.broadcast(x, src=root, algorithm=algo)


@pytest.mark.parametrize("collective,algo", [(c, a) for c in ("gather", "scatter", "reduce", "broadcast")
                                             for a in ALGORITHMS[c] if a != "shm"])
async def test_root_mismatch_raises_on_every_rank(ranks, collective, algo):
    """Rank 1 thinks it is the root, the others that rank 0 is. In a gather or a reduce
    nobody may send a frame the other side receives (rank 1 waits for frames sent to rank
    0, rank 0 for one rank 1 never sends): the mismatch check (ProcessGroup.check_stalled,
    1 s by default) finds it, not the 20 s deadline."""
    async def body(g):
        start = time.monotonic()
        with pytest.raises(CollectiveMismatchError) as info:
            await _rooted(collective, algo, 1 if g.rank == 1 else 0, g.rank)
            await C.barrier()
        assert time.monotonic() - start < 8
        return str(info.value)

    for m in await ranks(3, body, transport="tcp", timeout_s=20):
        assert "called" in m and m.count("rank ") >= 2 and "root=0" in m and "root=1" in m, m


_KINDS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
          "barrier"]


def _any_call(kind: str, rank: int, k: int = 1, dtype=np.float32):
    """``kind`` on 4 ranks, 4 k elements per rank (root 0)."""
    x, out, one = np.ones(4 * k, dtype), np.empty(16 * k, dtype), np.empty(k, dtype)
    return {"all_reduce": lambda: C.all_reduce(x), "all_gather": lambda: C.all_gather(out, x),
            "reduce_scatter": lambda: C.reduce_scatter(one, x), "broadcast": lambda: C.broadcast(x, src=0),
            "reduce": lambda: C.reduce(x, dst=0), "gather": lambda: C.gather(out if rank == 0 else None, x, dst=0),
            "scatter": lambda: C.scatter(one, x if rank == 0 else None, src=0),
            "all_to_all": lambda: C.all_to_all(np.empty(4 * k, dtype), x), "barrier": C.barrier}[kind]()


@pytest.mark.parametrize("mine,odd", [(a, b) for a in _KINDS for b in _KINDS if a != b])
async def test_every_pair_of_collectives_mismatches_within_seconds(ranks, mine, odd):
    """Rank 1 calls ``odd``, the others ``mine`` (default algorithms, TCP). With the
    mismatch check off, the 12 pairs where the others call reduce or gather waited for the
    whole timeout."""
    async def body(g):
        start = time.monotonic()
        with pytest.raises(CollectiveMismatchError):
            await _any_call(odd if g.rank == 1 else mine, g.rank)
            await C.barrier()
        return time.monotonic() - start

    took = await ranks(4, body, transport="tcp", timeout_s=20)
    assert max(took) < 8, took


@pytest.mark.parametrize("differs", ["length", "dtype"])
@pytest.mark.parametrize("odd", [0, 1], ids=["root_differs", "other_differs"])
@pytest.mark.parametrize("kind", [k for k in _KINDS if k != "barrier"])
async def test_every_collective_with_another_length_or_dtype_mismatches(ranks, kind, odd, differs):
    """Rank ``odd`` (the root, 0, or not, 1) passes twice the length or float64 (4 ranks, TCP)."""
    async def body(g):
        start = time.monotonic()
        k, dtype = (2 if differs == "length" else 1), (np.float64 if differs == "dtype" else np.float32)
        with pytest.raises(CollectiveMismatchError):
            await (_any_call(kind, g.rank, k, dtype) if g.rank == odd else _any_call(kind, g.rank))
            await C.barrier()
        return time.monotonic() - start

    took = await ranks(4, body, transport="tcp", timeout_s=20)
    assert max(took) < 8, took


async def test_a_late_rank_is_not_a_mismatch(ranks, monkeypatch):
    """Checks every 0.1 s while rank 2 arrives 1.5 s late: the others ask it (it is not in
    the call yet, then it is in the same one) and go on waiting; the gather is right."""
    monkeypatch.setenv("RINGWEAVE_MISMATCH_CHECK_S", "0.1")

    async def body(g):
        if g.rank == 2:
            await asyncio.sleep(1.5)
        x, out = np.full(3, g.rank, np.float32), np.empty(9, np.float32)
        await C.gather(out if g.rank == 0 else None, x, dst=0)
        await C.barrier()
        return out if g.rank == 0 else None

    out = (await ranks(3, body, transport="tcp", timeout_s=20))[0]
    np.testing.assert_array_equal(out, np.repeat(np.arange(3, dtype=np.float32), 3))


async def test_a_long_wait_is_logged_naming_the_missing_rank(ranks, monkeypatch, caplog):
    """At the 5th check (31 x RINGWEAVE_MISMATCH_CHECK_S: 1.55 s here) a call still waiting
    logs which rank it waits on and that rank 2 has not reached it; the call then completes."""
    monkeypatch.setenv("RINGWEAVE_MISMATCH_CHECK_S", "0.05")

    async def body(g):
        if g.rank == 2:
            await asyncio.sleep(3.0)
        x = np.ones(3, np.float32)
        await C.all_reduce(x)
        return x

    with caplog.at_level("WARNING", logger="ringweave.group"):
        for x in await ranks(3, body, transport="tcp", timeout_s=20):
            np.testing.assert_array_equal(x, np.full(3, 3, np.float32))
    said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert said, caplog.text
    assert all("[]" not in m and "not reached by rank 2 (2: at call #0)" in m for m in said), said


def test_mismatch_check_setting(monkeypatch):
    from runtime import env
    monkeypatch.setenv("RINGWEAVE_MISMATCH_CHECK_S", "0.25")
    assert env.mismatch_check_s() == 0.25
    monkeypatch.setenv("RINGWEAVE_MISMATCH_CHECK_S", "")
    assert env.mismatch_check_s() == env.DEFAULT_MISMATCH_CHECK_S
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("RINGWEAVE_MISMATCH_CHECK_S", bad)
        with pytest.raises(ValueError, match="RINGWEAVE_MISMATCH_CHECK_S"):
            env.mismatch_check_s()


# -- lost ranks: every survivor raises PeerLostError within seconds --------------------

@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("how", ["close_runtime", "abort_connections", "close_actor"])
@pytest.mark.parametrize("algo", ["ring", "halving_doubling"])
async def test_lost_rank_fails_every_survivor(ranks, how, transport, algo):
    n, leaver = 4, 2

    async def body(g):
        rt = g.runtime
        x = np.ones(100_000, np.float32)
        await C.all_reduce(x, algorithm=algo)
        if g.rank == leaver:
            await asyncio.sleep(0.05)  # the others are in their next call by now
            if how == "close_runtime":
                await rt.close()
            elif how == "close_actor":
                await rt.actor.close()
            else:
                for conn in list(rt.actor.conns.values()):
                    conn.abort()
            return None
        start = time.monotonic()
        with pytest.raises(PeerLostError) as info:
            await C.all_reduce(x, algorithm=algo)  # pending when the rank leaves
        assert time.monotonic() - start < 5
        with pytest.raises(PeerLostError):  # and every later call on the group
            await C.barrier()
        return str(info.value)

    results = await ranks(n, body, transport=transport, timeout_s=20)
    for r, m in enumerate(results):
        if r != leaver:
            assert f"rank {leaver}" in m, m


@pytest.mark.parametrize("leaver", [0, 2], ids=["root_lost", "other_lost"])
@pytest.mark.parametrize("kind", _KINDS)
async def test_lost_rank_fails_every_collective(ranks, kind, leaver):
    """Every collective (default algorithms, TCP) pending when a rank drops its connections:
    each survivor raises PeerLostError naming it within 5 s, from that call or, when its own
    part was done (a gather's sender), from the next."""
    async def body(g):
        await C.barrier()
        if g.rank == leaver:
            await asyncio.sleep(0.05)  # the others are in the call by now
            for conn in list(g.runtime.actor.conns.values()):
                conn.abort()
            return None
        start = time.monotonic()
        with pytest.raises(PeerLostError) as info:
            await _any_call(kind, g.rank, 4096)
            await C.barrier()
        assert time.monotonic() - start < 5
        return str(info.value)

    results = await ranks(4, body, transport="tcp", timeout_s=20)
    for r, m in enumerate(results):
        if r != leaver:
            assert f"rank {leaver}" in m, m


async def test_sub_group_without_the_lost_rank_keeps_working(ranks):
    async def body(g):
        sub = g.new_group([0, 1])
        if g.rank == 2:
            await asyncio.sleep(0.05)
            await g.runtime.close()
            return
        if g.rank in (0, 1):
            with pytest.raises(PeerLostError):
                await C.all_reduce(np.ones(4))  # world: rank 2 is gone
            x = np.ones(4)
            await C.all_reduce(x, group=sub)  # the sub-group does not need it
            assert (x == 2).all()
    await ranks(3, body, timeout_s=20)


# -- timeouts name the rank not heard from --------------------------------------------

@pytest.mark.parametrize("collective,n", [("barrier", 3), ("all_reduce", 2), ("broadcast", 3)])
async def test_timeout_names_the_missing_rank(ranks, collective, n):
    missing = n - 1
    # The missing rank stays until the others are done: leaving earlier (it once slept 1 s) races
    # with a first call slowed by a loaded machine, and the group then records the peer's
    # departure before its own timeout (a PeerLostError from the second barrier, not a timeout).
    done = asyncio.Event()
    waiting = [n - 1]

    async def body(g):
        if g.rank == missing:
            await asyncio.wait_for(done.wait(), 10)  # never calls
            return None
        try:
            return await _time_out_then_stay_failed(g)
        finally:
            waiting[0] -= 1
            if not waiting[0]:
                done.set()

    async def _time_out_then_stay_failed(g):
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            if collective == "barrier":
                await C.barrier(timeout=0.3)
            elif collective == "broadcast":  # every rank waits on the root
                await C.broadcast(np.ones(4), src=missing, timeout=0.3)
            else:
                await C.all_reduce(np.ones(4), timeout=0.3)
        assert time.monotonic() - start < 2
        with pytest.raises(CollectiveTimeoutError):  # the group stays failed
            await C.barrier()
        return info.value

    results = await ranks(n, body, timeout_s=20)
    for r in range(n - 1):
        # named as a rank waited on (its frames) or as one that had not reached the call (a
        # shared-memory wait posts no receive to be outstanding when the deadline lands)
        named = results[r].missing + results[r].absent
        assert missing in named, (r, results[r].missing, results[r].absent, str(results[r]))
        said = str(results[r])
        assert f"; rank {missing} had not reached this call" in said or f" waiting on rank {missing}" in said, said


async def test_a_peer_lost_while_a_timeout_is_diagnosed_does_not_replace_the_groups_error(ranks, monkeypatch):
    """The timed-out call asks the others whether they arrived; a peer lost during that question
    must not become the group's error: the call and every later call raise the same timeout."""
    from runtime.group import ProcessGroup
    asked = ProcessGroup._not_arrived

    async def lost_meanwhile(self, call):
        self.abort(PeerLostError("rank 1 lost", rank=1), tell_peers=False)  # as the runtime does on a loss
        return await asyncio.wait_for(asked(self, call), 5)

    monkeypatch.setattr(ProcessGroup, "_not_arrived", lost_meanwhile)
    done = asyncio.Event()

    async def body(g):
        if g.rank == 1:
            await asyncio.wait_for(done.wait(), 10)  # never calls
            return None
        try:
            with pytest.raises(CollectiveTimeoutError) as info:
                await C.all_reduce(np.ones(4), timeout=0.3)
            with pytest.raises(CollectiveTimeoutError) as later:
                await C.barrier()
            assert later.value is info.value
            assert "rank 1 had not reached this call" in str(info.value), str(info.value)
        finally:
            done.set()

    await ranks(2, body, timeout_s=20)


# -- point to point ---------------------------------------------------------------------

async def test_send_recv_tags_order_and_errors(ranks):
    async def body(g):
        if g.rank == 0:
            for i in range(3):
                await C.send(np.full(4, i, np.int32), dst=1, tag=5)
            await C.send(np.full(4, 9, np.int32), dst=1, tag=6)
            await C.send(np.ones(3, np.int32), dst=1, tag=7)
        else:
            x = np.empty(4, np.int32)
            await C.recv(x, src=0, tag=6)  # tags are separate queues
            assert (x == 9).all()
            for i in range(3):  # one tag keeps its order
                await C.recv(x, src=0, tag=5)
                assert (x == i).all()
            with pytest.raises(ValueError, match="12 bytes"):
                await C.recv(np.empty(4, np.int32), src=0, tag=7)
            with pytest.raises(CollectiveTimeoutError, match="rank 0"):
                await C.recv(x, src=0, tag=8, timeout=0.2)
            with pytest.raises(ValueError, match="this rank"):
                await C.recv(x, src=1)
    await ranks(2, body)


@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_recv_timeout_names_messages_waiting_under_another_tag(ranks, transport):
    """The usual reason a receive never completes: the sender used another tag. Its
    timeout says what is waiting from that rank, and under which tags."""
    async def body(g):
        if g.rank == 0:
            for _ in range(2):
                await C.send(np.ones(3, np.float32), dst=1, tag=2)
            await C.barrier()
            return None
        x = np.empty(3, np.float32)
        await asyncio.sleep(0.1)  # both sent by now
        with pytest.raises(CollectiveTimeoutError) as info:
            await C.recv(x, src=0, tag=1, timeout=0.3)
        for _ in range(2):  # they are still there to take
            await C.recv(x, src=0, tag=2)
        await C.barrier()
        return str(info.value)

    message = (await ranks(2, body, transport=transport))[1]
    assert "recv from rank 0 (tag 1)" in message and "2 message(s), 24 bytes, under tag 2" in message, message


# -- deadlines: one watchdog per runtime (runtime/group.py Watchdog) ---------------------

async def test_cancelling_a_call_is_not_a_timeout(ranks):
    """A caller's own cancellation stays a CancelledError (not a CollectiveTimeoutError),
    and the watchdog's timer is left for the calls still in flight."""
    async def body(g):
        if g.rank == 1:
            await asyncio.sleep(0.6)  # never calls the first all_reduce
            return None
        task = asyncio.ensure_future(C.all_reduce(np.ones(4), timeout=5.0))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not g.runtime.watchdog._calls  # unwatched on the way out
        return "cancelled"

    assert (await ranks(2, body, timeout_s=20))[0] == "cancelled"


async def test_calls_in_flight_each_keep_their_own_deadline(ranks):
    """Two calls in flight on two groups, the later-started with the shorter timeout: it times
    out at its own deadline (the watchdog re-arms for the earlier one), not at the other's."""
    async def body(g):
        a = g.new_group([0, 1])
        b = g.new_group([0, 1])
        if g.rank == 1:
            await asyncio.sleep(1.5)  # calls neither
            return None
        slow = asyncio.ensure_future(C.all_reduce(np.ones(2), group=a, timeout=1.0))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError):
            await C.all_reduce(np.ones(2), group=b, timeout=0.2)
        fast_s = time.monotonic() - start
        with pytest.raises(CollectiveTimeoutError):
            await slow
        slow_s = time.monotonic() - start
        return fast_s, slow_s

    fast_s, slow_s = (await ranks(2, body, timeout_s=20))[0]
    assert 0.15 < fast_s < 0.9, fast_s  # its own 0.2 s (plus the status question), not 1.0 s
    assert slow_s > 0.8, slow_s  # the first call waited for its own 1.0 s
