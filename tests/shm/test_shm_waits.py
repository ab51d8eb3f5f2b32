"""runtime.sharedmem.waits on its own: members as views (:class:`Phases`) of control segments in
this process, a thread posting for the peers. What wakes a wait (a ring, sent only to a waiter
whose want a post made true), what ends one (the caller's deadline, a peer whose process is gone,
a peer in another call), and that a wait that ends withdraws its want."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from runtime import turns
from runtime.errors import CollectiveMismatchError, PeerLostError
from runtime.sharedmem import segments, waits
from tests.loopturns import counted

pytestmark = pytest.mark.timeout(30)


class _Group:
    """What Phases reads of a group: its rank, id, global ranks, error, abort."""

    def __init__(self, rank: int, size: int):
        self.rank, self.gid, self.ranks = rank, 0, list(range(size))
        self.error = None
        self.told: list[bool] = []

    def abort(self, exc, tell_peers: bool = True):
        if self.error is None:
            self.error = exc
            self.told.append(tell_peers)


class _Call:
    def __init__(self, seq: int, fingerprint: str):
        self.seq, self.fingerprint = seq, fingerprint


def _members(n: int, pids: list[int]):
    """n control segments (member p's pid written as ``pids[p]``) and a Phases view per member."""
    ctl = []
    for p in range(n):
        seg = segments.Segment.create(os.path.join(segments.SHM_DIR, f"ringweave-waits{os.getpid()}-{p}"), 4096)
        seg.unlink()  # mapped: the name is not needed
        seg.mm[waits.OFF_PID:waits.OFF_PID + 4] = pids[p].to_bytes(4, "little")
        ctl.append(seg)
    views = []
    for p in range(n):
        view = waits.Phases(_Group(p, n), list(range(n)))
        view.watch(ctl)
        views.append(view)
    return views, ctl


@pytest.fixture
def members():
    """Member 0 is this rank; the peers' pids are a live process other than this one, so member
    0's waits block the thread on the futex (not the cooperative waits of in-process ranks)."""
    made = []

    def make(n: int, peer_pid: int | None = None):
        views, ctl = _members(n, [os.getpid()] + [peer_pid or os.getppid()] * (n - 1))
        made.append((views, ctl))
        assert not views[0].cooperative
        return views

    yield make
    for views, ctl in made:
        for v in views:
            v.unwatch()
        for seg in ctl:
            seg.close()


def _want(view) -> int:
    return view._wants[view.rank].value


@pytest.mark.parametrize("peers", [None, [2]], ids=["all", "one"])
async def test_a_wait_is_woken_by_the_post_that_meets_it_and_by_no_other(members, monkeypatch, peers):
    """Member 0 waits for phase 2 (of everyone, or of member 2 alone). Member 1's post does not
    meet it and rings nobody; member 2's does and rings member 0 once. The slice is made long, so
    only the ring can end the sleep in time."""
    monkeypatch.setattr(waits, "SLICE_S", 10.0)
    monkeypatch.setattr(turns, "TURN_S", 10.0)  # (the loop's turns would cut the slice short too)
    me, one, two = members(3)
    call = _Call(7, "all_reduce float32[4] sum")
    for v in (me, one, two):
        v.publish_fingerprint(call)
    one.post(call, 1)
    posted_at = []

    def peers_post():
        time.sleep(0.2)  # member 0 is asleep by now
        one.post(call, 2)
        time.sleep(0.2)
        posted_at.append(time.monotonic())
        two.post(call, 2)

    thread = threading.Thread(target=peers_post)
    thread.start()
    try:
        await me.wait_all(call, 2, peers=peers)
        woke_at = time.monotonic()
    finally:
        thread.join(10)
    assert woke_at - posted_at[0] < 2.0, "the wait outslept the post that met it"
    assert (one.statistics_["rings"], two.statistics_["rings"]) == (0, 1)
    assert me.statistics_["sleeps"] >= 1 and _want(me) == 0


async def test_a_wait_ends_at_its_callers_deadline_and_withdraws_its_want(members):
    """Nobody posts: the wait sleeps in slices and gives the loop a turn after each, so the
    caller's deadline (the call's, in group.run) ends it within about a slice."""
    me, _ = members(2)
    call = _Call(3, "barrier")
    me.publish_fingerprint(call)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(me.wait_all(call, 1), 0.2)
    assert time.monotonic() - started < 1.5
    assert me.statistics_["sleeps"] >= 1, "it never slept on the doorbell"
    assert _want(me) == 0  # a poster will not ring a waiter that left


async def test_a_blocking_wait_sleeps_no_longer_than_the_loops_turn_allows(members, monkeypatch):
    """However long a slice is, a wait that blocks its thread sleeps at most until the loop's turn
    is due (runtime/turns.py left), and gives the loop that turn before it sleeps again: every
    futex sleep is asked for at most TURN_S, and the loop's other tasks run between sleeps."""
    monkeypatch.setattr(waits, "SLICE_S", 10.0)
    asked = []
    futex_wait = waits.futex_wait

    def recorded(address, expected, timeout_s):
        asked.append(timeout_s)
        return futex_wait(address, expected, timeout_s)
    monkeypatch.setattr(waits, "futex_wait", recorded)
    me, _ = members(2)
    call = _Call(5, "barrier")
    me.publish_fingerprint(call)
    async with counted() as turned:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(me.wait_all(call, 1), 0.05)
    assert asked and max(asked) <= turns.TURN_S, f"a sleep of {max(asked)} s was asked for"
    assert turned.count >= len(asked) - 1, "the loop did not turn between the sleeps"
    assert _want(me) == 0


async def test_a_peer_whose_process_is_gone_ends_the_wait_naming_it(members):
    with open("/proc/sys/kernel/pid_max") as f:
        gone = int(f.read())  # pids are below pid_max: no process has this one
    me, _ = members(2, peer_pid=gone)
    me.group.ranks = [10, 11]  # global ranks: the error names the peer's
    call = _Call(4, "barrier")
    me.publish_fingerprint(call)
    with pytest.raises(PeerLostError, match=rf"rank 11 \(pid {gone}\) is gone: its process no longer exists"):
        await asyncio.wait_for(me.wait_all(call, 1), 10)
    assert isinstance(me.group.error, PeerLostError) and me.group.told == [False]
    assert _want(me) == 0


async def test_a_peer_in_another_call_ends_the_wait_naming_both_calls(members):
    me, peer = members(2)
    mine, theirs = _Call(5, "all_reduce float32[4] sum"), _Call(5, "broadcast int8[9] root=1")
    me.publish_fingerprint(mine)
    peer.publish_fingerprint(theirs)
    peer.post(theirs, 1)
    with pytest.raises(CollectiveMismatchError) as err:
        await asyncio.wait_for(me.wait_all(mine, 1), 10)
    assert "rank 0 called 'all_reduce float32[4] sum' but rank 1 called 'broadcast int8[9] root=1'" in str(err.value)
    assert me.group.error is err.value
