"""Membership by generation (runtime/membership.py): the pure decision, transition by transition;
then the executors over the memory store and the TCP store, with concurrent proposers (tasks and
threads), proposers that die at any point, too few members, joiners, and random interleavings.
The property every test checks: one decision per generation, the same on every process that got one."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from runtime.errors import ExcludedError, MembershipError, MembershipTimeoutError, TooFewMembersError
from runtime.membership import (
    LATEST,
    Action,
    Bounds,
    Generation,
    View,
    current,
    decide,
    join,
    joiners_waiting,
    next_generation,
    record,
)
from runtime.store import MemoryStore, PrefixStore
from runtime.store_server import ServerThread, StoreServer
from runtime.store_tcp import TCPStore

pytestmark = pytest.mark.timeout(60)

G0 = Generation(0, ("a", "b", "c", "d"))


# -- the decision, transition by transition (no store, no clock) -------------------------------

def test_waits_for_members_not_taken_for_lost():
    view = View(G0.members, alive=frozenset("ab"), lost=frozenset("d"))
    assert decide(view, Bounds(1, 4)) == (Action.WAIT_FOR_MEMBERS, ())


def test_proposes_survivors_in_rank_order_once_all_expected_checked_in():
    view = View(G0.members, alive=frozenset("cab"), lost=frozenset("d"))
    assert decide(view, Bounds(1, 4)) == (Action.PROPOSE, ("a", "b", "c"))


def test_a_member_taken_for_lost_is_left_out_even_if_it_checked_in():
    view = View(G0.members, alive=frozenset("abcd"), lost=frozenset("b"))
    assert decide(view, Bounds(1, 4)) == (Action.PROPOSE, ("a", "c", "d"))


def test_after_settling_proposes_whoever_checked_in():
    view = View(G0.members, alive=frozenset("ad"), settled=True)
    assert decide(view, Bounds(1, 4)) == (Action.PROPOSE, ("a", "d"))


def test_joiners_follow_in_order_up_to_the_maximum_without_repeats():
    view = View(("a", "b"), alive=frozenset("ab"), joiners=("x", "a", "y", "x", "z"))
    assert decide(view, Bounds(1, 4)) == (Action.PROPOSE, ("a", "b", "x", "y"))


def test_below_the_minimum_waits_for_joiners_then_closes():
    view = View(G0.members, alive=frozenset("a"), lost=frozenset("bcd"))
    assert decide(view, Bounds(2, 4))[0] is Action.WAIT_FOR_JOINERS
    assert decide(View(G0.members, alive=frozenset("a"), lost=frozenset("bcd"), joiners=("x",)),
                  Bounds(2, 4)) == (Action.PROPOSE, ("a", "x"))
    closing = View(G0.members, alive=frozenset("a"), lost=frozenset("bcd"), joining_over=True)
    assert decide(closing, Bounds(2, 4)) == (Action.CLOSE, ("a",))


def test_the_first_generation_waits_for_its_last_call_unless_full():
    bounds = Bounds(2, 3)
    assert decide(View(None, joiners=("x", "y"), last_call_over=False), bounds)[0] is Action.WAIT_FOR_JOINERS
    assert decide(View(None, joiners=("x", "y"), last_call_over=True), bounds) == (Action.PROPOSE, ("x", "y"))
    assert decide(View(None, joiners=("x", "y", "z", "w"), last_call_over=False), bounds) == (
        Action.PROPOSE, ("x", "y", "z"))
    assert decide(View(None, joiners=("x",), joining_over=True), bounds)[0] is Action.CLOSE


def test_bounds_and_ids_are_checked():
    with pytest.raises(ValueError, match="min_size <= max_size"):
        Bounds(3, 2)
    with pytest.raises(ValueError, match="member id"):
        Bounds()  # fine
        asyncio.run(next_generation(MemoryStore(), "", G0))


# -- the executors ---------------------------------------------------------------------------------

async def survivors_decide(store, gen: Generation, survivors, lost_views=None, **kw):
    """next_generation on every survivor at once; returns {member: Generation or exception}."""
    lost_views = lost_views or {}

    async def one(m):
        return await next_generation(store, m, gen, lost=lost_views.get(m, ()), **kw)
    results = await asyncio.gather(*(one(m) for m in survivors), return_exceptions=True)
    return dict(zip(survivors, results))


async def test_concurrent_survivors_agree_on_one_set_in_rank_order():
    store = PublishTogether(PrefixStore("elastic", MemoryStore()), 3)
    got = await survivors_decide(store, G0, ["d", "a", "c"], {m: ["b"] for m in "acd"}, settle_s=5)
    assert set(got.values()) == {Generation(1, ("a", "c", "d"))}
    assert [got[m].rank(m) for m in "acd"] == [0, 1, 2]
    assert await store.get(LATEST) == b"1"
    assert await current(store) == Generation(1, ("a", "c", "d"))


class PublishTogether:
    """A store whose compare_set of a generation's record waits until every proposer reached it:
    every proposal is in flight at once."""

    def __init__(self, store, parties: int):
        self.store, self.barrier = store, asyncio.Barrier(parties)

    def __getattr__(self, name):
        return getattr(self.store, name)

    async def compare_set(self, key, expected, desired):
        if key != LATEST:
            async with asyncio.timeout(10):
                await self.barrier.wait()
        return await self.store.compare_set(key, expected, desired)


async def test_different_suspicions_published_at_once_still_give_one_decision():
    """c is gone; a takes b for lost too, and b takes a; both publish at once: one wins alone."""
    store = PublishTogether(MemoryStore(), 2)
    got = await survivors_decide(store, Generation(0, ("a", "b", "c")), ["a", "b"],
                                 {"a": ["b", "c"], "b": ["a", "c"]}, settle_s=5)
    decided = [r for r in got.values() if isinstance(r, Generation)]
    assert len(decided) == 1 and decided[0].size == 1
    (left_out,) = [m for m, r in got.items() if isinstance(r, ExcludedError)]
    assert decided[0].members != (left_out,) and left_out in str(got[left_out])


async def test_a_member_that_died_silently_delays_the_others_by_settle_s_at_most():
    store = MemoryStore()
    t0 = time.monotonic()
    got = await survivors_decide(store, G0, ["a", "b", "c"], settle_s=0.3, timeout_s=10)
    elapsed = time.monotonic() - t0
    assert set(got.values()) == {Generation(1, ("a", "b", "c"))}
    assert 0.3 <= elapsed < 3.0


async def test_a_proposer_cancelled_mid_decision_blocks_nobody():
    store = MemoryStore()
    previous = Generation(0, ("a", "b", "c"))
    dying = asyncio.ensure_future(next_generation(store, "c", previous, settle_s=5))
    while not await store.check(["gen/1/alive/c"]):  # c checked in ...
        await asyncio.sleep(0)
    dying.cancel()  # ... and dies before it could publish
    with pytest.raises(asyncio.CancelledError):
        await dying
    t0 = time.monotonic()
    got = await survivors_decide(store, previous, ["a", "b"], settle_s=5, timeout_s=10)
    assert time.monotonic() - t0 < 2.0  # everyone it waited on had checked in: no settling
    assert set(got.values()) == {Generation(1, ("a", "b", "c"))}  # c is in; generation 2 will drop it


async def test_fewer_than_the_minimum_closes_the_job_for_everyone():
    store = MemoryStore()
    t0 = time.monotonic()
    got = await survivors_decide(store, G0, ["a", "b"], {m: ["c", "d"] for m in "ab"}, bounds=Bounds(3, 4),
                                 join_timeout_s=0.2, timeout_s=10)
    assert time.monotonic() - t0 < 1.5  # join_timeout_s after the members settled, not settle_s more
    for r in got.values():
        assert isinstance(r, TooFewMembersError) and r.generation == 1 and "minimum of 3" in str(r)


async def test_a_joiner_saves_a_job_below_its_minimum():
    store = MemoryStore()
    assert await record(store, G0, "launcher") == G0
    assert await record(store, Generation(0, ("z",)), "another") == G0  # recorded once
    survivors = asyncio.ensure_future(survivors_decide(store, G0, ["a", "b"], {m: ["c", "d"] for m in "ab"},
                                                       bounds=Bounds(3, 4), join_timeout_s=10, timeout_s=20))
    joined = await join(store, "x", timeout_s=20)
    got = await survivors
    assert joined == Generation(1, ("a", "b", "x")) and set(got.values()) == {joined}


async def test_a_late_member_is_excluded_then_grows_back_as_a_joiner():
    store = MemoryStore()
    await record(store, G0, "launcher")
    got = await survivors_decide(store, G0, ["a", "b", "c"], {m: ["d"] for m in "abc"}, settle_s=5)
    g1 = got["a"]
    with pytest.raises(ExcludedError):
        await next_generation(store, "d", G0)  # it was taken for lost: left out
    joining = asyncio.ensure_future(join(store, "d", timeout_s=20))
    while not await joiners_waiting(store, g1):  # what the members read at a step boundary
        await asyncio.sleep(0.01)
    grown = await survivors_decide(store, g1, list(g1.members), settle_s=5)
    assert await joining == Generation(2, ("a", "b", "c", "d")) and set(grown.values()) == {await joining}


async def test_the_first_generation_forms_from_joiners_and_the_extra_one_waits():
    store = MemoryStore()
    first = await asyncio.gather(*(join(store, m, bounds=Bounds(2, 3), last_call_s=5, timeout_s=20) for m in "xyz"))
    assert len(set(first)) == 1 and first[0].number == 0 and sorted(first[0].members) == ["x", "y", "z"]
    with pytest.raises(MembershipTimeoutError, match="generation 1"):
        await join(store, "w", bounds=Bounds(2, 3), timeout_s=0.3)  # full: nobody lets it in


async def test_a_malformed_record_is_refused():
    store = MemoryStore()
    await store.set("gen/1", msgpack.packb({"members": ["a", "a"], "by": "a"}))
    with pytest.raises(MembershipError, match="malformed"):
        await next_generation(store, "a", G0)
    await store.set("gen/1", b"\xc1")
    with pytest.raises(MembershipError, match="not msgpack"):
        await next_generation(store, "a", G0)


# -- over the TCP store: tasks with a client each, threads with a loop each -----------------------

async def test_tcp_store_concurrent_proposers_as_tasks():
    async with StoreServer("127.0.0.1", 0, secret=b"s") as server:
        clients = [await TCPStore.connect("127.0.0.1", server.port, secret=b"s", timeout_s=10) for _ in range(4)]
        try:
            results = await asyncio.gather(*(
                next_generation(PrefixStore("elastic", c), m, G0, lost=["b"], settle_s=5)
                for c, m in zip(clients, "acd")))
            broken = clients[3]
            await broken.close()  # a client whose store connection is gone gets a typed error
            with pytest.raises(Exception) as info:
                await next_generation(broken, "a", results[0])
            assert "closed" in str(info.value)
        finally:
            for c in clients:
                await c.close()
    assert set(results) == {Generation(1, ("a", "c", "d"))}


def test_tcp_store_concurrent_proposers_as_threads():
    n = 6
    previous = Generation(4, tuple(f"m{i}" for i in range(n)))
    results: dict[str, object] = {}
    with ServerThread("127.0.0.1", 0, secret=b"s") as server:
        start = threading.Barrier(n - 1)

        def proposer(m: str) -> None:
            async def go():
                store = await TCPStore.connect("127.0.0.1", server.port, secret=b"s", timeout_s=10)
                try:
                    start.wait(10)
                    return await next_generation(store, m, previous, lost=["m3"], settle_s=5, timeout_s=20)
                finally:
                    await store.close()
            try:
                results[m] = asyncio.run(go())
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                results[m] = exc

        threads = [threading.Thread(target=proposer, args=(m,)) for m in previous.members if m != "m3"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert set(results.values()) == {Generation(5, ("m0", "m1", "m2", "m4", "m5"))}, results


# -- random interleavings --------------------------------------------------------------------------

class JitterStore:
    """A store that yields to the loop a random number of times around every call, and can make
    its user die (raise) at its k-th call: random interleavings of the proposers."""

    class Died(Exception):
        pass

    def __init__(self, store, rng: random.Random, die_at: int | None = None):
        self.store, self.rng, self.die_at, self.calls = store, rng, die_at, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        async def call(*args, **kw):
            self.calls += 1
            if self.die_at is not None and self.calls >= self.die_at:
                raise JitterStore.Died()
            for _ in range(self.rng.randrange(4)):
                await asyncio.sleep(0)
            result = await method(*args, **kw)
            for _ in range(self.rng.randrange(4)):
                await asyncio.sleep(0)
            return result
        return call


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: a failure shows at once
@given(n=st.integers(2, 6), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_random_interleavings_always_give_one_decision(n, seed, data):
    members = tuple(f"m{i}" for i in range(n))
    rng = random.Random(seed)
    absent = set(data.draw(st.sets(st.sampled_from(members), max_size=n - 1)))  # lost before checking in
    dying = {m: data.draw(st.integers(1, 12)) for m in data.draw(st.sets(st.sampled_from(members)))
             if m not in absent}  # die at their k-th store call, maybe after checking in
    suspected = {m: set(data.draw(st.sets(st.sampled_from(sorted(absent)) if absent else st.nothing())))
                 for m in members}
    min_size = data.draw(st.integers(1, n))
    silent = any((absent | set(dying)) - suspected[m] - {m} for m in members if m not in absent)  # may settle

    async def scenario():
        base = MemoryStore()
        previous = Generation(7, members)

        async def one(m):
            store = JitterStore(base, random.Random(rng.random()), dying.get(m))
            return await next_generation(store, m, previous, lost=suspected[m], bounds=Bounds(min_size, n),
                                         settle_s=0.05 if silent else 30, join_timeout_s=0.05, timeout_s=30)
        out = await asyncio.gather(*(one(m) for m in members if m not in absent), return_exceptions=True)
        return dict(zip([m for m in members if m not in absent], out)), base

    results, base = asyncio.run(scenario())
    decided = {r for r in results.values() if isinstance(r, Generation)}
    assert len(decided) <= 1, results
    for m, r in results.items():
        assert isinstance(r, (Generation, ExcludedError, TooFewMembersError, JitterStore.Died)), (m, r)
    finished = {m: r for m, r in results.items() if not isinstance(r, JitterStore.Died)}
    if any(isinstance(r, TooFewMembersError) for r in finished.values()):
        assert all(isinstance(r, TooFewMembersError) for r in finished.values()), results
    if decided:
        (gen,) = decided
        assert gen.number == 8 and len(gen.members) >= min_size
        assert set(gen.members) <= set(members) - absent  # nobody that never checked in
        assert list(gen.members) == [m for m in members if m in gen.members]  # rank order kept
        for m, r in finished.items():
            assert isinstance(r, Generation) == (m in gen.members), (m, r)
        never_doubted = set(members) - absent - set(dying) - set().union(*(suspected[m] for m in results))
        if not silent:
            assert never_doubted <= set(gen.members), (never_doubted, gen)
