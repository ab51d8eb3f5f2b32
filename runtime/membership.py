"""Membership by generation: which processes form generation g of a job, decided once through the
store's compare_set, so that no two processes ever hold different member sets for one g.

Keys, relative to the store given (e.g. ``PrefixStore("elastic", store)``)::

    gen/{g}             g's record, msgpack {members: [id, ...], by, why} or {closed: why, by}: written
                        once, by compare_set(expected=None); every proposer adopts what the key holds
    gen/latest          the highest decided g, ASCII (advisory: where a joiner starts looking)
    gen/{g}/alive/{id}  a member of g-1 that reached the decision of g (it checked in)
    gen/{g}/joiners     how many processes asked to join at g; gen/{g}/joiner/{k}: the k-th one's id

A member of g that loses a peer (or sees joiners waiting) calls :func:`next_generation`: it checks in,
waits until every member it does not take for lost has checked in (or ``settle_s`` passes), and
proposes: the members of g that checked in and are not taken for lost, in their order, then the
joiners in the order they came, up to the maximum; below the minimum it waits for joiners until
``join_timeout_s``, then proposes to close the job. The first compare_set wins; the others adopt it.
A process not in the decided set gets :class:`ExcludedError` and may :func:`join` again.

Rank r of a generation is ``members[r]``. :func:`decide` is the decision as a pure function of what
one proposer sees (:class:`View`); the executors (:func:`next_generation`, :func:`join`) read,
decide and publish, and every wait has a deadline. A proposer that dies at any point delays the
others by at most ``settle_s``. docs/design.md ("Elastic training") has the worked example.

What it is not: failure detection (the runtime's PeerLostError and timeouts name the lost),
rebuilding groups and connections (the rendezvous), moving state (the trainer).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Iterable

import msgpack

from runtime.errors import ExcludedError, MembershipError, MembershipTimeoutError, StoreTimeoutError, TooFewMembersError

__all__ = ["Bounds", "Generation", "Action", "View", "decide", "next_generation", "join", "record",
           "joiners_waiting", "current"]

MAX_ID_CHARS = 256  # a member id, e.g. "node3/12345/9f2c" (host, pid, a nonce)
LATEST = "gen/latest"
PRESENT_S = 5.0  # the bound of a get of a key known to be there (a TCP store needs time to answer)


def _record_key(g: int) -> str:
    return f"gen/{g}"


def _alive_key(g: int, member: str) -> str:
    return f"gen/{g}/alive/{member}"


def _joiners_key(g: int) -> str:
    return f"gen/{g}/joiners"


def _joiner_key(g: int, k: int) -> str:
    return f"gen/{g}/joiner/{k}"


def check_id(member: object) -> str:
    """Raises ValueError unless ``member`` is a non-empty printable str of at most MAX_ID_CHARS."""
    if type(member) is not str or not member or len(member) > MAX_ID_CHARS or not member.isprintable():
        raise ValueError(f"a member id is a non-empty printable str of at most {MAX_ID_CHARS} characters, "
                         f"got {member!r}")
    return member


@dataclass(frozen=True)
class Bounds:
    """How many members the job may have: ``python -m runtime.launch --elastic MIN:MAX``."""
    min_size: int = 1  # e.g. 2: with fewer the job stops (TooFewMembersError)
    max_size: int = 1 << 16  # e.g. 4: joiners beyond it wait for a later generation

    def __post_init__(self) -> None:
        if not (type(self.min_size) is int and type(self.max_size) is int and 1 <= self.min_size <= self.max_size):
            raise ValueError(f"need 1 <= min_size <= max_size, got {self.min_size}:{self.max_size}")


@dataclass(frozen=True)
class Generation:
    number: int  # g, e.g. 3 (the first generation is 0)
    members: tuple[str, ...]  # member ids; rank r is members[r]

    @property
    def size(self) -> int:
        return len(self.members)

    def rank(self, member: str) -> int:
        """The rank of ``member`` in this generation.

        Raises:
            ExcludedError: ``member`` is not one of them.
        """
        try:
            return self.members.index(member)
        except ValueError:
            raise ExcludedError(f"{member!r} is not a member of generation {self.number} "
                                f"({len(self.members)} members); it may join again", self.number) from None


class Action(enum.Enum):
    WAIT_FOR_MEMBERS = "wait for members"  # some member not taken for lost has not checked in yet
    WAIT_FOR_JOINERS = "wait for joiners"  # below the minimum (or the first generation's last call)
    PROPOSE = "propose"  # compare_set this member set
    CLOSE = "close"  # compare_set a closed record: too few, and no more time to wait


@dataclass(frozen=True)
class View:
    """What one proposer sees of generation g+1 before it is decided."""
    previous: tuple[str, ...] | None  # g's members in rank order; None: g+1 is the first generation
    alive: frozenset[str] = frozenset()  # of previous, those that checked in for g+1
    lost: frozenset[str] = frozenset()  # of previous, those this proposer takes for lost
    joiners: tuple[str, ...] = ()  # registered for g+1, in the order they came
    settled: bool = False  # the wait for members is over (all expected are in, or settle_s passed)
    last_call_over: bool = True  # the first generation: the wait for more than the minimum is over
    joining_over: bool = False  # no more waiting for joiners (join_timeout_s passed)


def decide(view: View, bounds: Bounds) -> tuple[Action, tuple[str, ...]]:
    """The next step of one proposer, and the member set it would propose. Pure: no I/O, no clock."""
    previous = view.previous or ()
    expected = [m for m in previous if m not in view.lost]
    if not view.settled and not all(m in view.alive for m in expected):
        return Action.WAIT_FOR_MEMBERS, ()
    survivors = [m for m in expected if m in view.alive]
    seen = set(previous)
    joiners = []
    for j in view.joiners:
        if j not in seen:
            seen.add(j)
            joiners.append(j)
    members = tuple((survivors + joiners)[:bounds.max_size])
    if len(members) >= bounds.max_size or (len(members) >= bounds.min_size and view.last_call_over):
        return Action.PROPOSE, members
    if view.joining_over:
        return (Action.PROPOSE, members) if len(members) >= bounds.min_size else (Action.CLOSE, members)
    return Action.WAIT_FOR_JOINERS, members


def encode_record(action: Action, members: tuple[str, ...], by: str, why: str) -> bytes:
    if action is Action.CLOSE:
        return msgpack.packb({"closed": why, "by": by})
    return msgpack.packb({"members": list(members), "by": by, "why": why})


def decode_record(raw: bytes, g: int) -> dict:
    """A record read from the store, checked (nothing from the network is trusted).

    Raises:
        MembershipError: not a record this module writes.
    """
    try:
        rec = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MembershipError(f"generation {g}: its record is not msgpack ({exc})", g) from None
    ok = isinstance(rec, dict) and type(rec.get("by")) is str
    if ok and "closed" in rec:
        ok = type(rec["closed"]) is str
    elif ok:
        members = rec.get("members")
        try:
            ok = (isinstance(members, list) and len(set(members)) == len(members) == len([check_id(m) for m in members])
                  and len(members) > 0)
        except ValueError:
            ok = False
    if not ok:
        raise MembershipError(f"generation {g}: malformed record {raw[:80]!r}", g)
    return rec


def _adopt(rec: dict, g: int, me: str) -> Generation:
    if "closed" in rec:
        raise TooFewMembersError(f"generation {g} was closed by {rec['by']!r}: {rec['closed']}", g)
    gen = Generation(g, tuple(rec["members"]))
    gen.rank(me)  # ExcludedError when we are not in it
    return gen


async def _peek(store, g: int) -> dict | None:
    """g's record if it is decided, without waiting."""
    if not await store.check([_record_key(g)]):
        return None
    return decode_record(await store.get(_record_key(g), PRESENT_S), g)


async def _wait_either(store, keys: list[str], g: int, until: float) -> dict | None:
    """Waits until every key of ``keys`` is present, g is decided, or ``until`` (monotonic) passes;
    returns g's record when it came first."""
    budget_s = max(0.0, until - time.monotonic())

    async def keys_present() -> None:
        try:
            await store.wait(keys, budget_s)
        except StoreTimeoutError:
            pass

    async def decided() -> bytes | None:
        try:
            return await store.get(_record_key(g), budget_s)
        except StoreTimeoutError:
            return None

    try:
        async with asyncio.TaskGroup() as tg:
            keys_task, record_task = tg.create_task(keys_present()), tg.create_task(decided())
            await asyncio.wait([keys_task, record_task], return_when=asyncio.FIRST_COMPLETED)
            keys_task.cancel()
            record_task.cancel()  # a no-op when it is done
    except BaseExceptionGroup as group:  # the store failed: its own typed error, not a group
        raise group.exceptions[0] from None
    if record_task.cancelled() or record_task.result() is None:
        return None
    return decode_record(record_task.result(), g)


async def _joiners(store, g: int) -> tuple[str, ...]:
    """The ids registered for g, in the order they came (one that counted itself and died before
    writing its id is skipped)."""
    count = await store.add(_joiners_key(g), 0)
    keys = [_joiner_key(g, k) for k in range(count)]
    found = []
    for key in keys:
        if await store.check([key]):
            found.append((await store.get(key, PRESENT_S)).decode("utf-8", "replace"))
    return tuple(found)


async def _publish(store, g: int, desired: bytes) -> dict:
    """compare_set of g's record; returns the record that won (ours or another's)."""
    rec = decode_record(await store.compare_set(_record_key(g), None, desired), g)
    value = str(g).encode()
    expected = None
    for _ in range(16):  # gen/latest only grows; each failed try saw a newer or older value
        seen = await store.compare_set(LATEST, expected, value)
        if seen == value or (seen.isdigit() and int(seen) >= g):
            break
        expected = seen
    return rec


async def _decide_loop(store, g: int, me: str, previous: tuple[str, ...] | None, lost: frozenset[str],
                       bounds: Bounds, *, settle_at: float, join_timeout_s: float, last_call_s: float | None,
                       deadline: float, why: str) -> dict:
    """Reads, decides and publishes until g is decided; returns its record."""
    min_seen_at = None  # when this proposer first saw the minimum (the first generation's last call)
    join_until = None  # how long joiners are waited for, counted once the members settled
    while True:
        rec = await _peek(store, g)
        if rec is not None:
            return rec
        now = time.monotonic()
        alive = frozenset([m for m in previous or () if await store.check([_alive_key(g, m)])])
        joiners = await _joiners(store, g)
        last_call_over = True
        if last_call_s is not None:  # the first generation: wait for more than the minimum, a while
            if min_seen_at is None and len(set(joiners)) >= bounds.min_size:
                min_seen_at = now
            last_call_over = min_seen_at is not None and now >= min_seen_at + last_call_s
        view = View(previous, alive, lost, joiners, settled=now >= settle_at, last_call_over=last_call_over,
                    joining_over=join_until is not None and now >= join_until)
        action, members = decide(view, bounds)
        if action is not Action.WAIT_FOR_MEMBERS and join_until is None:
            join_until = min(now + join_timeout_s, deadline)
        if action in (Action.PROPOSE, Action.CLOSE):
            reason = why if action is Action.PROPOSE else (
                f"{len(members)} members, fewer than the minimum of {bounds.min_size}, and no joiner came in time")
            return await _publish(store, g, encode_record(action, members, me, reason))
        if now >= deadline:
            raise MembershipTimeoutError(f"generation {g}: undecided after the timeout ({action.value}: "
                                         f"{len(alive)} checked in, {len(joiners)} joiners)", g)
        if action is Action.WAIT_FOR_MEMBERS:
            missing = [_alive_key(g, m) for m in previous or () if m not in lost and m not in alive]
            rec = await _wait_either(store, missing, g, min(settle_at, deadline))
        else:
            until = min(join_until, deadline)
            if min_seen_at is not None:
                until = min(until, min_seen_at + last_call_s)
            rec = await _wait_either(store, [_joiner_key(g, await store.add(_joiners_key(g), 0))], g, until)
        if rec is not None:
            return rec


async def next_generation(store, me: str, previous: Generation, *, lost: Iterable[str] = (),
                          bounds: Bounds = Bounds(), settle_s: float = 2.0, join_timeout_s: float = 30.0,
                          timeout_s: float = 60.0) -> Generation:
    """The generation after ``previous``, as one decision shared by every member that calls this.

    Args:
        store: the job's store (keys as in the module docstring).
        me: this process's member id (one of ``previous.members``).
        lost: members this process takes for lost (a PeerLostError's rank, the ranks a timeout
            names); they are left out even if they check in.
        settle_s: how long to wait for members not taken for lost to check in.
        join_timeout_s: below the minimum, how long to wait for joiners before closing the job.
        timeout_s: the whole call's deadline.
    Returns:
        the decided generation (``previous.number + 1``), this process in it.
    Raises:
        ExcludedError: decided without this process. TooFewMembersError: the job was closed.
        MembershipTimeoutError: undecided at the deadline. StoreError: the store is unreachable.
    """
    previous.rank(check_id(me))
    g = previous.number + 1
    start = time.monotonic()
    deadline = start + timeout_s
    rec = await _peek(store, g)
    if rec is None:
        await store.set(_alive_key(g, me), b"1")
        rec = await _decide_loop(
            store, g, me, previous.members, frozenset(lost) - {me}, bounds,
            settle_at=start + min(settle_s, timeout_s), join_timeout_s=join_timeout_s,
            last_call_s=None, deadline=deadline, why=f"after generation {previous.number}")
    return _adopt(rec, g, me)


async def join(store, me: str, *, bounds: Bounds = Bounds(), last_call_s: float = 1.0,
               join_timeout_s: float = 60.0, timeout_s: float = 120.0) -> Generation:
    """Joins the job: the first generation if none is decided yet, else a later one that its
    members decide to grow into (they see :func:`joiners_waiting`).

    Args:
        last_call_s: the first generation: once the minimum registered, how long to wait for more.
        join_timeout_s: the first generation: how long to wait for the minimum before closing it.
    Raises:
        TooFewMembersError: the generation it registered for was closed.
        MembershipTimeoutError: no generation took it before ``timeout_s``.
    """
    check_id(me)
    start = time.monotonic()
    deadline = start + timeout_s
    latest = await store.get(LATEST, PRESENT_S) if await store.check([LATEST]) else b"-1"
    g = int(latest) + 1 if latest.lstrip(b"-").isdigit() else 0
    while True:
        rec = await _peek(store, g)
        if rec is None:
            k = await store.add(_joiners_key(g), 1) - 1
            await store.set(_joiner_key(g, k), me.encode())
            if g == 0:  # nobody to let us in: the joiners decide the first generation themselves
                rec = await _decide_loop(store, 0, me, None, frozenset(), bounds, settle_at=start,
                                         join_timeout_s=join_timeout_s, last_call_s=last_call_s,
                                         deadline=deadline, why="the first generation")
            else:
                try:
                    rec = decode_record(await store.get(_record_key(g), max(0.0, deadline - time.monotonic())), g)
                except StoreTimeoutError:
                    raise MembershipTimeoutError(f"joining: generation {g} was not decided within {timeout_s:g} s "
                                                 f"(its members decide when they next look for joiners)", g) from None
        if "members" in rec and me in rec["members"]:
            return _adopt(rec, g, me)
        if "closed" in rec:
            _adopt(rec, g, me)  # raises TooFewMembersError
        if time.monotonic() >= deadline:
            raise MembershipTimeoutError(f"joining: no generation up to {g} took {me!r} within {timeout_s:g} s", g)
        g += 1  # decided without us (full, or before we registered): the next one


async def record(store, generation: Generation, by: str) -> Generation:
    """Records a generation decided elsewhere (a launcher that started the first one's ranks)
    the way a proposer would; returns the generation the store holds (``generation``, unless
    another was recorded first)."""
    rec = await _publish(store, generation.number, encode_record(Action.PROPOSE, generation.members, check_id(by),
                                                                   "recorded"))
    if "closed" in rec:
        raise TooFewMembersError(f"generation {generation.number} was closed by {rec['by']!r}: {rec['closed']}",
                                 generation.number)
    return Generation(generation.number, tuple(rec["members"]))


async def joiners_waiting(store, current: Generation) -> int:
    """How many processes asked to join the generation after ``current`` (a counter read: cheap)."""
    return await store.add(_joiners_key(current.number + 1), 0)


async def current(store) -> Generation | None:
    """The latest decided generation (for tools), or None before the first."""
    if not await store.check([LATEST]):
        return None
    g = int(await store.get(LATEST, PRESENT_S))
    rec = decode_record(await store.get(_record_key(g), PRESENT_S), g)
    return None if "closed" in rec else Generation(g, tuple(rec["members"]))
