"""ZeRO stage 1 and 2: optimizer state (and, at stage 2, gradients) sharded; parameters replicated.

How it works (N ranks, unit i of padded length L_i, shard S_i = L_i / N; rank r owns
[r S_i, (r + 1) S_i) of every unit, trainer.nn.shard_bounds):

    zero1  backward accumulates into FULL gradient buffers (4P, kept between steps); at the
           last micro-batch grad_ready(i) launches reduce_scatter(scratch S_i <- full grad i)
           and copies the chunk back into this rank's slice, which the optimizer steps.
    zero2  before_unit_backward(i) allocates unit i's full gradient, grad_ready(i) launches
           reduce_scatter(grad shard S_i <- full grad i) and frees the full buffer when done;
           only the shard (4P/N) is kept (full buffers live until the last micro-batch).
    both   after unit i's shard steps, _after_shard_update(i) launches its all_gather into the
           replicated parameters (in param_dtype) while the optimizer steps units i+1, ...;
           the step waits for them all before it returns (nothing in flight between steps).
    hsdp   with replicate=: the reduced chunk is summed over the replicas (hsdp.py).

    Worked example, 3 units: update 0 | launch gather 0 | update 1 (gather 0 travels) |
    launch gather 1 | update 2 | launch gather 2 | wait for gathers 0, 1, 2.

Compression (TrainConfig.compression): the gradient reduce_scatter is the compressed one
(collectives/compressed.py, ZeRO++'s qgZ) with key = the unit index. Master weights: with
param_dtype == master_dtype the replicas ARE the master (this rank's master shard a view),
otherwise a separate float32 master shard. Memory (float32 Adam, P parameters, N ranks):
zero1 4P + 4P + 8P/N, zero2 4P + 4P/N + 8P/N, plus padding and the unit gradients in flight.

Not here: the step skeleton (data_parallel.py).
"""

from __future__ import annotations

import asyncio

import numpy as np

from trainer.precision import cast_to
from trainer.sharding import redundancy
from trainer.sharding.data_parallel import DataParallelStrategy

__all__ = ["ZeroStrategy"]


class ZeroStrategy(DataParallelStrategy):
    """See the module docstring; ``stage`` is 1 or 2."""

    def __init__(self, model, config, group, *, stage: int, **kw) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2 here (3 is fsdp.py), got {stage}")
        self.stage = stage
        self.name = f"zero{stage}"
        super().__init__(model, config, group, **kw)

    def _allocate(self, full: list[np.ndarray]) -> None:
        self.separate = self.param_dtype != self.master_dtype
        self.slices = [self._shard(i) for i in range(len(self.units))]
        if self.separate:
            self.full = [cast_to(f, self.param_dtype) for f in full]  # replicated compute copy
            self.master = [f[s].copy() for f, s in zip(full, self.slices)]  # (S_i,) float32 master shards
        else:
            self.full = full
            self.master = [f[s] for f, s in zip(full, self.slices)]  # views: the replicas ARE the master
        self.blocks = [f[s] for f, s in zip(self.full, self.slices)]  # this rank's block of each replica
        self._launched = False  # this step's update launched every unit's all_gather (_after_shard_update)
        if self.stage == 1:
            self.grads = [np.zeros(n, self.reduce_dtype) for n in self.lengths]
        else:
            self.grad_shards = [np.zeros(s.stop - s.start, self.reduce_dtype) for s in self.slices]
            self._full_grads: list[np.ndarray | None] = [None] * len(self.units)

    def _owned(self, i: int) -> tuple[int, int]:
        return self.slices[i].start, self.slices[i].stop

    def _master_shard(self, i: int) -> np.ndarray:
        return self.master[i]

    async def reshard(self, new_group, lost=None, *, store=None, joining: bool = False) -> None:
        """Elastic training: the state re-sharded onto ``new_group``, the survivors then any joiners
        (redundancy.py)."""
        await redundancy.reshard(self, new_group, lost, store, joining=joining)

    async def _sync_initial_params(self) -> None:
        """Every rank built the same replicas from config.seed (check_replicas verifies it); under
        hybrid sharding replica 0's are broadcast to the others as well."""
        await self.replicas.broadcast(self.full + (self.master if self.separate else []))

    def _launch_gather(self, i: int) -> None:
        """Launches unit i's all_gather into its replicated compute parameters, in place: this
        rank's block of ``full[i]`` is the input (the master itself, or its cast, written here)."""
        if self.separate:
            cast_to(self.master[i], self.param_dtype, out=self.blocks[i])
        self.collectives.launch(self.collectives.all_gather(self.full[i], self.blocks[i]))

    def _after_shard_update(self, i: int) -> None:
        """See base class: unit i's shard is final, so its all_gather leaves now and travels
        while the optimizer steps the next units (the module docstring's worked example)."""
        self._launch_gather(i)
        self._launched = i == len(self.units) - 1  # the update steps every unit, in index order

    async def _after_update(self, applied: bool) -> None:
        """Waits for every unit's all_gather, which the update launched (launched here instead if
        it did not: a strategy whose update calls no _after_shard_update)."""
        if not applied:
            return
        if not self._launched:
            for i in range(len(self.units)):
                self._launch_gather(i)
        self._launched = False
        await self.collectives.drain()  # the wait is exposed communication

    def load_state_dict(self, state: dict) -> None:
        """See base class."""
        super().load_state_dict(state)
        self._launched = False  # a failed step's launches were cancelled: gather all

    def _begin_step(self) -> None:
        self._launched = False
        if self.stage == 1:
            for g in self.grads:
                g.fill(0)
        else:
            self._drop_full_grads()  # what a failed step may have left half-accumulated

    def _compute_params(self) -> list:
        return list(self.full)

    def _grad_list(self) -> list:
        return self.grads if self.stage == 1 else self._full_grads

    def _hooks(self, sync: bool, params: list, grads: list) -> dict:
        hooks = {}
        if self.stage == 2:
            hooks["before_unit_backward"] = self._alloc_full_grad
        if not sync:
            return hooks

        def grad_ready(i: int) -> None:
            if self.stage == 1:
                self.collectives.launch(self._reduce_into_slice(i))
            else:
                self._launch_reduce_scatter(i)

        hooks["grad_ready"] = grad_ready
        return hooks

    async def _reduce_into_slice(self, i: int) -> None:
        """zero1: reduce-scatter unit i's full gradient; the chunk goes back into this rank's slice."""
        turn = self.replicas.turn()  # hybrid sharding: the replicas' all_reduces keep the launch order
        chunk = np.empty(self.slices[i].stop - self.slices[i].start, self.reduce_dtype)  # scratch (S_i,)
        self._track(chunk.nbytes)
        try:
            await self.collectives.reduce_scatter(chunk, self.grads[i], key=i)  # key: unit i's codec state
            await self.replicas.reduce(chunk, turn)  # summed over the replicas
            self.grads[i][self.slices[i]] = chunk
        finally:
            self.replicas.release(turn)
            self._untrack(chunk.nbytes)

    def _opt_shards(self) -> list:
        grads = [g[s] for g, s in zip(self.grads, self.slices)] if self.stage == 1 else self.grad_shards
        return [(self.master[i], grads[i], self.states[i]) for i in range(len(self.units))]

    def _replicated_arrays(self) -> list:
        return list(self.full)

    def _nbytes(self) -> tuple[int, int]:
        params = sum(f.nbytes for f in self.full) + (sum(m.nbytes for m in self.master) if self.separate else 0)
        grads = sum(g.nbytes for g in self.grads) if self.stage == 1 else sum(g.nbytes for g in self.grad_shards)
        return params, grads

    async def _full_params(self) -> list[np.ndarray]:
        if not self.separate:
            return [f[: u.numel].copy() for f, u in zip(self.full, self.units)]
        out = [np.empty(n, self.master_dtype) for n in self.lengths]
        await asyncio.gather(*(self.collectives.all_gather(o, m) for o, m in zip(out, self.master)))
        return [o[: u.numel] for o, u in zip(out, self.units)]
