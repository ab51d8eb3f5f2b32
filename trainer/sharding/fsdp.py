"""ZeRO-3 / FSDP: parameters, gradients and optimizer state all sharded; units gathered on demand.

How it works (N ranks, unit i of padded length L_i, shard S_i = L_i / N; rank r owns
[r S_i, (r + 1) S_i) of every unit):

    kept per rank:  master shard (S_i), its compute-dtype cast when param_dtype differs (the
                    all_gather's input), gradient shard (S_i, reduce dtype), optimizer state.
    forward i:      before_unit_forward(i): launch all_gather(unit i) unless on its way, then
                    (prefetch) the next call's unit's; wait for unit i only. after_unit_forward(i):
                    free it (reshard_after_forward), except after the last call.
    backward i:     before_unit_backward(i): (re)gather unit i, prefetch the next backward call's,
                    allocate unit i's full gradient; after_unit_backward(i): free the unit;
                    grad_ready(i) at the last micro-batch: reduce_scatter(grad shard <- full
                    gradient), the full gradient freed when done (hsdp.py: then the replicas' sum).
    call order:     "next" follows model.calls (forward) and its reverse (backward): the GPT's
                    unit 0 (embedding first, head last) is gathered twice in each pass.
    step:           the optimizer updates the master shard, its cast refreshes the compute shard.
    reshard_after_forward=False keeps every gathered unit from its forward to its backward
    (FSDP's SHARD_GRAD_OP): no second gather, more memory.

    Worked example, 3 units, prefetch on, resharding on: gathers issued 0 1 | 2 | - | 1 | 0;
    at most 2 gathered units alive at once in each pass, plus at most 2 full unit gradients.

Memory (float32 Adam, P parameters, N ranks): 4P/N + 4P/N + 8P/N = 16P/N, plus padding and the
units in flight (memory_bytes()["gathered_peak"]).

Not here: the step skeleton (data_parallel.py).
"""

from __future__ import annotations

import asyncio

import numpy as np

from trainer.precision import cast_to
from trainer.sharding import redundancy
from trainer.sharding.data_parallel import DataParallelStrategy

__all__ = ["FSDPStrategy"]


class FSDPStrategy(DataParallelStrategy):
    """See the module docstring. ``name`` is "zero3" or "fsdp" (the same strategy)."""

    def __init__(self, model, config, group, *, name: str = "zero3", **kw) -> None:
        self.name = name
        super().__init__(model, config, group, **kw)

    def _allocate(self, full: list[np.ndarray]) -> None:
        self.separate = self.param_dtype != self.master_dtype
        self.slices = [self._shard(i) for i in range(len(self.units))]
        self.master = [f[s].copy() for f, s in zip(full, self.slices)]  # (S_i,) each; the full init is dropped
        self.compute_shards = [cast_to(m, self.param_dtype) for m in self.master] if self.separate else self.master
        self._cast = False  # this step's update already cast every unit (_after_shard_update)
        self.grad_shards = [np.zeros(s.stop - s.start, self.reduce_dtype) for s in self.slices]
        U = len(self.units)
        self._gathered: list[tuple[np.ndarray, object] | None] = [None] * U  # (buffer, pending future | None)
        self._full_grads: list[np.ndarray | None] = [None] * U

    def _owned(self, i: int) -> tuple[int, int]:
        return self.slices[i].start, self.slices[i].stop

    def _master_shard(self, i: int) -> np.ndarray:
        return self.master[i]

    async def reshard(self, new_group, lost=None, *, store=None, joining: bool = False) -> None:
        """Elastic training: the state re-sharded onto ``new_group``, the survivors then any joiners
        (redundancy.py)."""
        await redundancy.reshard(self, new_group, lost, store, joining=joining)

    async def _sync_initial_params(self) -> None:
        """Every rank cut its shard from the same config.seed initialisation; under hybrid
        sharding replica 0's shards are broadcast to the others as well."""
        await self.replicas.broadcast(self.master + (self.compute_shards if self.separate else []))

    def _after_shard_update(self, i: int) -> None:
        """See base class: unit i's compute shard follows its master at once, on the compute thread
        (while the master is in memory: offload writes it back right after)."""
        if self.separate:
            cast_to(self.master[i], self.param_dtype, out=self.compute_shards[i])
        self._cast = i == len(self.units) - 1  # the update steps every unit, in index order

    async def _after_update(self, applied: bool) -> None:
        if applied and self.separate and not self._cast:  # a load_state_dict, or an update without the hook
            for m, c in zip(self.master, self.compute_shards):
                cast_to(m, self.param_dtype, out=c)
        self._cast = False

    # ---- gathering (compute thread) ---------------------------------------------

    def _start_gather(self, i: int) -> None:
        """Launches unit i's all_gather unless it is gathered or on its way."""
        if self._gathered[i] is not None:
            return
        buf = np.empty(self.lengths[i], self.param_dtype)  # (L_i,) the gathered unit
        self._track(buf.nbytes, "gathered")
        self._gathered[i] = (buf, self.collectives.launch(self.collectives.all_gather(buf, self.compute_shards[i])))

    def _wait_gather(self, i: int) -> np.ndarray:
        self._start_gather(i)
        buf, fut = self._gathered[i]
        if fut is not None:
            self.collectives.wait(fut)
            self._gathered[i] = (buf, None)
        return buf

    def _free_gather(self, i: int, params: list) -> None:
        entry, self._gathered[i] = self._gathered[i], None
        params[i] = None
        if entry is not None:
            self._untrack(entry[0].nbytes, "gathered")

    def _reset_gathers(self) -> None:
        """Drops what a failed step may have left (nothing after a completed one)."""
        for i, entry in enumerate(self._gathered):
            if entry is not None:
                self._untrack(entry[0].nbytes, "gathered")
                self._gathered[i] = None
        self._drop_full_grads()

    # ---- hooks --------------------------------------------------------------------

    def _prefetch(self, order: list[int], pos: int, i: int) -> None:
        """Launches the gather of the unit of call `pos + 1` in `order` (if any, and not unit i)."""
        if self.config.prefetch and pos + 1 < len(order) and order[pos + 1] != i:
            self._start_gather(order[pos + 1])

    def _forward_hooks(self, params: list, *, keep_last: bool, reshard: bool) -> dict:
        order = [c.unit for c in self.model.calls]  # the forward's calls, by unit
        cursor = {"pos": -1}  # the call now running

        def before_unit_forward(i: int) -> None:
            cursor["pos"] += 1
            self._start_gather(i)
            self._prefetch(order, cursor["pos"], i)
            params[i] = self._wait_gather(i)

        def after_unit_forward(i: int) -> None:
            if reshard and not (keep_last and cursor["pos"] == len(order) - 1):
                self._free_gather(i, params)

        return {"before_unit_forward": before_unit_forward, "after_unit_forward": after_unit_forward}

    def _hooks(self, sync: bool, params: list, grads: list) -> dict:
        hooks = self._forward_hooks(params, keep_last=True, reshard=self.config.reshard_after_forward)
        order = [c.unit for c in reversed(self.model.calls)]  # the backward's calls, by unit
        cursor = {"pos": -1}

        def before_unit_backward(i: int) -> None:
            cursor["pos"] += 1
            self._start_gather(i)
            self._prefetch(order, cursor["pos"], i)
            params[i] = self._wait_gather(i)
            self._alloc_full_grad(i)  # grads is self._full_grads

        def after_unit_backward(i: int) -> None:
            self._free_gather(i, params)

        def grad_ready(i: int) -> None:
            if sync:
                self._launch_reduce_scatter(i)

        hooks["before_unit_backward"] = before_unit_backward
        hooks["after_unit_backward"] = after_unit_backward
        hooks["grad_ready"] = grad_ready
        return hooks

    def _eval_hooks(self, params: list) -> dict:
        self._reset_gathers()
        return self._forward_hooks(params, keep_last=False, reshard=True)

    def _begin_step(self) -> None:
        self._cast = False
        self._reset_gathers()

    def _compute_params(self) -> list:
        return [None] * len(self.units)  # filled by before_unit_forward / before_unit_backward

    def _grad_list(self) -> list:
        return self._full_grads

    def _opt_shards(self) -> list:
        return [(self.master[i], self.grad_shards[i], self.states[i]) for i in range(len(self.units))]

    def _replicated_arrays(self) -> list:
        return []  # nothing is replicated but the step and the loss scale (always in the digest)

    def _nbytes(self) -> tuple[int, int]:
        params = sum(m.nbytes for m in self.master)
        params += sum(c.nbytes for c in self.compute_shards) if self.separate else 0
        return params, sum(g.nbytes for g in self.grad_shards)

    async def _full_params(self) -> list[np.ndarray]:
        out = [np.empty(n, self.master_dtype) for n in self.lengths]
        await asyncio.gather(*(self.collectives.all_gather(o, m) for o, m in zip(out, self.master)))
        return [o[: u.numel] for o, u in zip(out, self.units)]
