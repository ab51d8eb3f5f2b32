"""DDP: replicated parameters and optimizer state; gradients all-reduced in buckets during backward.

How it works:

    setup:     every rank initialises from config.seed; rank 0's parameters are then
               broadcast (as torch DDP does), so replicas start bit-identical.
    buckets:   units grouped in the order their gradients complete (model.grad_ready_order():
               last unit first) into buckets of at most bucket_cap_mb of gradient bytes, the
               first of at most 1 MiB as torch DDP's; a unit larger than the cap is alone. A
               bucket is one flat buffer in reduce_dtype and every unit's gradient a VIEW into
               it (torch's gradient_as_bucket_view): "bucket_copy_in" and "_out" are free.
    backward:  grad_ready(i) for the LAST unit of a bucket launches all_reduce(sum) of the
               bucket on the event loop while the backward of the next units goes on (the
               overlap); earlier micro-batches only accumulate (no_sync). PowerSGD reduces
               the bucket's parameters as matrices (views of the buffer in their shapes).
    step:      every rank holds the same summed gradient; every rank steps all parameters.

    Worked example: units 0, 1, 2 with 66 KB, 263 KB, 10 KB of float32 gradients and
    bucket_cap_mb = 0.25 give buckets [2], [1], [0] (10 + 263 KB > 256 KB): the all_reduce
    of unit 2 runs while unit 1's backward computes, that of unit 1 while unit 0's does.

Memory (float32 Adam, P parameters): params 4P + grads 4P + Adam 8P = 16P, plus the compute
copy when param_dtype is lower than the float32 master.

Not here: the step skeleton (data_parallel.py).
"""

from __future__ import annotations

import asyncio

import numpy as np

from trainer.precision import cast_to
from trainer.sharding.accounted import AccountedCollectives
from trainer.sharding.data_parallel import DataParallelStrategy

__all__ = ["Bucket", "plan_buckets", "DDPStrategy", "FIRST_BUCKET_NBYTES"]

FIRST_BUCKET_NBYTES = 1 << 20  # torch DDP's _DEFAULT_FIRST_BUCKET_BYTES: the first gradients travel early


class Bucket:
    """Units that complete one after the other, their gradients views into one flat buffer.

    `unit_ids` in completion order, e.g. [2, 1]: the buffer holds them by index."""

    def __init__(self, unit_ids: list[int], sizes: list[int], dtype) -> None:
        self.ready_after = unit_ids[-1]  # the unit whose grad_ready completes the bucket
        self.unit_ids = sorted(unit_ids)  # e.g. [1, 2]
        self.buffer = np.zeros(sum(sizes[i] for i in self.unit_ids), dtype=dtype)  # (sum of padded numels,)
        self.views: dict[int, np.ndarray] = {}
        offset = 0
        for i in self.unit_ids:
            self.views[i] = self.buffer[offset : offset + sizes[i]]
            offset += sizes[i]


def plan_buckets(sizes_nbytes: list[int], cap_nbytes: int, order: list[int] | None = None,
                 first_cap_nbytes: int | None = None) -> list[list[int]]:
    """Units grouped in completion `order` (default: highest index first) with at most cap bytes each
    (the first bucket at most `first_cap_nbytes`, default the cap).

    plan_buckets([4, 4, 4], 8) == [[2, 1], [0]]; plan_buckets([4, 4, 4], 8, first_cap_nbytes=4) ==
    [[2], [1, 0]]; a unit above the cap is alone.
    """
    buckets, current, used = [], [], 0
    for i in (reversed(range(len(sizes_nbytes))) if order is None else order):
        cap = cap_nbytes if buckets or first_cap_nbytes is None else min(cap_nbytes, first_cap_nbytes)
        if current and used + sizes_nbytes[i] > cap:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += sizes_nbytes[i]
    if current:
        buckets.append(current)
    return buckets


class DDPStrategy(DataParallelStrategy):
    """See the module docstring."""

    name = "ddp"
    replicated_state = True
    replicated_grads = True
    _hosts_asked = False  # the host-first groups made (new_group: once, on every rank alike)

    def _allocate(self, full: list[np.ndarray]) -> None:
        self.master = full  # (lengths[i],) each, master dtype
        self.separate = self.param_dtype != self.master_dtype
        self.compute = [cast_to(m, self.param_dtype) for m in full] if self.separate else self.master
        self._cast = False  # this step's update already cast every unit (_after_shard_update)
        sizes = self.lengths
        cap = max(1, int(self.config.bucket_cap_mb * 2**20))
        plan = plan_buckets([s * self.reduce_dtype.itemsize for s in sizes], cap, self.model.grad_ready_order(),
                            FIRST_BUCKET_NBYTES)
        self.buckets = [Bucket(ids, sizes, self.reduce_dtype) for ids in plan]  # in launch order
        self.grads: list[np.ndarray] = [None] * len(self.units)
        self._bucket_of: dict[int, Bucket] = {b.ready_after: b for b in self.buckets}
        for b in self.buckets:
            for i in b.unit_ids:
                self.grads[i] = b.views[i]
        # a matrix codec (PowerSGD) reduces each parameter of a bucket in its shape, a view of the buffer
        from collectives import compressed  # local: the strategies import without collectives
        matrices = self.collectives.codec is not None and compressed.compresses_matrices(self.collectives.codec)
        self._shaped = {b.ready_after: [v for i in b.unit_ids for v in self.units[i].views(b.views[i]).values()]
                        for b in self.buckets} if matrices else None
        if (self.collectives.codec is not None and not matrices and self.config.compression_host_first
                and not self._hosts_asked):
            # several hosts of several ranks: reduce inside each host first, compress across once
            self._hosts_asked = True
            self.collectives.hierarchy = compressed.host_groups(self.collectives.group)

    def _owned(self, i: int) -> tuple[int, int]:
        return 0, self.lengths[i]

    def _master_shard(self, i: int) -> np.ndarray:
        return self.master[i]

    async def _sync_initial_params(self) -> None:
        await asyncio.gather(*(self.collectives.broadcast(m, 0) for m in self.master))
        await self._after_update(True)

    def _after_shard_update(self, i: int) -> None:
        """See base class: unit i's compute copy follows its master at once, on the compute thread
        (while the master is in memory: offload writes it back right after)."""
        if self.separate:
            cast_to(self.master[i], self.param_dtype, out=self.compute[i])
        self._cast = i == len(self.units) - 1  # the update steps every unit, in index order

    async def _after_update(self, applied: bool) -> None:
        if applied and self.separate and not self._cast:  # a load_state_dict, or an update without the hook
            for m, c in zip(self.master, self.compute):
                cast_to(m, self.param_dtype, out=c)
        self._cast = False

    def _begin_step(self) -> None:
        self._cast = False
        for b in self.buckets:
            b.buffer.fill(0)

    def _compute_params(self) -> list:
        return list(self.compute)

    def _grad_list(self) -> list:
        return list(self.grads)

    def _hooks(self, sync: bool, params: list, grads: list) -> dict:
        if not sync:
            return {}

        def grad_ready(i: int) -> None:
            bucket = self._bucket_of.get(i)
            if bucket is not None:  # its last unit is done: reduce the whole bucket now
                # key: the bucket's codec state (error feedback) follows the bucket from step to step
                key = bucket.ready_after
                if self._shaped is not None:  # PowerSGD: the bucket's parameters as matrices
                    self.collectives.launch(self.collectives.all_reduce_matrices(bucket.buffer, self._shaped[key],
                                                                                key=key))
                else:
                    self.collectives.launch(self.collectives.all_reduce(bucket.buffer, grad=True, key=key))

        return {"grad_ready": grad_ready}

    def _opt_shards(self) -> list:
        return [(self.master[i], self.grads[i], self.states[i]) for i in range(len(self.units))]

    def _replicated_arrays(self) -> list:
        return list(self.master) + [b for s in self.states for b in s.buffers.values()]

    def _nbytes(self) -> tuple[int, int]:
        params = sum(m.nbytes for m in self.master) + (sum(c.nbytes for c in self.compute) if self.separate else 0)
        return params, sum(b.buffer.nbytes for b in self.buckets)

    async def reshard(self, group, lost=None, *, store=None, joining: bool = False) -> None:
        """Moves this replica onto ``group``, an elastic job's next generation (trainer/elastic.py):
        the buffers re-padded for its size (the parameters and optimizer state kept), buckets and
        collectives re-made over it, then the parameters broadcast from its rank 0, as ``setup``
        does, so a joiner's ``setup`` meets the survivors' ``reshard`` (``joining=True``: nothing
        more to do). ``lost`` is not needed (every member holds everything); ``store``: the new
        generation's store, for the commit votes. Called between steps only."""
        if not self._is_setup:
            raise RuntimeError(f"{self.name}: call `await setup()` before reshard")
        if self.model_parallel.group is not None or self.collectives.codec is not None:
            raise NotImplementedError("ddp reshard: model-parallel parts and compressed gradients are not moved yet")
        if joining:
            self.redundancy.reform(self, store)
            return
        self.N, self.rank, self.group = group.size, group.rank, group
        self.lengths = [u.padded_length(self.N) for u in self.units]
        full = []
        for i, (m, n) in enumerate(zip(self.master, self.lengths)):
            full.append(np.zeros(n, m.dtype))
            full[i][: self.units[i].numel] = m[: self.units[i].numel]
            for name, buf in self.states[i].buffers.items():  # padding stays zero: its gradient is zero
                grown = np.zeros(n, buf.dtype)
                grown[: self.units[i].numel] = buf[: self.units[i].numel]
                self.states[i].buffers[name] = grown
        self._allocate(full)
        self._segments = [self._decay_segments(i) for i in range(len(self.units))]
        self._counted = None
        self.collectives = AccountedCollectives(group, codec=None)
        self.collectives.loop = asyncio.get_running_loop()
        self.redundancy.reform(self, store)
        await self._sync_initial_params()

    async def _full_params(self) -> list[np.ndarray]:
        return [m[: u.numel].copy() for m, u in zip(self.master, self.units)]
