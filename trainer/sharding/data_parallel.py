"""The data-parallel strategy base: the step skeleton, the compute thread, the update, checksums, state.

What it is: `DataParallelStrategy`, the concrete half of the Strategy contract
that ddp, zero1/2 and zero3/fsdp share. A step is

    compute thread:  for each micro-batch j (sync = last j):
                         model.forward_backward(params, grads, x_j, y_j,
                             Context(step, batch_offset = rows before j + offset_j),
                             loss = the strategy's loss (the model's, or the caller's),
                             loss_denominator = rows of ALL micro-batches,
                             grad_scale = loss scale, checkpoint = activation checkpointing,
                             **strategy hooks(sync))
                     (the hooks gather parameters and, at grad_ready, launch gradient collectives)
    event loop:      drain the launched collectives -> this rank's reduced gradient shards
                     unscale; local found_inf; local sum of squares
                     ONE all_reduce(sum) of [loss, found_inf, sum of squares]:
                         loss = the global mean; found_inf > 0 on any rank means
                         skip everywhere (a sum of 0/1 flags is > 0 exactly when
                         their max is 1, so it decides as an all_reduce max would);
                         global norm = sqrt(sum of squares over every shard)
    compute thread:  clip (coef = clip / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_),
                     optimizer step on this rank's shards (lr = schedule(step)), unit by
                     unit, weight decay by parameter group (TrainConfig.decay: "matrices"
                     decays the layers' matrices only, `unit.decay_segments`); after each,
                     _after_shard_update(i) (zero1/2: launch unit i's all-gather, which
                     travels while the next units step)
    event loop:      strategy's after-update work (zero1/2: wait for those all-gathers)

Gradients are SUMMED across ranks, never averaged: each rank's loss is divided
by the global row count (trainer.nn.loss), which makes every strategy equal
single-process training on the same global batches.

Padding is the strategy's: unit i's buffers have `lengths[i]` = numel rounded up
to a multiple of the world size, whatever the model was built with, and rank r
owns `shard_bounds(lengths[i], r, N)` of them (zero/fsdp).

The model's forward/backward is synchronous, so it runs on one compute thread
per strategy while the event loop moves collectives (see accounted.py); the hooks
block only when a gathered unit is not there yet.

Subclasses (ddp.py, zero.py, fsdp.py) provide the buffers and the hooks:

    _allocate(full_init)          buffers from the full initial params (master dtype)
    _before_shard_update(i)       compute thread, right before unit i's shard steps
    _after_shard_update(i)        compute thread, right after unit i's shard stepped (may launch)
    _after_update(applied)        async; re-derive compute params after the optimizer step
    _compute_params()             list handed to the model (entries may be None: fsdp)
    _grad_list()                  list handed to the model (entries may be None)
    _hooks(sync, params, grads)   the model hooks for one micro-batch
    _finish_grads()               async; after the compute thread, before the update
    _opt_shards()                 [(param shard, reduced grad shard, optimizer state)]
    _owned(i) -> (start, stop)    padded coordinates of this rank's master/optimizer shard
    _replicated_arrays()          what check_replicas compares
    _nbytes() -> (params, grads)  persistent bytes

What it is not: no data loading, no checkpoint files, no logging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import hashlib
import math
import threading
import time
from typing import Callable

import numpy as np

from trainer.nn import EVAL, ActivationMeter, Context, Loss, Model, shard_bounds
from trainer.optim import SGD, AdamW, Constant, WarmupCosine
from trainer.precision import DynamicLossScaler, PrecisionPolicy, dtype_name, has_inf_or_nan, resolve_dtype, unscale_
from trainer.sharding.base import ReplicaMismatchError, StepResult, Strategy, TrainConfig
from trainer.sharding.accounted import AccountedCollectives

__all__ = ["STRATEGIES", "DECAY_GROUPS", "DataParallelStrategy", "make_optimizer", "make_schedule", "make_codec",
           "clip_coefficient"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
DECAY_GROUPS = ("matrices", "all")  # TrainConfig.decay: the layers' matrices only (nanoGPT), or every parameter


def make_optimizer(config: TrainConfig):
    if config.optimizer == "adamw":
        return AdamW(betas=config.betas, weight_decay=config.weight_decay, kernel=config.adam_kernel)
    if config.optimizer == "sgd":
        return SGD(momentum=config.momentum, nesterov=config.nesterov, weight_decay=config.weight_decay)
    raise ValueError(f"TrainConfig.optimizer must be 'adamw' or 'sgd', got {config.optimizer!r}")


def make_schedule(config: TrainConfig):
    """Constant when total_steps <= 1, else linear warm-up + cosine to min_lr."""
    if config.total_steps <= 1:
        return Constant(config.lr)
    return WarmupCosine(config.lr, min(config.warmup_steps, config.total_steps), config.total_steps, config.min_lr)


def make_codec(spec):
    """The gradient codec of ``TrainConfig.compression``: None for None / "none", a Codec
    object as is, else ``NAME[+ef][:OPTION=VALUE,...]``, e.g. "int8+ef" (error feedback),
    "topk+ef:ratio=0.01,warmup_steps=46" (options go to ``collectives.compress.get_codec``)."""
    if spec in (None, "none"):
        return None
    from collectives.compress import get_codec  # the compression codecs
    if not isinstance(spec, str):
        return get_codec(spec)
    name, _, opts = spec.partition(":")
    ef = name.endswith("+ef")
    name = name[:-3] if ef else name
    kwargs = {}
    for item in filter(None, opts.split(",")):
        opt, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"compression {spec!r}: option {item!r} is not OPTION=VALUE")
        try:
            kwargs[opt.strip()] = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            raise ValueError(f"compression {spec!r}: option {opt.strip()!r} needs a number, got {value!r}") from None
    try:
        return get_codec(name, error_feedback=ef, **kwargs)
    except TypeError as exc:
        raise ValueError(f"compression {spec!r}: {exc}") from None


def clip_coefficient(total_norm: float, clip_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor, capped at 1: clip / (norm + 1e-6)."""
    return min(1.0, clip_norm / (total_norm + 1e-6))


class DataParallelStrategy(Strategy):
    """The shared machinery; see the module docstring. Not used directly."""

    name = "base"
    replicated_state = False  # ddp: master params and optimizer state are the same on every rank
    replicated_grads = False  # ddp: the reduced gradient is whole on every rank (norm needs no sum)

    def __init__(self, model: Model, config: TrainConfig, group, *, schedule: Callable[[int], float] | None = None,
                 loss: Loss | None = None):
        if config.grad_accum < 1:
            raise ValueError(f"TrainConfig.grad_accum must be >= 1, got {config.grad_accum}")
        if config.clip_norm is not None and not config.clip_norm > 0:
            raise ValueError(f"TrainConfig.clip_norm must be > 0 or None, got {config.clip_norm}")
        if config.decay not in DECAY_GROUPS:
            raise ValueError(f"TrainConfig.decay must be one of {DECAY_GROUPS}, got {config.decay!r}")
        if config.offload is not None and not getattr(self, "supports_offload", False):
            raise ValueError(f"TrainConfig.offload={config.offload!r}: build the strategy with "
                             f"trainer.parallel.make_offload_strategy (or make_parallel_strategy)")
        self.model, self.config, self.group = model, config, group
        self.units = model.units
        self.N, self.rank = group.size, group.rank
        self.lengths = [u.padded_length(self.N) for u in self.units]  # this strategy's padding, any model
        self.loss = loss if loss is not None else model.loss
        self.meter = ActivationMeter()  # activation bytes the model holds (memory_bytes()["activations_peak"])
        self.policy = PrecisionPolicy(master=config.master_dtype, compute=config.param_dtype,
                                      reduce=config.reduce_dtype)
        self.master_dtype = resolve_dtype(config.master_dtype)
        self.param_dtype = resolve_dtype(config.param_dtype)
        self.reduce_dtype = resolve_dtype(config.reduce_dtype)
        self.optimizer = make_optimizer(config)
        self.schedule = schedule or make_schedule(config)
        scaling = self.policy.needs_loss_scaling if config.loss_scale is None else bool(config.loss_scale)
        self.scaler = DynamicLossScaler(config.init_scale, growth_interval=config.growth_interval, enabled=scaling)
        self.collectives = AccountedCollectives(group, codec=make_codec(config.compression))
        if self.collectives.codec is not None:
            from collectives import compressed
            if not self.replicated_grads:  # gradients are reduce-scattered
                compressed.check_blockwise(self.collectives.codec)  # refuses powersgd here, not at the first step
            elif compressed.compresses_matrices(self.collectives.codec):
                # DDP all-reduces flat 1-D buckets, which PowerSGD sends uncompressed: it sent every
                # byte while saying it compressed.
                raise ValueError("compression 'powersgd' compresses matrices, and ddp all-reduces flat "
                                 "gradient buckets, which it would send uncompressed: use int8, topk, fp16 "
                                 "or bf16, or collectives.bucket.GradBucketer, which keeps the shapes")
        self.step = 0
        self.states: list = []
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ringweave-compute-r{self.rank}")
        self._mem_lock = threading.Lock()
        self._transient = {"gathered": 0, "grads": 0}  # bytes of transient buffers alive now
        self._peak = {"gathered": 0, "grads": 0}
        self._stale = False  # load_state_dict ran; compute params are re-derived on the next async call
        self._overflow_at: dict[int, set[int] | None] = {}
        self._is_setup = False

    # ---- life cycle -----------------------------------------------------------

    async def setup(self) -> None:
        """See base class."""
        full = [u.init_params(self.config.seed, n, self.master_dtype) for u, n in zip(self.units, self.lengths)]
        self._allocate(full)
        self.states = [self.optimizer.init_state(self._owned(i)[1] - self._owned(i)[0], self.master_dtype)
                       for i in range(len(self.units))]
        self._segments = [self._decay_segments(i) for i in range(len(self.units))]
        self.collectives.loop = asyncio.get_running_loop()
        await self._sync_initial_params()
        self._is_setup = True
        if self.config.check_every:
            await self.check_replicas()

    async def _sync_initial_params(self) -> None:
        """Every rank initialised from one seed; replicated strategies also broadcast from rank 0."""
        await self._after_update(True)

    def close(self) -> None:
        """See base class."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _shard(self, i: int) -> slice:
        """This rank's part of unit i's padded buffer (zero/fsdp sharding)."""
        return shard_bounds(self.lengths[i], self.rank, self.N)

    def _decay_segments(self, i: int) -> list[tuple[int, int, bool]]:
        """[(lo, hi, decayed)] of this rank's optimizer shard of unit i (TrainConfig.decay)."""
        start, stop = self._owned(i)
        if self.config.decay == "all":
            return [(0, stop - start, True)]
        return self.units[i].decay_segments(start, stop)

    # ---- memory ---------------------------------------------------------------

    def _track(self, nbytes: int, kind: str = "grads") -> None:
        """A transient buffer appears: kind "gathered" (a gathered unit) or "grads"
        (an unsharded unit gradient or a collective's scratch)."""
        with self._mem_lock:
            self._transient[kind] += nbytes
            self._peak[kind] = max(self._peak[kind], self._transient[kind])

    def _untrack(self, nbytes: int, kind: str = "grads") -> None:
        with self._mem_lock:
            self._transient[kind] -= nbytes

    def memory_bytes(self) -> dict:
        """See base class. Also ``grads_transient_peak`` (unsharded unit gradients
        and scratch alive at once) and ``transient_now`` (0 between steps)."""
        params, grads = self._nbytes()
        optim = sum(s.nbytes for s in self.states)
        return {"params": params, "grads": grads, "optim": optim, "total": params + grads + optim,
                "gathered_peak": self._peak["gathered"], "grads_transient_peak": self._peak["grads"],
                "transient_now": sum(self._transient.values()), "activations_peak": self.meter.peak}

    def reset_peak(self) -> None:
        """See base class."""
        with self._mem_lock:
            self._peak = dict(self._transient)
        self.meter.reset_peak()

    # ---- testing hook -----------------------------------------------------------

    def inject_overflow(self, step: int, ranks: list[int] | None = None) -> None:
        """Test hook: at ``step`` (the value of ``self.step`` when train_step starts)
        the gradient of unit 0, element 0, becomes +inf on ``ranks`` (default: every
        rank) at grad_ready(0), just before it is communicated, as an fp16 overflow would. With
        ``ranks=[0]`` under zero2/zero3 only rank 0's shard sees it, which tests that
        the skip is agreed by all ranks."""
        self._overflow_at[int(step)] = None if ranks is None else {int(r) for r in ranks}

    def _with_injection(self, hooks: dict, grads: list) -> dict:
        """The last micro-batch's hooks, with inject_overflow's inf put into unit 0 at grad_ready(0)."""
        if self._overflow_at:
            ready = hooks.get("grad_ready")

            def ready_with_injection(i):
                if i == 0:
                    self._inject(grads)
                if ready is not None:
                    ready(i)

            hooks["grad_ready"] = ready_with_injection
        return hooks

    def _inject(self, grads: list) -> None:
        if self.step in self._overflow_at:
            ranks = self._overflow_at[self.step]
            if ranks is None or self.rank in ranks:
                grads[0][0] = np.inf

    # ---- the step -------------------------------------------------------------

    async def _in_thread(self, fn, *args):
        ctx = contextvars.copy_context()  # collectives launched from the thread see this rank's runtime
        return await asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, fn, *args)

    def _cast_input(self, x: np.ndarray) -> np.ndarray:
        """Inputs keep their dtype: with float32 data and float16/bfloat16 parameters NumPy
        promotes each matmul to float32 (BLAS) with the low-precision weights, whereas a
        float16 x float16 matmul has no BLAS path (bench/results/trainer.md#float16-matmuls). On a CPU the
        gain of low precision is memory and bytes on the wire (trainer/precision.py)."""
        return x

    async def _ensure_fresh(self) -> None:
        if not self._is_setup:
            raise RuntimeError(f"{self.name}: call `await setup()` before training or evaluating")
        self.collectives.loop = asyncio.get_running_loop()
        self.collectives.aborted = False
        if self._stale:
            self._stale = False
            await self._after_update(True)

    def _compute(self, micro_batches, denominator: float, scale: float) -> float:
        """Compute thread: forward/backward of every micro-batch; returns the local loss sum."""
        loss, rows_before = 0.0, 0
        params = self._compute_params()
        self.meter.clear()  # what a failed step may have left
        for j, (x, y, offset, global_size) in enumerate(micro_batches):
            sync = j == len(micro_batches) - 1
            grads = self._grad_list()
            hooks = self._hooks(sync, params, grads)
            if sync:
                self._with_injection(hooks, grads)
            ctx = Context(training=True, seed=self.config.seed, step=self.step, batch_offset=rows_before + int(offset))
            # grads_zero at j == 0: _begin_step zeroed every gradient buffer (ddp, zero1) or dropped
            # them, and before_unit_backward allocates them as zeros (zero2, zero3/fsdp)
            loss += self.model.forward_backward(params, grads, self._cast_input(x), y, ctx, loss=self.loss,
                                                loss_denominator=denominator, grad_scale=scale,
                                                grads_zero=j == 0, checkpoint=self.config.activation_checkpointing,
                                                meter=self.meter, **hooks)
            rows_before += int(global_size)
        return loss

    async def train_step(self, micro_batches) -> StepResult:
        """See base class."""
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        await self._ensure_fresh()
        t_start = time.perf_counter()
        self.collectives.reset_counters()
        denominator = float(sum(int(mb[3]) for mb in micro_batches))
        if denominator <= 0:
            raise ValueError(f"the step's global batch is empty (global sizes {[mb[3] for mb in micro_batches]})")
        scale = self.scaler.scale
        self._begin_step()
        try:
            t0 = time.perf_counter()
            loss_local = await self._in_thread(self._compute, micro_batches, denominator, scale)
            thread_s = time.perf_counter() - t0
            thread_exposed = self.collectives.exposed_s
            await self._finish_grads()
        except BaseException:
            await self._cancel_pending()
            raise
        shards = self._opt_shards()
        # grads in the master dtype (a cast copy only when reduce != master), unscaled, checked
        grads = [g if g.dtype == self.master_dtype else g.astype(self.master_dtype) for _, g, _ in shards]
        local_inf = False
        for g in grads:
            local_inf |= unscale_(g, scale) if scale != 1.0 else has_inf_or_nan(g)
        with np.errstate(over="ignore", invalid="ignore"):
            sumsq = self._grad_sumsq(grads)
        loss, found_inf, total_sumsq = await self._agree(loss_local, local_inf, sumsq)
        grad_norm = math.sqrt(total_sumsq) if not found_inf else math.inf
        applied = self.scaler.update(found_inf) and not found_inf
        t_update = time.perf_counter()
        if applied:
            lr = self.schedule(self.step)
            coef = clip_coefficient(grad_norm, self.config.clip_norm) if self.config.clip_norm else 1.0
            try:
                await self._in_thread(self._update, shards, grads, coef, lr)
            except BaseException:
                await self._cancel_pending()  # what _after_shard_update launched before the failure
                raise
        update_s = time.perf_counter() - t_update
        await self._after_update(applied)
        self.step += 1
        if self.config.check_every and self.step % self.config.check_every == 0:
            await self.check_replicas()
        timings = {"compute_s": max(0.0, thread_s - thread_exposed) + update_s, "comm_s": self.collectives.comm_s,
                   "exposed_comm_s": self.collectives.exposed_s, "step_s": time.perf_counter() - t_start}
        return StepResult(loss=loss, skipped=not applied, grad_norm=grad_norm, comm_bytes=self.collectives.bytes_sent,
                          timings=timings, loss_scale=scale)

    def _grad_sumsq(self, grads: list) -> float:
        """This rank's share of the squared global gradient norm: the sum of squares of its shards."""
        return float(sum(float(np.dot(g, g)) for g in grads))

    async def _agree(self, loss_local: float, local_inf: bool, sumsq: float) -> tuple[float, bool, float]:
        """One all_reduce decides for every rank: [loss, found_inf flags, sum of squares] ->
        (the global loss, whether any rank found inf/NaN, the squared global norm)."""
        stats = np.array([loss_local, float(local_inf), 0.0 if self.replicated_grads else sumsq], dtype=np.float64)
        await self.collectives.exposed(self.collectives.all_reduce(stats))
        return float(stats[0]), bool(stats[1] > 0), sumsq if self.replicated_grads else float(stats[2])

    async def _cancel_pending(self) -> None:
        """After a failure: cancels and reaps every collective the step launched."""
        await self.collectives.cancel_pending()

    def _update(self, shards, grads, coef: float, lr: float) -> None:
        """Compute thread: clip and step this rank's shards, unit by unit in index order (the
        order of the collectives _after_shard_update may launch, the same on every rank)."""
        for i, ((param, _, state), g) in enumerate(zip(shards, grads)):
            self._before_shard_update(i)
            if coef < 1.0:
                g *= coef
            self.optimizer.step(param, g, state, lr, segments=self._segments[i])
            self._after_shard_update(i)

    # ---- evaluation -------------------------------------------------------------

    async def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """See base class."""
        await self._ensure_fresh()
        params = self._compute_params()
        hooks = self._eval_hooks(params)
        try:
            forward = functools.partial(self.model.forward, params, self._cast_input(x), EVAL, **hooks)
            out = await self._in_thread(forward)
            await self.collectives.drain()
        except BaseException:
            await self._cancel_pending()
            raise
        return {k: float(v) for k, v in self.loss.metrics(out, y).items()}

    def _eval_hooks(self, params: list) -> dict:
        return {}

    # ---- replicas -----------------------------------------------------------------

    def _digest(self) -> np.ndarray:
        h = hashlib.blake2b(digest_size=8)
        scalars = np.array([self.step, self.states[0].step if self.states else 0, self.scaler.state.scale,
                            self.scaler.state.good_steps], dtype=np.float64)
        h.update(scalars.tobytes())
        for a in self._replicated_arrays():
            h.update(np.ascontiguousarray(a).view(np.uint8))
        return np.frombuffer(h.digest(), dtype=np.int64).copy()  # (1,)

    async def check_replicas(self) -> None:
        """See base class."""
        mine = self._digest()
        every = np.zeros(self.N, dtype=np.int64)
        await self.collectives.all_gather(every, mine)
        values, counts = np.unique(every, return_counts=True)
        if len(values) == 1:
            return
        best = counts.max()
        majority = every[0] if counts[list(values).index(every[0])] == best else values[counts.argmax()]
        differ = [r for r in range(self.N) if every[r] != majority]
        raise ReplicaMismatchError(
            f"{self.name}: replicated state (parameters{', optimizer state' if self.replicated_state else ''}, "
            f"step, loss scale) differs across ranks at step {self.step}: rank(s) {differ} differ from "
            f"rank(s) {[r for r in range(self.N) if every[r] == majority]}", differ)

    # ---- checkpoint state ---------------------------------------------------------

    def _layout(self, i: int) -> tuple[int, int]:
        """(start, length) of this rank's shard of unit i in UNPADDED coordinates."""
        start, stop = self._owned(i)
        numel = self.units[i].numel
        if start >= numel:
            return numel, 0
        return start, min(stop, numel) - start

    def state_dict(self) -> dict:
        """See base class."""
        shards, layout = {}, {}
        for i, unit in enumerate(self.units):
            start, n = self._layout(i)
            arrays = {"param": self._master_shard(i)}
            arrays.update(self.states[i].buffers)
            for key, arr in arrays.items():
                name = f"unit{i}.{key}"
                shards[name] = arr[:n]
                layout[name] = {"numel": unit.numel, "start": start, "replicated": self.replicated_state}
        return {"strategy": self.name, "world_size": self.N, "rank": self.rank, "step": self.step,
                "optim_step": self.states[0].step if self.states else 0,
                "optimizer": self.config.optimizer, "master_dtype": dtype_name(self.master_dtype),
                "scaler": self.scaler.state_dict(), "shards": shards, "layout": layout}

    def load_state_dict(self, state: dict) -> None:
        """See base class."""
        if not self._is_setup:
            raise RuntimeError(f"{self.name}: call `await setup()` before load_state_dict")
        shards = state["shards"]
        for i in range(len(self.units)):
            start, n = self._layout(i)
            targets = {"param": self._master_shard(i)}
            targets.update(self.states[i].buffers)
            for key, dst in targets.items():
                name = f"unit{i}.{key}"
                if name not in shards:
                    raise ValueError(f"{self.name}: state has no {name!r} (saved with optimizer "
                                     f"{state.get('optimizer')!r}, this run uses {self.config.optimizer!r})")
                src = np.asarray(shards[name])
                if src.shape != (n,):
                    raise ValueError(f"{self.name}: {name!r} must have {n} elements for rank {self.rank} "
                                     f"(start {start}), got shape {src.shape}")
                dst[:n] = src
                dst[n:] = 0
            self.states[i].step = int(state["optim_step"])
        self.step = int(state["step"])
        self.scaler.load_state_dict(state["scaler"])
        self._stale = True

    def _master_shard(self, i: int) -> np.ndarray:
        """The master-dtype array covering this rank's padded range _owned(i)."""
        raise NotImplementedError

    # ---- unsharded unit gradients (zero2, zero3/fsdp) ------------------------------
    # Those strategies keep ``self.grad_shards`` (S_i each) and ``self._full_grads``
    # (the model's gradient list: unit i's full gradient while its backward needs it).

    def _alloc_full_grad(self, i: int) -> None:
        """before_unit_backward(i): unit i's full gradient (zeros), kept across micro-batches
        until the boundary (and across a unit's two backward calls)."""
        if self._full_grads[i] is None:
            self._full_grads[i] = np.zeros(self.lengths[i], self.reduce_dtype)
            self._track(self._full_grads[i].nbytes)

    def _launch_reduce_scatter(self, i: int) -> None:
        """grad_ready(i) at the boundary: reduce-scatter unit i's full gradient into
        its kept shard; the full buffer is dropped when the collective is done."""
        full, self._full_grads[i] = self._full_grads[i], None
        self.collectives.launch(self._reduce_and_free(i, full))

    async def _reduce_and_free(self, i: int, full: np.ndarray) -> None:
        try:
            await self.collectives.reduce_scatter(self.grad_shards[i], full, key=i)  # key: unit i's codec state
        finally:
            self._untrack(full.nbytes)

    def _drop_full_grads(self) -> None:
        """Drops the full gradients a failed step may have left (none after a completed one)."""
        for i, g in enumerate(self._full_grads):
            if g is not None:
                self._untrack(g.nbytes)
                self._full_grads[i] = None

    # ---- subclass hooks (see the module docstring) ------------------------------

    def _begin_step(self) -> None:
        pass

    def _before_shard_update(self, i: int) -> None:
        """Compute thread, right before the optimizer steps unit i's shard (offload reads ahead here)."""

    def _after_shard_update(self, i: int) -> None:
        """Compute thread, right after the optimizer stepped unit i's shard (applied steps only)."""

    async def _finish_grads(self) -> None:
        await self.collectives.drain()
