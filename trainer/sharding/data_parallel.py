"""The data-parallel strategy base: the training step, read in one place, and what ddp, zero1/2 and
zero3/fsdp share (the compute thread, the update, checksums, checkpoint state).

What it is: `DataParallelStrategy`, the concrete half of the Strategy contract. A strategy holds
its parts as objects (parts.py): `model_parallel` computes the micro-batches (the whole model here;
tp x pp stages on a mesh, trainer/parallel/strategy.py) and agrees on the step over the job;
`replicas` is the replicate dimension of hybrid sharding (hsdp.py); `offload` keeps optimizer
state where TrainConfig.offload says. `train_step` below is the step, in order:

    compute thread  model_parallel.compute: forward/backward of every micro-batch; the strategy's
                    hooks gather parameters and, at the last micro-batch's grad_ready, launch the
                    gradient collectives (on the event loop, accounted.py)
    event loop      drain them (and the replicas'), then the part's own (a tied embedding)
                    unscale; local found_inf; this rank's share of the squared norm
                    model_parallel.agree: ONE sum of [loss, found_inf, sum of squares]
    compute thread  clip; the optimizer steps this rank's shards unit by unit (offload reads
                    ahead and writes behind); _after_shard_update(i) (zero1/2 launch unit i's gather)
    event loop      _after_update (zero1/2: wait for the gathers)

Gradients are SUMMED across ranks, never averaged (each rank's loss is divided by the global row
count), so every strategy equals single-process training on the same global batches. Padding is
the strategy's: unit i's buffers have `lengths[i]` = numel rounded up to the shard count.

Subclasses (ddp.py, zero.py, fsdp.py) provide the buffers and the hooks: _allocate, _owned,
_master_shard, _compute_params, _grad_list, _hooks, _eval_hooks, _opt_shards, _after_shard_update,
_after_update, _begin_step, _replicated_arrays, _nbytes, _full_params.

What it is not: no data loading, no checkpoint files, no logging, no model parallelism (parts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hashlib
import math
import threading
import time
from typing import Callable

import numpy as np

from runtime.errors import ranks_in_words
from trainer.nn import ActivationMeter, Loss, Model, shard_bounds
from trainer.optim import SGD, AdamW, Constant, WarmupCosine
from trainer.precision import DynamicLossScaler, PrecisionPolicy, dtype_name, has_inf_or_nan, resolve_dtype, unscale_
from trainer.sharding.accounted import AccountedCollectives
from trainer.sharding.base import ReplicaMismatchError, StepResult, Strategy, TrainConfig
from trainer.sharding.hsdp import Replicas
from trainer.sharding.parts import ModelParallel, NoOffload
from trainer.sharding.redundancy import NoRedundancy

__all__ = ["STRATEGIES", "DECAY_GROUPS", "DataParallelStrategy", "make_optimizer", "make_schedule", "make_codec",
           "clip_coefficient"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
DECAY_GROUPS = ("matrices", "all")  # TrainConfig.decay: the layers' matrices only (nanoGPT), or every parameter


def make_optimizer(config: TrainConfig):
    if config.optimizer == "adamw":
        if config.freeze_variance and not config.compression_start:
            raise ValueError("TrainConfig.freeze_variance freezes adamw's variance at compression_start: set it > 0")
        return AdamW(betas=config.betas, weight_decay=config.weight_decay, kernel=config.adam_kernel,
                     freeze_step=config.compression_start if config.freeze_variance else 0)
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
    """The shared machinery; see the module docstring. Not used directly.

    Keywords beyond the Strategy contract's: ``replicate`` (a ProcessGroup: hybrid sharding, the
    ranks holding copies of this rank's shards; zero and fsdp only), ``world`` (with
    ``replicate``: the group of every data-parallel rank, for checkpoints and the loop; default
    the runtime's world), ``model_parallel`` and ``offload`` (parts.py), ``schedule``, ``loss``,
    ``redundancy`` (redundancy.Redundancy, elastic training's part: the commit vote, buddy replicas,
    ``reshard``; default off).
    """

    name = "base"
    replicated_state = False  # ddp: master params and optimizer state are the same on every rank
    replicated_grads = False  # ddp: the reduced gradient is whole on every rank

    def __init__(self, model: Model, config: TrainConfig, group, *, replicate=None, world=None,
                 model_parallel: ModelParallel | None = None, offload=None,
                 schedule: Callable[[int], float] | None = None, loss: Loss | None = None, redundancy=None):
        if config.grad_accum < 1:
            raise ValueError(f"TrainConfig.grad_accum must be >= 1, got {config.grad_accum}")
        if config.clip_norm is not None and not config.clip_norm > 0:
            raise ValueError(f"TrainConfig.clip_norm must be > 0 or None, got {config.clip_norm}")
        if config.decay not in DECAY_GROUPS:
            raise ValueError(f"TrainConfig.decay must be one of {DECAY_GROUPS}, got {config.decay!r}")
        if config.offload is not None and offload is None:
            raise ValueError(f"TrainConfig.offload={config.offload!r}: build the strategy with "
                             f"trainer.parallel.make_offload_strategy (or make_parallel_strategy)")
        self.model, self.config = model, config
        self.units = model.units
        self.N, self.rank = group.size, group.rank
        self.lengths = [u.padded_length(self.N) for u in self.units]  # this strategy's padding, any model
        self.loss = loss if loss is not None else model.loss
        self.model_parallel = model_parallel if model_parallel is not None else ModelParallel()
        self.offload = offload if offload is not None else NoOffload()
        self.replicas = Replicas(replicate)
        if self.replicas.size > 1 and self.replicated_state:
            raise ValueError(f"{self.name} replicates every parameter already: replicate= (hybrid sharding) is "
                             f"for zero1, zero2, zero3 and fsdp")
        mp_group = self.model_parallel.group
        self.group = mp_group if mp_group is not None else self._whole_group(group, world)
        self.data_group = self.model_parallel.data_group  # None: the loop's group
        self.logical_model = model if self.model_parallel.logical_model is None else self.model_parallel.logical_model
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
        self.step = 0
        self.states: list = []
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ringweave-compute-r{self.rank}")
        self._mem_lock = threading.Lock()
        self._transient = {"gathered": 0, "grads": 0}  # bytes of transient buffers alive now
        self._peak = {"gathered": 0, "grads": 0}
        self._stale = False  # load_state_dict ran; compute params are re-derived on the next async call
        self._counted: list[list[tuple[int, int]]] | None = None  # _grad_sumsq's ranges, made on first use
        self._is_setup = False
        self.redundancy = redundancy if redundancy is not None else NoRedundancy()
        self.redundancy.attach(self)

    def _whole_group(self, group, world):
        """The group of every data-parallel rank: ``group`` itself, or with replicas ``world``."""
        if self.replicas.size == 1:
            return group
        world = world if world is not None else group.runtime.world
        if world.size != self.N * self.replicas.size:
            raise ValueError(f"{self.N} shards x {self.replicas.size} replicas need a world of "
                             f"{self.N * self.replicas.size} ranks, got {world.size}: pass world= the group of "
                             f"every data-parallel rank")
        return world

    # ---- life cycle -----------------------------------------------------------

    async def setup(self) -> None:
        """See base class."""
        full = [u.init_params(self.config.seed, n, self.master_dtype) for u, n in zip(self.units, self.lengths)]
        self._allocate(full)
        self.states = [self.optimizer.init_state(self._owned(i)[1] - self._owned(i)[0], self.master_dtype)
                       for i in range(len(self.units))]
        self._segments = [self._decay_segments(i) for i in range(len(self.units))]
        self.redundancy.adopt(self, full)
        for acc in self._accounted():
            acc.loop = asyncio.get_running_loop()
        await self._sync_initial_params()
        self._is_setup = True
        if self.config.check_every:
            await self.check_replicas()
        self.offload.adopt(self)

    async def _sync_initial_params(self) -> None:
        """Every rank initialised from one seed; replicated strategies also broadcast from rank 0."""
        await self._after_update(True)

    def close(self) -> None:
        """See base class."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.offload.close()
        self.model_parallel.close()

    def _accounted(self) -> list[AccountedCollectives]:
        """Every AccountedCollectives of the step: dp, the replicas', the model-parallel part's."""
        return [self.collectives, *self.replicas.accounted(), *self.model_parallel.accounted()]

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
        """See base class. Also ``grads_transient_peak`` (unsharded unit gradients and scratch alive
        at once), ``transient_now`` (0 between steps), and with offload ``offloaded`` / ``resident``."""
        params, grads = self._nbytes()
        optim = sum(s.nbytes for s in self.states)
        return self.offload.memory({
            "params": params, "grads": grads, "optim": optim, "total": params + grads + optim,
            "gathered_peak": self._peak["gathered"], "grads_transient_peak": self._peak["grads"],
            "transient_now": sum(self._transient.values()), "activations_peak": self.meter.peak})

    def reset_peak(self) -> None:
        """See base class."""
        with self._mem_lock:
            self._peak = dict(self._transient)
        self.meter.reset_peak()

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
        for acc in self._accounted():
            acc.loop = asyncio.get_running_loop()
            acc.aborted = False
        if self._stale:
            self._stale = False
            await self._after_update(True)

    async def train_step(self, micro_batches) -> StepResult:
        """See base class. The step, in order (the module docstring)."""
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        await self._ensure_fresh()
        t_start = time.perf_counter()
        for acc in self._accounted():
            acc.reset_counters()
        denominator = float(sum(int(mb[3]) for mb in micro_batches))
        if denominator <= 0:
            raise ValueError(f"the step's global batch is empty (global sizes {[mb[3] for mb in micro_batches]})")
        scale = self.scaler.scale
        self.collectives.start_step(self.step, self.config.compression_start)
        self._begin_step()
        self.offload.begin_step()
        try:  # 1. forward and backward of every micro-batch; the hooks launch the gradient collectives
            t0 = time.perf_counter()
            loss_local = await self._in_thread(self.model_parallel.compute, self, micro_batches, denominator, scale)
            thread_s = time.perf_counter() - t0
            thread_exposed = self.collectives.exposed_s
            await self._finish_grads()  # 2. this rank's reduced gradient shards
            await self.model_parallel.finish_grads(self)
            await self.redundancy.exchange(self, scale)  # elastic: the buddy message (sent with the sum below)
        except BaseException as exc:
            await self._cancel_pending()
            await self.redundancy.abort(self, exc)  # elastic: "no" for this step, StepAbortedError
            raise
        # 3. grads in the master dtype (a cast copy only when reduce != master), unscaled, checked
        shards = self._opt_shards()
        grads = [g if g.dtype == self.master_dtype else g.astype(self.master_dtype) for _, g, _ in shards]
        local_inf = False
        for g in grads:
            local_inf |= unscale_(g, scale) if scale != 1.0 else has_inf_or_nan(g)
        with np.errstate(over="ignore", invalid="ignore"):
            sumsq = self._grad_sumsq(grads)
        # 4. one sum over the job decides for every rank: the mean loss, any overflow (a sum of 0/1
        # flags is > 0 exactly when their max is 1), the squared global norm
        stats = np.array([loss_local, float(local_inf), sumsq], dtype=np.float64)
        await self.redundancy.guard(self, self.model_parallel.agree(self, stats))
        await self.redundancy.commit(self)  # elastic: the vote, before any state changes
        loss, found_inf = float(stats[0]), bool(stats[1] > 0)
        grad_norm = math.sqrt(float(stats[2])) if not found_inf else math.inf
        applied = self.scaler.update(found_inf) and not found_inf
        t_update = time.perf_counter()
        if applied:  # 5. clip and step this rank's shards
            lr = self.schedule(self.step)
            coef = clip_coefficient(grad_norm, self.config.clip_norm) if self.config.clip_norm else 1.0
            try:
                await self._in_thread(self._update, shards, grads, coef, lr)
            except BaseException:
                await self._cancel_pending()  # what _after_shard_update launched before the failure
                raise
        update_s = time.perf_counter() - t_update
        await self.redundancy.settle(self, self._after_update(applied))  # elastic: a failure here counts the step
        self.step += 1
        if self.config.check_every and self.step % self.config.check_every == 0:
            await self.check_replicas()
        own = [self.collectives, *self.replicas.accounted()]
        timings = {"compute_s": max(0.0, thread_s - thread_exposed) + update_s,
                   "comm_s": sum(a.comm_s for a in own), "exposed_comm_s": sum(a.exposed_s for a in own),
                   "step_s": time.perf_counter() - t_start}
        result = StepResult(loss=loss, skipped=not applied, grad_norm=grad_norm,
                            comm_bytes=sum(a.bytes_sent for a in own), timings=timings, loss_scale=scale)
        self.model_parallel.report(self, result)
        return result

    def _grad_sumsq(self, grads: list) -> float:
        """This rank's share of the squared global norm: each element of the model counted once in
        the job (ddp: rank 0's replica; hybrid sharding: replica 0's shards; the model-parallel
        part's ranges: a tp-replicated parameter on one tp rank, a tied unit on one stage)."""
        if self._counted is None:
            self._counted = [self._counted_in_shard(i) for i in range(len(self.units))]
        total = 0.0
        for g, ranges in zip(grads, self._counted):
            for lo, hi in ranges:
                total += float(np.dot(g[lo:hi], g[lo:hi]))
        return total

    def _counted_in_shard(self, i: int) -> list[tuple[int, int]]:
        if (self.replicated_grads and self.rank != 0) or self.replicas.rank != 0:
            return []
        start, stop = self._owned(i)
        return [(max(lo, start) - start, min(hi, stop) - start) for lo, hi in self.model_parallel.counted_ranges(self, i)
                if max(lo, start) < min(hi, stop)]

    async def _cancel_pending(self) -> None:
        """After a failure: cancels and reaps every collective the step launched."""
        for acc in self._accounted():
            await acc.cancel_pending()

    def _update(self, shards, grads, coef: float, lr: float) -> None:
        """Compute thread: clip and step this rank's shards, unit by unit in index order (the
        order of the collectives _after_shard_update may launch, the same on every rank)."""
        try:
            for i, ((param, _, state), g) in enumerate(zip(shards, grads)):
                self.offload.before_update(i)
                if coef < 1.0:
                    g *= coef
                self.optimizer.step(param, g, state, lr, segments=self._segments[i])
                self.redundancy.step_buddy(self, i, coef, lr)  # elastic: the buddy message into the log
                self._after_shard_update(i)
                self.offload.after_update(i)
        finally:
            self.offload.finish_update()

    # ---- evaluation, full parameters -------------------------------------------------

    async def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """See base class."""
        await self._ensure_fresh()
        return await self.model_parallel.evaluate(self, x, y)

    def _eval_hooks(self, params: list) -> dict:
        return {}

    async def full_params(self) -> list[np.ndarray]:
        """See base class (the model-parallel part assembles the full model from its parts)."""
        await self._ensure_fresh()
        return await self.model_parallel.full_params(self)

    async def _full_unit(self, i: int, shard: np.ndarray) -> np.ndarray:
        """Unit i's unpadded buffer from this rank's padded shard of it (whole already under ddp)."""
        if self.replicated_state:
            return shard[: self.units[i].numel]
        out = np.empty(self.lengths[i], shard.dtype)
        await self.collectives.all_gather(out, shard)
        return out[: self.units[i].numel]

    def pipeline_report(self) -> dict | None:
        """The run summary's pipeline figures (None without a pipeline)."""
        return self.model_parallel.pipeline_report()

    # ---- replicas -----------------------------------------------------------------

    def _digest(self, arrays) -> np.ndarray:
        h = hashlib.blake2b(digest_size=8)
        scalars = np.array([self.step, self.states[0].step if self.states else 0, self.scaler.state.scale,
                            self.scaler.state.good_steps], dtype=np.float64)
        h.update(scalars.tobytes())
        for a in arrays:
            h.update(np.ascontiguousarray(a).view(np.uint8))
        return np.frombuffer(h.digest(), dtype=np.int64).copy()  # (1,)

    async def check_replicas(self) -> None:
        """See base class. With hybrid sharding the replicas' shards (parameters, optimizer state)
        are compared too."""
        every = np.zeros(self.N, dtype=np.int64)
        await self.collectives.all_gather(every, self._digest(self._replicated_arrays()))
        what = f"parameters{', optimizer state' if self.replicated_state else ''}, step, loss scale"
        _raise_on_mismatch(self.name, every, what, self.step)
        if self.replicas.size > 1:
            shards = [self._master_shard(i) for i in range(len(self.units))]
            shards += [b for s in self.states for b in s.buffers.values()]
            every = await self.replicas.digests(self._digest(shards))
            _raise_on_mismatch(self.name, every, "shards across replicas (parameters, optimizer state)", self.step)

    # ---- checkpoint state ---------------------------------------------------------

    def _layout(self, i: int) -> tuple[int, int]:
        """(start, length) of this rank's shard of unit i in UNPADDED coordinates."""
        start, stop = self._owned(i)
        numel = self.units[i].numel
        if start >= numel:
            return numel, 0
        return start, min(stop, numel) - start

    def state_dict(self) -> dict:
        """See base class (in the names and layout of the model checkpoints describe)."""
        shards, layout = {}, {}
        for i, unit in enumerate(self.units):
            start, n = self._layout(i)
            arrays = {"param": self._master_shard(i)}
            arrays.update(self.states[i].buffers)
            for key, arr in arrays.items():
                name = f"unit{i}.{key}"
                shards[name] = arr[:n]
                layout[name] = {"numel": unit.numel, "start": start, "replicated": self.replicated_state}
        state = {"strategy": self.name, "world_size": self.group.size, "rank": self.group.rank, "step": self.step,
                 "optim_step": self.states[0].step if self.states else 0,
                 "optimizer": self.config.optimizer, "master_dtype": dtype_name(self.master_dtype),
                 "scaler": self.scaler.state_dict(), "shards": shards, "layout": layout}
        return self.model_parallel.full_state(self, state)

    def load_state_dict(self, state: dict) -> None:
        """See base class."""
        if not self._is_setup:
            raise RuntimeError(f"{self.name}: call `await setup()` before load_state_dict")
        state = self.model_parallel.local_state(self, state)
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
        self.offload.after_load()

    async def sharded_state_dict(self) -> dict:
        """What a checkpoint writes from this rank (collective over ``group``): state_dict's arrays,
        each written once in the job (trainer/checkpoint.py)."""
        return await self.model_parallel.sharded_state_dict(self)

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
        turn = self.replicas.turn()  # hybrid sharding: the replicas' all_reduces keep the launch order
        try:
            try:
                await self.collectives.reduce_scatter(self.grad_shards[i], full, key=i)  # key: unit i's codec state
            finally:
                self._untrack(full.nbytes)
            await self.replicas.reduce(self.grad_shards[i], turn)  # the shard summed over the replicas
        finally:
            self.replicas.release(turn)

    def _drop_full_grads(self) -> None:
        """Drops the full gradients a failed step may have left (none after a completed one)."""
        for i, g in enumerate(self._full_grads):
            if g is not None:
                self._untrack(g.nbytes)
                self._full_grads[i] = None

    # ---- subclass hooks (see the module docstring) ------------------------------

    def _begin_step(self) -> None:
        pass

    def _after_shard_update(self, i: int) -> None:
        """Compute thread, right after the optimizer stepped unit i's shard (applied steps only)."""

    async def _finish_grads(self) -> None:
        await self.collectives.drain()


def _raise_on_mismatch(name: str, every: np.ndarray, what: str, step: int) -> None:
    """Raises ReplicaMismatchError when the digests ``every`` (one per rank) differ."""
    values, counts = np.unique(every, return_counts=True)
    if len(values) == 1:
        return
    best = counts.max()
    majority = every[0] if counts[list(values).index(every[0])] == best else values[counts.argmax()]
    differ = [r for r in range(len(every)) if every[r] != majority]
    verb = "holds" if len(differ) == 1 else "hold"
    agree = ranks_in_words(r for r in range(len(every)) if every[r] == majority)
    raise ReplicaMismatchError(f"{name}: replicated state ({what}) differs across ranks at step {step}: "
                               f"{ranks_in_words(differ)} {verb} other values than {agree}", differ)
