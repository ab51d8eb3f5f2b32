"""dp x tp x pp: any data-parallel strategy on the dp dimension of a mesh, over this rank's pipeline
stage of the tensor-parallel GPT.

What it is: `make_parallel_strategy("fsdp", gpt_config, train_config, mesh, parallel=...)`, a
trainer Strategy (the loop, checkpoints and evaluation take it as any other). Each rank holds
its stage's units (pipeline.py) cut for its tp rank (gpt.py); the data-parallel strategy
named (ddp, zero1, zero2, zero3/fsdp: trainer/sharding) owns their flat buffers, optimizer
state and gradient reduction over the mesh's dp group, exactly as it does without a mesh.
What changes is the step (a mixin over the strategy's class, `MeshMixin`):

    compute thread   the pipeline schedule (executor.py) over m micro-batches, the tp layers
                     all-reducing inside; the data-parallel hooks run on each forward /
                     backward; the stage's last backward launches the dp gradient reduction
    event loop       drain dp, tp, pp; then the tied embedding: unit 0's reduced gradient
                     all-reduced over the embedding group (first + last stage), so both
                     copies take the same step (Megatron-LM's embedding all-reduce)
                     unscale; local found_inf; this rank's share of the squared norm:
                         every element counted once in the whole mesh: a tp-replicated
                         parameter (LayerNorm, wpe, row-parallel bias) on tp rank 0 only, the
                         embedding on the first stage only, a ddp replica on dp rank 0 only
                     ONE all_reduce over the world of [loss, found_inf, sum of squares]:
                         the loss (last stage, tp rank 0, each dp rank its rows), the skip
                         (loss scaling agreed across the whole mesh), the global norm
    compute thread   clip by that norm; the strategy's optimizer step on its shards

Micro-batches: `ParallelConfig.micro_batches` m (default: the step's own micro-batches, A =
grad_accum); each of the A micro-batches is cut into m / A pieces of its local rows, with
their global row offsets (dropout masks and the loss denominator are the single-process
step's), so with or without pipelining a step is the same sum.

Checkpoints (mesh-independent): arrays are the FULL model's ("unit3.param", "unit3.exp_avg",
... in the layout of the unsharded unit, trainer/checkpoint.py's format), so any mesh and any
data-parallel strategy loads them. Saving (`sharded_state_dict`, async): per unit the owning
stage gathers each array over dp, then tp, into the full unit, and each of its dp x tp ranks
writes one contiguous part (memory: one full unit at a time). Loading: each rank reads the
full-layout elements its local shard holds (`state_dict()["layout"][name]["index"]`).

`full_params()`: every unit in the full layout, on every rank (gathered, then broadcast from
the owning stage). `evaluate()`: one pipeline forward; the last stage's metric sums are
broadcast over the pipeline group, so every rank of a dp slice returns them (the loop sums
over dp: `data_group`).

What it is not: the MLP is not model-parallel here (the GPT only); no sequence parallelism,
no interleaved stages, no compression of tp or pp traffic.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import numpy as np

from trainer.nn.gpt import GPT, GPTConfig
from trainer.parallel.tp_group import TPGroup, part
from trainer.parallel.executor import StageRun
from trainer.parallel.gpt import check_divides, full_index, gpt_units, replicated_ranges
from trainer.parallel.mesh import Mesh
from trainer.parallel.pipeline import PipelineLayout
from trainer.parallel.schedules import SCHEDULES, bubble_formula
from trainer.sharding.accounted import AccountedCollectives
from trainer.sharding.base import StepResult, TrainConfig
from trainer.parallel.bases import strategy_class
from trainer.parallel.offload import OffloadMixin
from trainer.precision import resolve_dtype

__all__ = ["ParallelConfig", "MeshMixin", "make_parallel_strategy", "METRICS"]

METRICS = ("loss", "accuracy")  # what the GPT's losses report (CrossEntropyLoss, VocabParallelCrossEntropy)


@dataclass(frozen=True)
class ParallelConfig:
    schedule: str = "1f1b"  # "1f1b" | "gpipe"
    micro_batches: int | None = None  # pipeline micro-batches per step, e.g. 8 (None: grad_accum's)
    stage_layers: tuple[int, ...] | None = None  # blocks per stage, e.g. (3, 1) (None: balanced)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")


class MeshMixin:
    """The step of a data-parallel strategy class on a mesh (the module docstring). Not used alone:
    `make_parallel_strategy` puts it in front of DDPStrategy, ZeroStrategy or FSDPStrategy."""

    def __init__(self, gpt_config: GPTConfig, config: TrainConfig, mesh: Mesh, *,
                 parallel: ParallelConfig | None = None, dtype=None, **kw) -> None:
        tp, pp = mesh.dim_size("tp"), mesh.dim_size("pp")
        check_divides(gpt_config, tp, pp)
        self.mesh, self.parallel = mesh, parallel or ParallelConfig()
        self.config_model = gpt_config
        dtype = np.dtype(dtype or (np.float64 if config.master_dtype == "float64" else np.float32))
        self.tp_group = TPGroup(AccountedCollectives(mesh["tp"]))
        self.pp_acc = AccountedCollectives(mesh["pp"])
        self.world_acc = AccountedCollectives(mesh.world)
        self.emb_acc = AccountedCollectives(mesh.embedding_group) if mesh.embedding_group is not None else None
        self.logical_model = GPT(gpt_config, dtype=dtype)  # the full model: checkpoints' layout and metadata
        units, loss = gpt_units(gpt_config, self.tp_group, dtype=dtype)
        self._all_units = units  # every unit for this tp rank (global index)
        full = self.logical_model.units
        self.layout = PipelineLayout.build(gpt_config.n_layer, pp, mesh.coords["pp"], self.parallel.stage_layers,
                                           [u.numel for u in full[1:]], full[0].numel)
        super().__init__(self.layout.stage_model(units, loss), config, mesh["dp"], **kw)
        self.data_group = mesh["dp"]  # the loop splits the data over dp (trainer/loop.py)
        self.group = mesh.world  # checkpoints, the loop's agreement: the whole job
        self.global_index = list(self.model.global_index)  # stage position -> global unit index
        param = resolve_dtype(config.param_dtype)
        self.activation_dtype = np.dtype(np.float32) if param.itemsize < 4 else param  # trainer/nn/gpt.py _Embed
        self.last_run: StageRun | None = None
        self.pipeline_s = 0.0
        self._tp_layouts: dict[int, list] = {}  # global unit -> every tp rank's unit (how it cuts)
        self._segments_cache: list[list[tuple[int, int]]] | None = None  # _norm_segments', made on first use
        mesh.add_failure_listener(self._on_mesh_failure)

    # ---- plumbing ------------------------------------------------------------------------

    def _accs(self) -> list[AccountedCollectives]:
        return [a for a in (self.tp_group.acc, self.pp_acc, self.world_acc, self.emb_acc) if a is not None]

    async def _ensure_fresh(self) -> None:
        await super()._ensure_fresh()
        for acc in self._accs():
            acc.loop = self.collectives.loop
            acc.aborted = False

    def _begin_step(self) -> None:
        super()._begin_step()
        for acc in self._accs():
            acc.reset_counters()

    async def _cancel_pending(self) -> None:
        await super()._cancel_pending()
        for acc in self._accs():
            await acc.cancel_pending()

    def _on_mesh_failure(self, error: BaseException) -> None:
        """A rank was lost (Mesh._on_lost, on the loop): receives from live stages would wait on."""
        self.pp_acc.cancel_nowait()

    def wait_on(self, acc: AccountedCollectives, fut):
        """Compute thread: waits for a launched call; a call cancelled by a lost rank raises its error."""
        try:
            return acc.wait(fut)
        except concurrent.futures.CancelledError:
            if self.mesh.error is not None:
                raise self.mesh.error from None
            raise

    # ---- the step --------------------------------------------------------------------------

    def _chunks(self, micro_batches) -> list[tuple]:
        """The step's A micro-batches cut into m pieces: [(x, y, global row offset)] (module docstring)."""
        A = len(micro_batches)
        m = self.parallel.micro_batches or A
        if m % A:
            raise ValueError(f"{m} pipeline micro-batches do not divide evenly among the step's {A} "
                             f"accumulation micro-batches: choose --micro-batches as a multiple of --grad-accum")
        chunks, rows_before = [], 0
        for x, y, offset, global_size in micro_batches:
            for c in range(m // A):
                a, b = part(len(x), c, m // A)
                chunks.append((x[a:b], y[a:b], rows_before + int(offset) + a))
            rows_before += int(global_size)
        return chunks

    def _compute(self, micro_batches, denominator: float, scale: float) -> float:
        run = StageRun(self, self._chunks(micro_batches), denominator, scale)
        self.last_run = run
        t0 = time.perf_counter()
        try:
            return run.train()
        finally:
            self.pipeline_s = time.perf_counter() - t0

    async def _finish_grads(self) -> None:
        await super()._finish_grads()
        for acc in self._accs():
            await acc.drain()
        if self.emb_acc is not None and 0 in self.global_index:  # the tied embedding's two copies
            grad = self._opt_shards()[self.global_index.index(0)][1]
            await self.emb_acc.exposed(self.emb_acc.all_reduce(grad))

    def _norm_segments(self) -> list[list[tuple[int, int]]]:
        """Per stage unit: the ranges of this rank's gradient shard the global norm counts here."""
        if self._segments_cache is None:
            out = []
            for i, unit in enumerate(self.units):
                start, stop = self._owned(i)
                counted = [(0, unit.numel)]
                if self.replicated_grads and self.mesh.coords["dp"] != 0:
                    counted = []  # ddp: dp rank 0's replica stands for all
                elif self.global_index[i] == 0 and not self.layout.first:
                    counted = []  # the embedding's second copy (last stage)
                elif self.mesh.coords["tp"] != 0:
                    counted = _subtract(counted, replicated_ranges(unit))
                out.append([(max(lo, start) - start, min(hi, stop) - start) for lo, hi in counted
                            if max(lo, start) < min(hi, stop)])
            self._segments_cache = out
        return self._segments_cache

    def _grad_sumsq(self, grads: list) -> float:
        total = 0.0
        for g, segments in zip(grads, self._norm_segments()):
            for lo, hi in segments:
                total += float(np.dot(g[lo:hi], g[lo:hi]))
        return total

    async def _agree(self, loss_local: float, local_inf: bool, sumsq: float) -> tuple[float, bool, float]:
        counts_loss = self.layout.last and self.mesh.coords["tp"] == 0
        stats = np.array([loss_local if counts_loss else 0.0, float(local_inf), sumsq], dtype=np.float64)
        if self.world_acc.size > 1:
            await self.world_acc.exposed(self.world_acc.all_reduce(stats))
        return float(stats[0]), bool(stats[1] > 0), float(stats[2])

    async def train_step(self, micro_batches) -> StepResult:
        """See base class; the result also gives bytes per mesh dimension and the pipeline's timings."""
        result = await super().train_step(micro_batches)
        tp, pp, world, emb = self.tp_group.acc, self.pp_acc, self.world_acc, self.emb_acc
        by_dim = {"dp": self.collectives.bytes_sent, "tp": tp.bytes_sent,
                  "pp": pp.bytes_sent + (emb.bytes_sent if emb else 0), "stats": world.bytes_sent}
        bubble = self.last_run.wait_s if self.last_run else 0.0
        t = dict(result.timings)
        waited = tp.exposed_s + bubble
        t["compute_s"] = max(0.0, t["compute_s"] - waited)
        t["exposed_comm_s"] += tp.exposed_s + world.exposed_s + (emb.exposed_s if emb else 0.0)
        t["comm_s"] += tp.comm_s + pp.comm_s + world.comm_s + (emb.comm_s if emb else 0.0)
        t["bubble_s"], t["pipeline_s"] = bubble, self.pipeline_s
        result.timings = t
        result.comm_bytes = sum(by_dim.values())
        result.comm_bytes_by_dim = by_dim
        return result

    def pipeline_report(self) -> dict:
        """This rank's figures for the run summary: mesh coordinates, the micro-batches of the last
        step, the most micro-batches in flight, the bubble formula."""
        m = len(self.last_run.chunks) if self.last_run else 0
        return {"coords": dict(self.mesh.coords), "micro_batches": m,
                "in_flight_peak": self.last_run.in_flight_peak if self.last_run else 0,
                "bubble_formula": bubble_formula(self.layout.pp, m) if m else 0.0}

    # ---- evaluation and full parameters -------------------------------------------------------

    async def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """See base class: the metric sums of this dp slice's rows, on every rank of the slice."""
        await self._ensure_fresh()
        run = StageRun(self)
        try:
            metrics = await self._in_thread(run.evaluate, x, y)
            await self.collectives.drain()
            for acc in self._accs():
                await acc.drain()
        except BaseException:
            await self._cancel_pending()
            raise
        vector = np.array([metrics[k] for k in METRICS] if metrics else [0.0] * len(METRICS), dtype=np.float64)
        await self.pp_acc.broadcast(vector, self.layout.pp - 1)
        return dict(zip(METRICS, vector.tolist()))

    def _tp_units(self, g: int) -> list:
        """Unit g as every tp rank builds it (their cuts of the full unit)."""
        if g not in self._tp_layouts:
            tp = self.tp_group.size
            self._tp_layouts[g] = [
                gpt_units(self.config_model, TPGroup.shape_only(t, tp), dtype=self.logical_model.units[0].dtype)[0][g]
                if t != self.tp_group.rank else self._all_units[g] for t in range(tp)]
        return self._tp_layouts[g]

    async def _gather_tp(self, g: int, local: np.ndarray) -> np.ndarray:
        """Unit g's full flat buffer (unpadded) from every tp rank's unpadded local one."""
        tp = self.tp_group.size
        if tp == 1:
            return local
        units = self._tp_units(g)
        counts = [u.numel for u in units]
        width = max(counts)
        mine = np.zeros(width, local.dtype)
        mine[: local.size] = local
        every = np.empty(tp * width, local.dtype)
        await self.tp_group.acc.all_gather(every, mine)
        full = np.empty(self.logical_model.units[g].numel, local.dtype)
        for t, unit in enumerate(units):
            full[unit.full_index()] = every[t * width : t * width + counts[t]]
        return full

    async def _gather_dp(self, i: int, shard: np.ndarray) -> np.ndarray:
        """Stage unit i's unpadded local buffer from this rank's padded dp shard (whole under ddp)."""
        if self.replicated_state:
            return shard[: self.units[i].numel]
        out = np.empty(self.lengths[i], shard.dtype)
        await self.collectives.all_gather(out, shard)
        return out[: self.units[i].numel]

    async def full_params(self) -> list[np.ndarray]:
        """See base class: every unit of the FULL model, unpadded, on every rank."""
        await self._ensure_fresh()
        out = []
        for g, whole in enumerate(self.logical_model.units):
            owner = self.layout.owner(g)
            buf = np.empty(whole.numel, self.master_dtype)
            if self.layout.stage == owner:
                i = self.global_index.index(g)
                buf[:] = await self._gather_tp(g, await self._gather_dp(i, self._master_shard(i)))
            await self.world_acc.broadcast(buf, self.mesh.rank_of(pp=owner, dp=0, tp=0))
            out.append(buf)
        return out

    # ---- checkpoints -----------------------------------------------------------------------------

    def _arrays(self, i: int) -> dict[str, np.ndarray]:
        arrays = {"param": self._master_shard(i)}
        arrays.update(self.states[i].buffers)
        return arrays

    def state_dict(self) -> dict:
        """See base class: names and layout of the FULL model; each array's local elements carry
        their full-layout positions ("index"), or a "start" where the unit is not cut."""
        base = super().state_dict()
        shards, layout = {}, {}
        for i, g in enumerate(self.global_index):
            index = full_index(self.units[i])
            numel = self.logical_model.units[g].numel
            for key in self._arrays(i):
                local = base["layout"][f"unit{i}.{key}"]
                start, n = local["start"], len(base["shards"][f"unit{i}.{key}"])
                shards[f"unit{g}.{key}"] = base["shards"][f"unit{i}.{key}"]
                layout[f"unit{g}.{key}"] = ({"numel": numel, "start": start, "replicated": False} if index is None
                                            else {"numel": numel, "index": index[start : start + n],
                                                  "replicated": False})
        return {**base, "world_size": self.mesh.size, "rank": self.mesh.world.rank, "shards": shards,
                "layout": layout}

    def load_state_dict(self, state: dict) -> None:
        """See base class (names of the full model, as state_dict gives them)."""
        shards = {}
        for i, g in enumerate(self.global_index):
            for key in self._arrays(i):
                if f"unit{g}.{key}" in state["shards"]:
                    shards[f"unit{i}.{key}"] = state["shards"][f"unit{g}.{key}"]
        super().load_state_dict({**state, "shards": shards})

    async def sharded_state_dict(self) -> dict:
        """What a checkpoint writes: each unit's arrays in the FULL layout, one contiguous part per
        rank of the owning stage (module docstring). Collective over the whole mesh."""
        await self._ensure_fresh()
        base = super().state_dict()
        shards, layout = {}, {}
        writers = self.mesh.dim_size("dp") * self.tp_group.size
        writer = self.mesh.coords["dp"] * self.tp_group.size + self.tp_group.rank
        for i, g in enumerate(self.global_index):
            if self.layout.owner(g) != self.layout.stage:
                continue  # the embedding's second copy: the first stage saves it
            numel = self.logical_model.units[g].numel
            lo, hi = part(numel, writer, writers)
            for key, shard in self._arrays(i).items():
                full = await self._gather_tp(g, await self._gather_dp(i, shard))
                shards[f"unit{g}.{key}"] = full[lo:hi].copy()
                layout[f"unit{g}.{key}"] = {"numel": numel, "start": lo, "replicated": False}
                del full
        return {**base, "world_size": self.mesh.size, "rank": self.mesh.world.rank, "shards": shards,
                "layout": layout, "mesh": dict(self.mesh.shape)}


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` minus ``holes`` (sorted, disjoint [lo, hi) lists)."""
    out = []
    for lo, hi in ranges:
        for a, b in holes:
            if b <= lo or a >= hi:
                continue
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
        if lo < hi:
            out.append((lo, hi))
    return out


def make_parallel_strategy(name: str, gpt_config: GPTConfig, config: TrainConfig, mesh: Mesh, *,
                           parallel: ParallelConfig | None = None, **kw):
    """The data-parallel strategy ``name`` on the mesh's dp dimension over this rank's stage of the
    tensor-parallel GPT (the module docstring), with offload when ``config.offload`` asks for it.
    Call ``await setup()`` next.

    Raises:
        ValueError: an unknown strategy; a model that does not split over the mesh.
    """
    mixins = (MeshMixin, OffloadMixin) if config.offload else (MeshMixin,)
    cls, extra = strategy_class(name, *mixins)
    return cls(gpt_config, config, mesh, parallel=parallel, **extra, **kw)
