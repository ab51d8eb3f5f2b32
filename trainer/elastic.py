"""Elastic training for a replicated (ddp) strategy: a lost rank costs a re-formed job and one
step run again, and a restarted rank joins at a step boundary with the state of the members.

    rdzv = runtime.elastic.from_env()            # an ElasticRendezvous under --elastic
    rt = await runtime.init(rendezvous=rdzv)
    strategy = DDPStrategy(model, config, rt.world); await strategy.setup()
    el = Elastic(rdzv, rt)
    await fit(strategy, data, config, ..., elastic=el)

In ``fit`` (trainer/loop.py), with ``elastic=``:

- a step (or the step boundary after it) that raises PeerLostError, PeerAbortedError or
  CollectiveTimeoutError is discarded: ``train_step`` changed no state when it raised (the
  strategy's contract). :meth:`Elastic.recover` re-forms the runtime without the lost ranks
  (``runtime.elastic.reform``), moves the strategy onto the new world (``strategy.reshard``) and
  :meth:`Elastic.sync` gives every member new rank 0's optimizer state and loop position;
  the epoch's remaining global batches are cut over the new world (trainer/data.py
  ``local_batches_from``: the global batch stays fixed) and the step runs again;
- after each step every member learns whether processes wait to join (:meth:`grow_wanted`: one
  small all_reduce); then all re-form with them at that boundary. A joiner's own ``setup`` and
  :meth:`sync` (``fit`` calls it first for a joiner) meet the members' ``reshard`` and ``sync``:
  parameters, optimizer state, step counters and position, broadcast live from rank 0, no disk.

What is not: zero / fsdp / tp / pp state (a restart from the checkpoint), a loss during evaluation
or a checkpoint save (the job fails as a fixed one does).
"""

from __future__ import annotations

import time

import numpy as np

from runtime import elastic as relastic
from runtime.errors import CollectiveTimeoutError, PeerLostError
from collectives.api import all_reduce, broadcast

__all__ = ["Elastic", "RECOVERABLE"]

RECOVERABLE = (PeerLostError, CollectiveTimeoutError)  # PeerAbortedError is a PeerLostError


class Elastic:
    """One elastic process: its rendezvous and current runtime (see the module docstring)."""

    def __init__(self, rdzv: relastic.ElasticRendezvous, rt) -> None:
        self.rdzv, self.rt = rdzv, rt
        self.joined = rdzv.joiner  # entered a running job: fit starts with sync()
        self.lost_at: float | None = None  # time.time() of the first loss this process saw
        self.resumed_at: float | None = None  # time.time() of the first step it completed after it
        self.reforms = 0

    @property
    def group(self):
        return self.rt.world

    def step_done(self) -> None:
        """A step completed (fit calls it): the first one after a loss is timed."""
        if self.lost_at is not None and self.resumed_at is None:
            self.resumed_at = time.time()

    async def grow_wanted(self) -> bool:
        """Whether processes wait to join, the same answer on every member (an all_reduce(max))."""
        flag = np.array([1 if await self.rdzv.joiners_waiting() > 0 else 0], dtype=np.int64)
        await all_reduce(flag, op="max", group=self.rt.world)
        return bool(flag[0])

    async def recover(self, strategy, position: tuple[int, int, int], exc: BaseException | None) -> tuple[int, int, int]:
        """Re-forms the job (without the ranks ``exc`` names as lost; ``exc`` None: to grow), moves
        ``strategy`` onto it and returns new rank 0's position ``(epoch, step_in_epoch, step)``."""
        if exc is not None and self.lost_at is None:
            self.lost_at = time.time()
        lost = relastic.lost_ranks(exc) if exc is not None else []
        self.rt = await relastic.reform(self.rt, self.rdzv, lost=lost, reason=None)
        self.reforms += 1
        await strategy.reshard(self.rt.world)
        return await self.sync(strategy, position)

    async def sync(self, strategy, position: tuple[int, int, int] | None) -> tuple[int, int, int]:
        """Rank 0's optimizer state, step counters and ``position`` on every member (a joiner
        passes None); returns the position."""
        group = self.rt.world
        counters = np.array([*(position or (0, 0, 0)), strategy.step, *(s.step for s in strategy.states),
                             strategy.scaler.state.scale, strategy.scaler.state.good_steps], dtype=np.float64)
        await broadcast(counters, 0, group=group)
        for s in strategy.states:
            for buf in s.buffers.values():
                await broadcast(buf, 0, group=group)
        strategy.step = int(counters[3])
        for i, s in enumerate(strategy.states):
            s.step = int(counters[4 + i])
        strategy.scaler.load_state_dict({"scale": float(counters[-2]), "good_steps": int(counters[-1])})
        return int(counters[0]), int(counters[1]), int(counters[2])
