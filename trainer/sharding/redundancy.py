"""Elastic training's part of a data-parallel strategy: the commit vote, the buddy replica, re-sharding.

What it is: `Redundancy(store)`, given as ``make_strategy(..., redundancy=Redundancy(store))``; without it a
strategy holds `NoRedundancy` (every method does nothing: the step is exactly the plain one).

    the vote      after every gradient collective and the statistics' sum, before any state
                  changes: collectives.commit.should_commit over the strategy's group; "no", or
                  a failure of this rank's step before it voted ("no" recorded for it), raises
                  StepAbortedError with parameters, optimizer state, scaler and step untouched
                  (a failure after the commit, in zero1/2's gathers, counts the step: step + 1)
    buddy         zero1/2, zero3/fsdp: rank r holds a copy of rank r+1's (mod N) master shard
                  and optimizer state as of the last refresh, and a log of what r+1 sent it
                  before each applied step since (its reduced gradient shards; the step's loss
                  scale, clip coefficient and lr). The copy is brought up to date only when it is
                  read (a re-shard that lost r+1): the log replayed with the step's own code on
                  the same inputs, bit-identical. Once ``refresh_every`` (K) steps are logged, r+1
                  sends its whole state at the next step and the log starts afresh: K bounds the
                  log's memory and the replay's time
    reshard       `reshard(s, new_group, lost)`: every survivor all_gathers its own shards and,
                  when it held a lost rank's replica, that one; each rebuilds the whole state,
                  pads it to the new world size, cuts its shard and its new buddy's (after a vote:
                  all members or none); a shard whose rank and holder are both lost raises
                  ShardLostError (the checkpoint)
    ddp           every rank holds everything: the vote only, nothing to replicate

`step_bytes(...)` is what elastic training adds to a step's bytes (the buddy send, the vote's
all_reduce; a refresh's: `refresh_bytes`); `memory_nbytes(s)` the buddy's resident bytes at most.
Refused (ValueError): hybrid sharding, a mesh, offload, gradient compression (its error feedback
would change before the vote). Not here: membership (runtime/membership.py), the loop, checkpoints.
"""

from __future__ import annotations

import asyncio

import numpy as np

from collectives.commit import decide, should_commit
from runtime.store import PrefixStore
from trainer.precision import unscale_
from trainer.sharding.accounted import AccountedCollectives
from trainer.sharding.base import ShardLostError, StepAbortedError

__all__ = ["Redundancy", "NoRedundancy", "reshard", "relay", "step_bytes", "refresh_bytes", "memory_nbytes",
           "VOTE_NBYTES", "REFRESH_EVERY"]

VOTE_NBYTES = 4  # the vote's int32 flag
# steps logged between two refreshes of a buddy copy: a refresh sends (1 + optimizer buffers) x a step's
# message (Adam: 3x), so 8 adds 3/8 of a message a step on average; a recovery replays at most 8 steps
REFRESH_EVERY = 8
BUDDY_TAG = 0x0E1A  # the p2p tag of the buddy's gradient message
REFRESH_TAG = 0x0E1B  # the p2p tag of a buddy's whole shard (refresh)


class NoRedundancy:
    """A strategy without elastic training: nothing is voted, replicated or re-sharded."""

    enabled = False

    def attach(self, s) -> None:
        pass

    def adopt(self, s, full, full_states=None) -> None:
        pass

    async def exchange(self, s, scale: float) -> None:
        pass

    async def abort(self, s, exc: BaseException) -> None:
        pass

    async def guard(self, s, coro) -> None:
        await coro

    async def commit(self, s) -> None:
        pass

    async def refresh(self, s) -> None:
        pass

    def step_buddy(self, s, i: int, coef: float, lr: float) -> None:
        pass

    async def settle(self, s, coro) -> None:
        await coro

    def reform(self, s, store) -> None:
        pass


class Redundancy(NoRedundancy):
    """Elastic training on (the module docstring). ``store``: the generation's store (the commit
    decisions live there); ``timeout``: the vote's deadline in seconds; ``refresh_every``: K, the
    steps logged before the buddy sends its whole state again (1: every step)."""

    enabled = True

    def __init__(self, store, *, timeout: float = 30.0, refresh_every: int = REFRESH_EVERY) -> None:
        if int(refresh_every) != refresh_every or refresh_every < 1:
            raise ValueError(f"refresh_every must be a whole number of steps >= 1, got {refresh_every!r}")
        self.base_store, self.timeout, self.refresh_every = store, float(timeout), int(refresh_every)
        self.store, self._group, self._groups = store, None, 0
        self._masters: list = []  # buddy's master shards as of the last refresh (+ what was replayed)
        self._states: list = []  # buddy's optimizer states, likewise
        self.segments: list = []
        self.log: list[tuple[np.ndarray, float, float, float]] = []  # (message, scale, coef, lr) per applied step
        self._inbox: tuple[np.ndarray, float] | None = None  # this step's message and loss scale, until applied
        self._spare: list[np.ndarray] = []  # messages replayed or refreshed away: the next steps receive into them
        self._swap = None  # this step's buddy messages, a coroutine started by ``guard``
        self._shapes: tuple[list, int] = ([], 1)  # (lengths, N) the logged messages are cut by

    @property
    def masters(self) -> list:
        """The buddy's master shards now: the log replayed first."""
        self.replay()
        return self._masters

    @property
    def states(self) -> list:
        """The buddy's optimizer states now: the log replayed first."""
        self.replay()
        return self._states

    def log_nbytes(self) -> int:
        return sum(entry[0].nbytes for entry in self.log)

    def attach(self, s) -> None:
        why = ("hybrid sharding" if s.replicas.size > 1 else "a tensor/pipeline mesh" if s.model_parallel.group
               else "offload" if s.config.offload else "gradient compression" if s.collectives.codec else None)
        if why:
            raise ValueError(f"{s.name}: elastic training covers the plain data-parallel dimension; not with {why}")
        self._group, self._optimizer = s.group, s.optimizer

    def _has_buddy(self, s) -> bool:
        return not s.replicated_state and s.N > 1

    def adopt(self, s, full, full_states=None) -> None:
        """At setup (``full``: every unit's padded initial master) or after a re-shard (and
        ``full_states``: every unit's whole optimizer buffers): builds the buddy's copies, the log empty."""
        self._inbox, self.log, self._spare = None, [], []  # (the shards' lengths may have changed)
        self._drop_swap()
        self._masters, self._states, self.segments = [], [], []
        if not self._has_buddy(s):
            return
        self._shapes = (list(s.lengths), s.N)
        b = (s.rank + 1) % s.N
        for i, unit in enumerate(s.units):
            sl = slice(b * s.lengths[i] // s.N, (b + 1) * s.lengths[i] // s.N)
            self._masters.append(full[i][sl].copy())  # its own: the log is replayed onto it
            state = s.optimizer.init_state(sl.stop - sl.start, s.master_dtype)
            if full_states is not None:
                for name, buf in state.buffers.items():
                    buf[:] = full_states[i][name][sl]
                state.step = s.states[i].step
            self._states.append(state)
            self.segments.append([(0, sl.stop - sl.start, True)] if s.config.decay == "all"
                                 else unit.decay_segments(sl.start, sl.stop))

    async def exchange(self, s, scale: float) -> None:
        """Right after this rank's gradient collectives: copies its reduced gradient shards into the
        message for its holder (rank - 1), to travel while the statistics are summed (``guard``), as
        the buddy's (rank + 1) arrives; kept with ``scale`` until the step is applied (``step_buddy``
        logs it). When K steps are logged (or a checkpoint was loaded), a ``refresh`` goes first."""
        self._inbox = None
        self._drop_swap()
        if not self._has_buddy(s):
            return
        mine = np.concatenate([g for _, g, _ in s._opt_shards()])  # a copy: the step unscales its own in place
        self._swap = self._swap_messages(s, mine, scale)

    async def _swap_messages(self, s, mine: np.ndarray, scale: float) -> None:
        if any(copy.step + len(self.log) != own.step for copy, own in zip(self._states, s.states)):
            await self.refresh(s)  # a checkpoint was loaded since (the same on every rank: it loaded one)
        elif len(self.log) >= self.refresh_every:
            await self.refresh(s)  # every rank logged the same steps: all refresh in this step
        inbox = self._take_spare(mine)  # every rank's shards have the same lengths
        await _together(s.collectives.send(mine, (s.rank - 1) % s.N, BUDDY_TAG),
                        s.collectives.recv(inbox, (s.rank + 1) % s.N, BUDDY_TAG))
        self._inbox = (inbox, scale)

    def _take_spare(self, like: np.ndarray) -> np.ndarray:
        """A buffer for this step's message: one a replay or refresh freed (no allocation in the steady
        state: K buffers go round), else a new one. A receive that failed keeps its buffer out of the
        pool (it is never logged), so no late frame can land in a message in use."""
        for k, spare in enumerate(self._spare):
            if spare.shape == like.shape and spare.dtype == like.dtype:
                return self._spare.pop(k)
        return np.empty_like(like)

    def _free(self, entries) -> None:
        self._spare.extend(entry[0] for entry in entries)
        del self._spare[self.refresh_every:]

    def _drop_swap(self) -> None:
        """A message that never left (the step failed between ``exchange`` and ``guard``): closed unrun."""
        if self._swap is not None:
            self._swap.close()
            self._swap = None

    async def abort(self, s, exc: BaseException) -> None:
        """This rank's step failed before its vote: records "no" for the step (the decision cannot be
        "yes": this rank never voted) and raises StepAbortedError from ``exc``."""
        if not isinstance(exc, Exception):
            return  # a cancellation, an interrupt: not a step outcome
        self._switch(s)
        await decide(self.store, s.step, False)
        raise StepAbortedError(f"{s.name}: step {s.step} discarded on every member ({type(exc).__name__}: "
                               f"{exc}); no state changed", s.step) from exc

    async def guard(self, s, coro) -> None:
        """Awaits ``coro`` (the statistics' sum) and the buddy messages together: both complete before
        the vote. A failure of either records "no" for the step (``abort``)."""
        swap, self._swap = self._swap, None
        try:
            await (coro if swap is None else _together(coro, swap))
        except BaseException as exc:
            await self.abort(s, exc)
            raise

    async def commit(self, s) -> None:
        """The vote; raises StepAbortedError when the step is discarded."""
        self._switch(s)
        acc = s.collectives
        if not await acc._timed(acc._ring(VOTE_NBYTES, 2.0), should_commit(s.group, self.store, s.step, ok=True,
                                                                          timeout=self.timeout)):
            raise StepAbortedError(f"{s.name}: step {s.step} discarded on every member (a member's collectives "
                                   f"of it did not complete); no state changed", s.step)

    async def settle(self, s, coro) -> None:
        """After the commit (zero1/2's parameter all_gathers): the step is applied on every member
        whatever fails now, so a failure counts it (``s.step`` advances) and then propagates; the
        replicated parameters are re-derived from the master shards (``reshard``, or the next call)."""
        try:
            await coro
        except Exception:
            s.step += 1
            s._stale = True
            raise

    def _switch(self, s) -> None:
        """A new group (a re-shard): its decisions go under a namespace of their own."""
        if s.group is not self._group:
            self._group, self._groups = s.group, self._groups + 1
            self.store = PrefixStore(f"group{self._groups}", self.base_store)

    def reform(self, s, store) -> None:
        """After a re-shard: the new generation's store, if the caller has one (the votes then go
        under it from its first group on: a joiner, whose strategy starts there, votes alike)."""
        if store is not None:
            self.base_store = self.store = store
            self._group, self._groups = s.group, 0

    async def refresh(self, s) -> None:
        """Fetches the buddy's master shard and optimizer state afresh (every rank sends its own to its
        holder, rank - 1) and empties the log: every K logged steps, and after a checkpoint was loaded
        (a resume, or the fallback when a shard had no copy left)."""
        if not self._has_buddy(s):
            return
        mine = np.concatenate([np.concatenate([s._master_shard(i), *s.states[i].buffers.values()])
                               for i in range(len(s.units))])
        inbox = np.empty_like(mine)  # every rank's shards have the same lengths
        await _together(s.collectives.send(mine, (s.rank - 1) % s.N, REFRESH_TAG),
                        s.collectives.recv(inbox, (s.rank + 1) % s.N, REFRESH_TAG))
        start = 0
        for i in range(len(s.units)):
            for dst in (self._masters[i], *self._states[i].buffers.values()):
                dst[:] = inbox[start : start + len(dst)]
                start += len(dst)
            self._states[i].step = s.states[i].step
        self._free(self.log)
        self.log = []
        self._shapes = (list(s.lengths), s.N)

    def step_buddy(self, s, i: int, coef: float, lr: float) -> None:
        """Compute thread, as this rank steps unit i of an applied step: the buddy's message of the
        step goes into the log (once, at unit 0), with what its update needs."""
        if self._inbox is not None:
            inbox, scale = self._inbox
            self._inbox = None
            self.log.append((inbox, scale, coef, lr))

    def replay(self) -> None:
        """Brings the copies up to date: each logged step applied as the buddy applied it (the message
        cast to the master dtype, unscaled, clipped, then the optimizer's step with the step's lr) and
        dropped from the log. Bit-identical to the buddy's own state."""
        lengths, N = self._shapes
        while self.log:
            message, scale, coef, lr = self.log[0]
            start = 0
            for i, length in enumerate(lengths):
                g = message[start : start + length // N]
                start += length // N
                g = g if g.dtype == self._masters[i].dtype else g.astype(self._masters[i].dtype)
                if scale != 1.0:
                    unscale_(g, scale)
                if coef < 1.0:
                    g *= coef
                self._optimizer.step(self._masters[i], g, self._states[i], lr, segments=self.segments[i])
            self._free(self.log[:1])
            del self.log[0]


async def _together(*coros) -> None:
    """Awaits ``coros`` concurrently; the first failure cancels and reaps the others and is raised
    as itself (the loop reads a lost peer from its type, not from an ExceptionGroup)."""
    try:
        async with asyncio.TaskGroup() as group:
            for coro in coros:
                group.create_task(coro)
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0]  # the member's own error, its traceback kept


def memory_nbytes(s) -> int:
    """The buddy's resident bytes on this rank at most: its copy of the buddy's master shard and
    optimizer buffers, and a full log (K messages of sum_i L_i / N reduce-dtype elements)."""
    el = s.redundancy
    if not el.enabled or not el._has_buddy(s):
        return 0
    copies = sum(m.nbytes for m in el._masters) + sum(st.nbytes for st in el._states)
    return copies + el.refresh_every * sum(length // s.N for length in s.lengths) * np.dtype(s.reduce_dtype).itemsize


def refresh_bytes(lengths: list[int], world: int, *, master_itemsize: int, buffers: int) -> int:
    """Bytes one rank sends in a refresh (once every K steps): its master shard and its ``buffers``
    optimizer buffers (Adam: 2), sum_i L_i / N master-dtype elements each."""
    return 0 if world == 1 else (1 + buffers) * sum(length // world for length in lengths) * master_itemsize


def step_bytes(name: str, lengths: list[int], world: int, *, reduce_itemsize: int) -> int:
    """Bytes one rank sends in a step beyond the plain strategy's, with elastic training on: the
    vote's all_reduce (a ring of one int32), and for zero1/2/3 and fsdp the buddy message (this
    rank's reduced gradient shards, sum_i L_i / N elements of the reduce dtype)."""
    if world == 1:
        return 0
    total = int(2.0 * (world - 1) / world * VOTE_NBYTES)
    if name != "ddp":
        total += sum(length // world for length in lengths) * reduce_itemsize
    return total


async def reshard(s, new_group, lost=None, store=None, *, joining: bool = False) -> None:
    """Re-shards zero1/2, zero3/fsdp ``s`` onto ``new_group``: the survivors of ``s.group`` in their
    old order, then any joiners (``joining=True`` on those: a process that holds nothing yet, whose
    ``s`` was set up over ``new_group``). Every member of ``new_group`` calls it; one all_gather of
    (old rank, old size, step counters) tells everyone who survived, so ``lost`` (the old ranks
    gone) is only checked. ``store``: the new generation's store, where the commit votes go.

    All or nothing: after the gathers the members vote (``should_commit`` over ``new_group``, under
    ``reshard/g<gid>`` in ``store``); no member changes its layout unless every one of them holds the
    whole state, so a member lost mid re-shard leaves every other in the layout it had.

    Raises:
        ShardLostError: a lost rank's holder (rank - 1) is lost too: restart from the checkpoint.
        StepAbortedError: a member was lost during the re-shard; nothing changed here (re-form again).
        ValueError: ``new_group`` is not the survivors then the joiners, or elastic training is off.
    """
    el = s.redundancy
    if not el.enabled:
        raise ValueError(f"{s.name}: reshard needs elastic training (make_strategy(..., redundancy=Redundancy(store)))")
    if not joining and lost is not None and s.rank in lost:
        raise ValueError(f"{s.name}: rank {s.rank} is among the lost {sorted(lost)}: it takes no part in reshard")
    acc = AccountedCollectives(new_group)
    acc.loop = asyncio.get_running_loop()
    vote = PrefixStore(f"reshard/g{new_group.gid}", store if store is not None else el.base_store)
    try:
        full_params, full_states, counters = await _gather_whole(s, acc, new_group, lost, joining)
    except Exception:
        await decide(vote, 0, False)  # this member holds no whole state: the re-shard cannot commit
        raise
    # all or nothing: a member lost during the gathers may leave some members with every piece and
    # others without; nobody changes its layout unless every member holds the whole state
    if not await should_commit(new_group, vote, 0, ok=True, timeout=el.timeout):
        raise StepAbortedError(f"{s.name}: the re-shard onto {new_group.size} ranks did not complete on every "
                               f"member; nothing changed", s.step)
    _adopt_whole(s, new_group, acc, full_params, full_states, counters, store)


async def _gather_whole(s, acc, new_group, lost, joining: bool) -> tuple[list, list, np.ndarray]:
    """reshard's collectives: every unit's whole state, from the survivors' shards and the lost
    ranks' copies; returns (padded parameters, optimizer buffers per unit, new rank 0's counters)."""
    el = s.redundancy
    n_new, U = new_group.size, len(s.units)
    head = np.array([-1, 0, 0, *([0] * U)] if joining else [s.rank, s.N, s.step, *(st.step for st in s.states)],
                    np.int64)
    heads = np.empty((n_new, 3 + U), np.int64)
    await acc.all_gather(heads.reshape(-1), head)
    old = [int(r) for r in heads[:, 0]]
    survivors = [r for r in old if r >= 0]
    N = int(heads[:, 1].max())
    if not survivors or old[: len(survivors)] != sorted(set(survivors)) or any(r >= 0 for r in old[len(survivors):]):
        raise ValueError(f"{s.name}: new group's old ranks {old} are not the survivors in their old order, then "
                         f"joiners (-1)")
    gone = [r for r in range(N) if r not in survivors]
    if lost is not None and not joining and sorted({int(r) for r in lost}) != gone:
        raise ValueError(f"{s.name}: new group {new_group} holds old ranks {survivors} of {N}: the lost are {gone}, "
                         f"not {sorted(lost)}")
    lost = gone
    unrecoverable = [q for q in lost if (q - 1) % N in lost or N == 1]
    if unrecoverable:
        raise ShardLostError(f"{s.name}: the shards of rank(s) {unrecoverable} and their replicas (held by rank(s) "
                             f"{[(q - 1) % N for q in unrecoverable]}) are all lost: the state must come from the "
                             f"newest checkpoint on disk", unrecoverable)
    counters = heads[0]  # new rank 0 is a survivor
    names = ["param", *s.states[0].buffers]
    K = len(names)
    full_params, full_states = [], []
    for i, unit in enumerate(s.units):
        S = unit.padded_length(N) // N
        mine = np.zeros((2, K, S), s.master_dtype)  # slot 0: my shard; slot 1: my lost buddy's (joiners: none)
        if not joining:
            mine[0] = [s._master_shard(i), *s.states[i].buffers.values()]
            if (s.rank + 1) % N in lost:
                mine[1] = [el.masters[i], *el.states[i].buffers.values()]
        every = np.empty((n_new, 2, K, S), s.master_dtype)
        await acc.all_gather(every.reshape(-1), mine.reshape(-1))
        pieces = [every[survivors.index(q), 0] if q not in lost else every[survivors.index((q - 1) % N), 1]
                  for q in range(N)]  # (K, S) each, old rank order
        whole = np.concatenate(pieces, axis=1)[:, : unit.numel]
        padded = np.zeros((K, unit.padded_length(n_new)), s.master_dtype)
        padded[:, : unit.numel] = whole
        full_params.append(padded[0].copy())
        full_states.append({name: padded[k] for k, name in enumerate(names)})
    return full_params, full_states, counters


def _adopt_whole(s, new_group, acc, full_params: list, full_states: list, counters: np.ndarray, store) -> None:
    """reshard's local part, once every member holds the whole state: this rank's new shards and buddy copies."""
    el, n_new, U = s.redundancy, new_group.size, len(s.units)
    s.group, s.N, s.rank, s.step = new_group, n_new, new_group.rank, int(counters[2])
    s.lengths = [u.padded_length(n_new) for u in s.units]
    s.collectives = AccountedCollectives(new_group)
    s.collectives.loop = acc.loop
    s._counted = None
    s._allocate(full_params)
    s.states = []
    for i in range(U):
        start, stop = s._owned(i)
        state = s.optimizer.init_state(stop - start, s.master_dtype)
        for name, buf in state.buffers.items():
            buf[:] = full_states[i][name][start:stop]
        state.step = int(counters[3 + i])
        s.states.append(state)
    s._segments = [s._decay_segments(i) for i in range(U)]
    s._stale = False  # _allocate derived every replicated parameter from the whole master
    el.reform(s, store)
    el.adopt(s, full_params, full_states)


def relay(s, new_group, store=None) -> None:
    """Lays zero1/2, zero3/fsdp ``s`` out over ``new_group`` holding zeros, its counters 0: the
    fallback when a shard has no copy left (ShardLostError), before the newest checkpoint is loaded
    into it (then ``s.redundancy.refresh``). Local: no collective."""
    acc = AccountedCollectives(new_group)
    acc.loop = asyncio.get_running_loop()
    names = ["param", *s.states[0].buffers]
    lengths = [u.padded_length(new_group.size) for u in s.units]
    full_states = [{name: np.zeros(n, s.master_dtype) for name in names} for n in lengths]
    _adopt_whole(s, new_group, acc, [np.zeros(n, s.master_dtype) for n in lengths], full_states,
                 np.zeros(3 + len(s.units), np.int64), store)
