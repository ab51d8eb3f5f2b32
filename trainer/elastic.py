"""An elastic job's process (`ElasticJob`): a lost rank costs a re-formed job and one step run
again, and a restarted rank joins at a step boundary with the members' state, for ddp, zero1/2,
zero3 and fsdp on the plain data-parallel layout.

    rdzv = runtime.elastic.from_env()            # an ElasticRendezvous under --elastic
    rt = await runtime.init(rendezvous=rdzv)
    job = ElasticJob(rdzv, rt)
    strategy = make_strategy("fsdp", model, config, rt.world, redundancy=job.redundancy())
    await strategy.setup()
    await fit(strategy, data, config, ..., elastic=job)

In ``fit`` (trainer/loop.py), with ``elastic=``:

- every step is voted (the strategy's `Redundancy`, trainer/sharding/redundancy.py): a step that
  a lost member interrupted raises StepAbortedError (or PeerLostError / CollectiveTimeoutError
  between steps) with no state changed; a failure after the commit counts the step
  (``strategy.step`` advanced) and the loop goes on after it;
- :meth:`ElasticJob.recover` re-forms the runtime without the lost ranks
  (``runtime.elastic.reform``), moves the strategy (``reshard``: ddp re-pads, zero/fsdp rebuild
  their shards from the survivors' and the buddy copies) and :meth:`sync` gives every member new
  rank 0's step counters and loop position (ddp: its optimizer buffers too); the epoch's
  remaining global batches are cut over the new world (the global batch stays fixed); a member
  lost during the recovery re-forms again; a shard with no copy left (ShardLostError) comes, with
  the whole state, from the run's newest checkpoint when the loop has a directory;
- after each step one all_reduce says whether processes wait to join or ranks leave (trainer/leave.py);
  a joiner's :meth:`enter` meets the members' reshard and sync: its share live from them, no disk.

Not here: tp / pp / hybrid / offload / compressed layouts, a loss during evaluation (the job fails).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from runtime import elastic as relastic
from runtime.errors import CollectiveTimeoutError, PeerLostError
from collectives.api import broadcast
from collectives.objects import broadcast_object
from trainer.sharding.base import ShardLostError, StepAbortedError
from trainer.sharding.redundancy import REFRESH_EVERY, Redundancy, relay

__all__ = ["ElasticJob", "RECOVERABLE"]

PEER_FAILURES = (PeerLostError, CollectiveTimeoutError)  # PeerAbortedError is a PeerLostError
RECOVERABLE = (*PEER_FAILURES, StepAbortedError)
MAX_RETRIES = 4  # members lost one after another during one recovery, each costing a re-form

log = logging.getLogger("ringweave.elastic")


def peer_failure(exc: BaseException) -> BaseException | None:
    """The lost peer behind ``exc`` (a StepAbortedError's cause), or None: this rank's own error,
    which re-forming would not cure (the loop lets it propagate)."""
    if isinstance(exc, StepAbortedError):
        cause = exc.__cause__
        return exc if cause is None else (cause if isinstance(cause, PEER_FAILURES) else None)
    return exc if isinstance(exc, PEER_FAILURES) else None


class ElasticJob:
    """One elastic process: its rendezvous and current runtime (see the module docstring)."""

    def __init__(self, rdzv: relastic.ElasticRendezvous, rt) -> None:
        self.rdzv, self.rt = rdzv, rt
        self.joined = rdzv.joiner  # entered a running job: fit starts with enter()
        self.lost_at: float | None = None  # time.time() of the first loss this process saw
        self.resumed_at: float | None = None  # time.time() of the first step it completed after it
        self.entered_at: float | None = None  # time.time() a joiner had its state (enter)
        self.first_step_at: float | None = None  # time.time() this process completed its first step
        self.reforms = 0
        self.carry: dict | None = None  # the loop's record that joiners take from rank 0 (fit: the run's id)
        self.restore = None  # async (strategy) -> position | None: the loop's newest checkpoint, loaded

    @property
    def group(self):
        return self.rt.world

    def redundancy(self, *, refresh_every: int = REFRESH_EVERY) -> Redundancy:
        """The strategy's elastic part for this generation: ``make_strategy(..., redundancy=...)``;
        ``refresh_every``: the steps a buddy copy is kept as a log before it is sent whole again."""
        return Redundancy(self.rt.store, timeout=self.rt.timeout_s, refresh_every=refresh_every)

    def step_done(self) -> None:
        """A step completed (fit calls it): the first one, and the first after a loss, are timed."""
        if self.first_step_at is None:
            self.first_step_at = time.time()
        if self.lost_at is not None and self.resumed_at is None:
            self.resumed_at = time.time()

    async def recover(self, strategy, position: tuple[int, int, int], exc: BaseException | None,
                      lost: list[int] | None = None) -> tuple[int, int, int]:
        """Re-forms the job (without the ranks ``exc`` names as lost, or ``lost``: members that
        leave; neither: to grow), moves ``strategy`` onto it and returns new rank 0's position
        ``(epoch, step_in_epoch, step)``."""
        if exc is not None and self.lost_at is None:
            self.lost_at = time.time()
        return await self._move(strategy, position, exc, joining=False, reform=True, lost=lost)

    async def enter(self, strategy) -> tuple[int, int, int]:
        """A joiner (set up over the generation it joined): its share of the state from the members
        (their ``recover``), then their position."""
        position = await self._move(strategy, None, None, joining=True, reform=False)
        self.entered_at = time.time()
        return position

    async def _move(self, strategy, position, exc, *, joining: bool, reform: bool,
                    lost: list[int] | None = None) -> tuple[int, int, int]:
        """reform (unless entering), reshard and sync; a member lost meanwhile (a kill during the
        recovery) starts them again in the generation after, from the state each one holds: a
        re-shard changes nothing unless it completed on every member (redundancy.reshard)."""
        no_copy = None  # a ShardLostError: the state comes from the newest checkpoint (self.restore)
        for _ in range(MAX_RETRIES + 1):
            try:
                if reform:
                    cause = peer_failure(exc) if exc is not None else None
                    if lost is None:
                        lost = relastic.lost_ranks(cause) if cause is not None else []
                    self.rt = await relastic.reform(self.rt, self.rdzv, lost=lost, reason=None)
                    self.reforms += 1
                if no_copy is None:
                    try:
                        await strategy.reshard(self.rt.world, None, store=self.rt.store, joining=joining)
                    except ShardLostError as gone:
                        if self.restore is None:
                            raise
                        no_copy = gone
                if no_copy is not None:
                    position = await self._from_checkpoint(strategy, no_copy)
                joining = False  # it holds its share now (ddp: its parameters, the others' broadcast)
                return await self.sync(strategy, position)
            except RECOVERABLE as failure:
                if peer_failure(failure) is None:
                    raise
                log.warning("generation %d: %s: %s; re-forming again", self.rt.generation,
                            type(failure).__name__, failure)
                exc, reform, lost = failure, True, None
        raise RuntimeError(f"the job re-formed {MAX_RETRIES + 1} times in a row without completing a recovery "
                           f"(the last failure: {exc!r})") from exc

    async def _from_checkpoint(self, strategy, gone: ShardLostError) -> tuple[int, int, int]:
        """Every member: the strategy laid out over the new generation, the newest checkpoint loaded
        into it (``self.restore``, the loop's), the buddies' copies fetched afresh; its position."""
        log.warning("%s; loading the newest checkpoint onto generation %d (%d ranks)", gone, self.rt.generation,
                    self.rt.world_size)
        relay(strategy, self.rt.world, self.rt.store)
        position = await self.restore(strategy)
        if position is None:
            raise ShardLostError(f"{gone}, and this run has no checkpoint to load yet", gone.ranks) from gone
        await strategy.redundancy.refresh(strategy)
        return position

    async def sync(self, strategy, position: tuple[int, int, int] | None) -> tuple[int, int, int]:
        """Rank 0's step counters and ``position`` on every member (a joiner passes None), and for a
        replicated strategy (ddp) its optimizer buffers; returns the position."""
        group = self.rt.world
        counters = np.array([*(position or (0, 0, 0)), strategy.step, *(s.step for s in strategy.states),
                             strategy.scaler.state.scale, strategy.scaler.state.good_steps], dtype=np.float64)
        await broadcast(counters, 0, group=group)
        if strategy.replicated_state:
            for s in strategy.states:
                for buf in s.buffers.values():
                    await broadcast(buf, 0, group=group)
        strategy.step = int(counters[3])
        for i, s in enumerate(strategy.states):
            s.step = int(counters[4 + i])
        strategy.scaler.load_state_dict({"scale": float(counters[-2]), "good_steps": int(counters[-1])})
        if self.carry is not None:  # set alike on every member (fit: with a checkpoint directory)
            self.carry = await broadcast_object(self.carry, 0, group=group)
        return int(counters[0]), int(counters[1]), int(counters[2])
