"""Elastic jobs: the rendezvous whose generations are decided by membership, and ``reform``.

Under ``python -m runtime.launch --elastic MIN:MAX`` every rank has RINGWEAVE_ELASTIC=MIN:MAX and a
member id (RINGWEAVE_MEMBER); :func:`from_env` then returns an :class:`ElasticRendezvous` (in
other jobs, what ``runtime.rendezvous.from_env`` returns). The launcher records generation 0 (the
first ranks, in rank order) under ``restart/<n>/elastic``; a rank it restarts
(RINGWEAVE_ELASTIC_JOIN=1) joins (membership ``join``) once the members grow to let it in.

    rdzv = elastic.from_env()                       # an ElasticRendezvous
    rt = await runtime.init(rendezvous=rdzv)        # generation 0, or the one a joiner entered
    ...  a collective raises PeerLostError ...
    rt = await elastic.reform(rt, rdzv, lost=elastic.lost_ranks(exc))   # generation g + 1

:func:`reform` closes the old generation's runtime (its groups stay failed, every peer is told),
decides the next generation with the survivors and the joiners waiting (``next_generation``:
one compare_set in the store), renumbers the members 0..n-1 in the decided order, and wires a new
runtime in the generation's namespace ``restart/<n>/gen/<g>``. Every wait is bounded by the
runtime's timeout; below MIN every member raises TooFewMembersError.

What it is not: failure detection (the collectives' errors), moving trainer state (trainer/elastic.py).
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

import msgpack

from runtime import auth, env, membership, scheduler
from runtime.errors import CollectiveTimeoutError, MembershipError, PeerLostError, RingweaveError, StoreTimeoutError
from runtime.init import _wire, set_current
from runtime.launch_config import elastic_prefix, parse_bounds
from runtime.rankruntime import RankRuntime
from runtime import rendezvous
from runtime.rendezvous import JOB_INFO_KEY, LauncherRendezvous, Membership, generation_prefix
from runtime.store import PrefixStore

__all__ = ["ElasticRendezvous", "from_env", "reform", "lost_ranks"]

log = logging.getLogger("ringweave.elastic")

SETTLE_S = 2.0  # how long survivors wait for a member that did not check in (membership's settle_s)
MAX_UNWIRED = 3  # generations in a row decided with a member that died before it connected


def lost_ranks(exc: BaseException) -> list[int]:
    """The ranks of the failed generation that ``exc`` names as lost (none: unknown, the next
    generation then waits ``settle_s`` for every member to check in). A timeout names the ranks
    that had not reached the call or did not answer (``absent``), not those its algorithm waited
    on (``missing``): in a ring, a rank waits on a live neighbour that itself waits on the stopped one."""
    if isinstance(exc, PeerLostError) and exc.rank is not None:
        return [exc.rank]
    if isinstance(exc, CollectiveTimeoutError):
        return sorted(set(exc.absent))
    return []


class ElasticRendezvous(LauncherRendezvous):
    """Generations decided by runtime/membership.py over the launcher's store (module docstring)."""
    kind = "elastic"

    def __init__(self, seat, *, secret: bytes | None = None, bounds: membership.Bounds, member: str,
                 joiner: bool, settle_s: float = SETTLE_S, first: tuple[str, ...] | None = None):
        super().__init__(seat, secret=secret)
        self.bounds, self.member, self.joiner, self.settle_s = bounds, membership.check_id(member), joiner, settle_s
        self.first = first  # generation 0's members when no launcher records it (srun): every rank records it
        self.generation: membership.Generation | None = None
        self._lost: list[str] = []

    def take_lost(self, ranks: Iterable[int]) -> None:
        """The next generation leaves out these ranks of the current one."""
        members = self.generation.members if self.generation else ()
        self._lost = [members[r] for r in ranks if 0 <= r < len(members)]

    async def next_rendezvous(self, timeout_s: float) -> Membership:
        """See base class: the first call reads generation 0 (or joins), later calls decide the next."""
        if self._closed:
            raise RingweaveError(f"{self!r} was shut down")
        if self._store is None:
            if self._secret is None:
                self._secret = auth.secret_from_env()
            self._store = await self._meet(timeout_s)
        seat, store = self.seat, PrefixStore(elastic_prefix(self.seat.restart), self._store)
        if self.generation is not None:
            lost, self._lost = self._lost, []
            self.generation = await membership.next_generation(
                store, self.member, self.generation, lost=lost, bounds=self.bounds, settle_s=self.settle_s,
                join_timeout_s=timeout_s, timeout_s=timeout_s + self.settle_s + timeout_s)
        elif self.joiner:
            self.generation = await membership.join(store, self.member, bounds=self.bounds,
                                                    join_timeout_s=timeout_s, timeout_s=4 * timeout_s)
        else:
            if self.first is not None:  # the same record from every rank: the first compare_set stands
                await membership.record(store, membership.Generation(0, self.first), self.member)
            raw = await store.get("gen/0", timeout_s)
            rec = membership.decode_record(raw, 0)
            if "members" not in rec:
                raise MembershipError(f"generation 0 of job {seat.job!r} was closed: {rec.get('closed')}", 0)
            self.generation = membership.Generation(0, tuple(rec["members"]))
        gen = self.generation
        rank = gen.rank(self.member)
        if rank == 0:
            await self._store.set(JOB_INFO_KEY, msgpack.packb(
                {"world_size": gen.size, "restart": seat.restart, "generation": gen.number}))
        view = PrefixStore(generation_prefix(seat.restart, gen.number), self._store)
        log.info("%s is rank %d of %d in generation %d", self.member, rank, gen.size, gen.number)
        return Membership(view, rank, gen.size, gen.number, rank, gen.size, self.master_addr, seat.job,
                          seat.restart, self._secret)

    async def leave(self, why: str) -> None:
        """Says in the store that this member leaves the job on purpose (``left/<member id>``: the
        launcher then counts its exit 0 as a leave, not as the job's end)."""
        store = PrefixStore(elastic_prefix(self.seat.restart), self._store)
        await store.set(f"left/{self.member}", why.encode()[:200])

    async def joiners_waiting(self) -> int:
        """How many processes wait to join the generation after this one (a counter read)."""
        store = PrefixStore(elastic_prefix(self.seat.restart), self._store)
        return await membership.joiners_waiting(store, self.generation)


def from_env(environ=None) -> rendezvous.Rendezvous:
    """rendezvous.from_env's choice, or, in a job of ``runtime.launch --elastic`` (RINGWEAVE_ELASTIC,
    RINGWEAVE_MEMBER, RINGWEAVE_ELASTIC_JOIN), an :class:`ElasticRendezvous` at the launcher's store.

    Raises:
        RingweaveError: RINGWEAVE_ELASTIC without RINGWEAVE_MEMBER or the launcher's store; what
            rendezvous.from_env raises.
    """
    environ = os.environ if environ is None else environ
    base = rendezvous.from_env(environ)
    if not env.ELASTIC.get(environ):
        return base
    member, first = env.MEMBER.get(environ), None
    if not member and isinstance(base, LauncherRendezvous):  # srun's tasks at a store of their own
        first = scheduler.slurm_members(environ)
        member = first[base.seat.rank] if first else None
    if not member or not isinstance(base, LauncherRendezvous):
        raise RingweaveError("RINGWEAVE_ELASTIC is set, but RINGWEAVE_MEMBER or the launcher's store is not: "
                             "start elastic jobs with python -m runtime.launch --elastic MIN:MAX, or with srun "
                             "and RINGWEAVE_STORE_HOSTED=1 at a python -m runtime.store")
    return ElasticRendezvous(base.seat, bounds=parse_bounds(env.ELASTIC.get(environ)), member=member,
                             joiner=env.ELASTIC_JOIN.get(environ), first=first)


async def reform(rt: RankRuntime, rdzv: ElasticRendezvous, *, lost: Iterable[int] = (),
                 reason: BaseException | None = None) -> RankRuntime:
    """Closes ``rt`` (telling its peers ``reason``) and returns the runtime of the next generation:
    the survivors not in ``lost`` (ranks of ``rt``'s generation) and the joiners waiting.

    A member of the decided generation that never publishes its address (it died after the
    decision) is taken for lost once the timeout passes: the generation after is decided without it
    (at most ``MAX_UNWIRED`` times in a row).

    Raises:
        TooFewMembersError: fewer than MIN remain and no joiner came in time (the job stops).
        ExcludedError: the generation was decided without this process.
        MembershipTimeoutError, StoreTimeoutError: undecided, or its members did not connect, in time.
    """
    timeout_s = rt.timeout_s
    rdzv.take_lost(lost)
    await rt.close(reason)
    unwired_tries = 0
    while True:
        m = await rdzv.next_rendezvous(timeout_s)
        try:
            new = await _wire(m, timeout_s, None)
        except StoreTimeoutError as exc:  # rendezvous.not_joined_error: the addr/<rank> keys missing
            unwired = sorted({int(k.rsplit("/", 1)[1]) for k in exc.keys  # keys ".../addr/<rank>"
                              if k.rsplit("/", 2)[-2:-1] == ["addr"] and k.rsplit("/", 1)[1].isdigit()})
            if not unwired or m.rank in unwired or unwired_tries == MAX_UNWIRED:
                raise
            unwired_tries += 1
            log.warning("generation %d: ranks %s never connected; deciding the next without them", m.generation,
                        unwired)
            rdzv.take_lost(unwired)
            continue
        set_current(new)
        return new
