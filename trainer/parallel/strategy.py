"""dp x tp x pp: any data-parallel strategy on the dp dimension of a mesh, over this rank's pipeline
stage of any model whose layers declare how they split (the GPT in its Megatron layout).

What it is: `make_parallel_strategy("fsdp", model_or_gpt_config, train_config, mesh, parallel=...)`,
a trainer Strategy (the loop, checkpoints and evaluation take it as any other): the data-parallel
strategy named (trainer/sharding: ddp, zero1/2, zero3/fsdp) over this rank's stage model, holding
`MeshParallel` as its model-parallel part (trainer/sharding/parts.py's contract):

    compute        the pipeline schedule over m micro-batches (executor.py), the tp layers
                   all-reducing inside; the strategy's hooks run on each forward / backward and
                   the stage's last backward launches the dp gradient reduction
    finish_grads   drain tp, pp; then a unit the first and last stage share (the GPT's tied
                   embedding) all-reduced over the embedding group, so both copies step alike
    counted_ranges each element counted once in the mesh: a tp-replicated parameter on tp rank 0,
                   a shared unit on its first stage (the strategy: a ddp or HSDP replica once)
    agree          ONE all_reduce over the world of [loss (last stage, tp rank 0), found_inf, sumsq]
    evaluate, full_params, checkpoints: fullstate.py (the full model's layout, any mesh loads it)

With `mesh["dp_replicate"]` of more than one rank (hybrid sharding), zero and fsdp shard within
`mesh["dp_shard"]` and replicate across it (trainer/sharding/hsdp.py); ddp takes all of dp.

Micro-batches: `ParallelConfig.micro_batches` m (default: the step's own, A = grad_accum); each of
the A micro-batches is cut into m / A pieces of its local rows with their global row offsets, so
dropout masks and the loss denominator are the single-process step's.

What it is not: no sequence parallelism, no interleaved stages, no compression of tp or pp traffic.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import numpy as np

from trainer.nn import GPT, GPTConfig, Model
from trainer.parallel.executor import StageRun
from trainer.parallel.fullstate import FullLayout
from trainer.parallel.gpt import check_divides, full_index, replicated_ranges
from trainer.parallel.mesh import Mesh
from trainer.parallel.offload import DiskOffload
from trainer.parallel.pipeline import PipelineLayout
from trainer.parallel.schedules import SCHEDULES, bubble_formula
from trainer.parallel.split import split_units
from trainer.parallel.tp_group import TPGroup, part
from trainer.precision import resolve_dtype
from trainer.sharding import make_strategy
from trainer.sharding.accounted import AccountedCollectives
from trainer.sharding.base import TrainConfig
from trainer.sharding.parts import ModelParallel

__all__ = ["ParallelConfig", "MeshParallel", "make_parallel_strategy"]


@dataclass(frozen=True)
class ParallelConfig:
    schedule: str = "1f1b"  # "1f1b" | "gpipe"
    micro_batches: int | None = None  # pipeline micro-batches per step, e.g. 8 (None: grad_accum's)
    stage_layers: tuple[int, ...] | None = None  # blocks (body calls) per stage, e.g. (3, 1) (None: balanced)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")


class MeshParallel(ModelParallel):
    """The model-parallel part of a strategy on a mesh (the module docstring). ``model``: a Model
    (its layers' declarations cut it, split.py) or a GPTConfig (a GPT in the master dtype)."""

    def __init__(self, model: Model | GPTConfig, config: TrainConfig, mesh: Mesh,
                 parallel: ParallelConfig | None = None) -> None:
        tp, pp = mesh.dim_size("tp"), mesh.dim_size("pp")
        if isinstance(model, GPTConfig):
            check_divides(model, tp, pp)
            model = GPT(model, dtype=np.float64 if config.master_dtype == "float64" else np.float32)
        elif isinstance(model, GPT):
            check_divides(model.config, tp, pp)
        self.mesh, self.parallel = mesh, parallel or ParallelConfig()
        self.logical_model = model  # the full model: checkpoints' layout and metadata
        self.group, self.data_group = mesh.world, mesh["dp"]  # checkpoints and agreement; the data's split
        self.tp_group = TPGroup(AccountedCollectives(mesh["tp"]))
        self.pp_acc = AccountedCollectives(mesh["pp"])
        self.world_acc = AccountedCollectives(mesh.world)
        self.emb_acc = AccountedCollectives(mesh.embedding_group) if mesh.embedding_group is not None else None
        self.all_units, loss = split_units(model, self.tp_group)  # every unit for this tp rank (global index)
        self.layout = PipelineLayout.build(model, pp, mesh.coords["pp"], self.parallel.stage_layers)
        self.model = self.layout.stage_model(self.all_units, loss)  # what the data-parallel strategy holds
        self.global_index = list(self.model.global_index)  # stage position -> global unit index
        self.full = FullLayout(model, self.all_units, self.tp_group, self.layout, mesh, self.world_acc)
        param = resolve_dtype(config.param_dtype)
        self.activation_dtype = np.dtype(np.float32) if param.itemsize < 4 else param  # trainer/nn/gpt.py _Embed
        self.last_run: StageRun | None = None
        self.pipeline_s = 0.0
        mesh.add_failure_listener(self._on_mesh_failure)

    # ---- plumbing ------------------------------------------------------------------------

    def accounted(self) -> list[AccountedCollectives]:
        """See ModelParallel."""
        return [a for a in (self.tp_group.acc, self.pp_acc, self.world_acc, self.emb_acc) if a is not None]

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

    def activation_shape(self, kind: str, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        """What this stage receives for a micro-batch whose input is ``x_shape``: "F" the activation
        from the stage before, "B" the gradient of what it sends to the stage after."""
        positions = self.layout.positions()
        shape = tuple(x_shape)
        for c in self.layout.calls[: positions.start if kind == "F" else positions.stop]:
            shape = self.all_units[c.unit].output_shape(shape, c.entry)
        return shape

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

    def compute(self, s, micro_batches, denominator: float, scale: float) -> float:
        """See ModelParallel: this stage's schedule; the loss counts on the last stage's tp rank 0."""
        run = StageRun(_Stage(self, s), self._chunks(micro_batches), denominator, scale)
        self.last_run = run
        t0 = time.perf_counter()
        try:
            loss = run.train()
        finally:
            self.pipeline_s = time.perf_counter() - t0
        return loss if self.layout.last and self.tp_group.rank == 0 else 0.0

    async def finish_grads(self, s) -> None:
        """See ModelParallel: drain tp, pp; sum the shared units' gradients over the two stages."""
        for acc in self.accounted():
            await acc.drain()
        for g in self.layout.shared():
            if self.emb_acc is not None and g in self.global_index:
                grad = s._opt_shards()[self.global_index.index(g)][1]
                await self.emb_acc.exposed(self.emb_acc.all_reduce(grad))

    def counted_ranges(self, s, i: int) -> list[tuple[int, int]]:
        """See ModelParallel: nothing of a unit another stage owns; on tp ranks but 0 the cut parts only."""
        unit = s.units[i]
        if self.layout.owner(self.global_index[i]) != self.layout.stage:
            return []  # the second copy of a shared unit (the last stage's)
        if self.tp_group.rank == 0:
            return [(0, unit.numel)]
        if full_index(unit) is None:
            return []  # no layer of it is cut: every tp rank holds it whole
        return _subtract([(0, unit.numel)], replicated_ranges(unit))

    async def agree(self, s, stats: np.ndarray) -> None:
        """See ModelParallel: one all_reduce over the whole mesh."""
        if self.world_acc.size > 1:
            await self.world_acc.exposed(self.world_acc.all_reduce(stats))

    def report(self, s, result) -> None:
        """See ModelParallel: bytes per mesh dimension and the pipeline's timings."""
        tp, pp, world, emb = self.tp_group.acc, self.pp_acc, self.world_acc, self.emb_acc
        by_dim = {"dp": result.comm_bytes, "tp": tp.bytes_sent,
                  "pp": pp.bytes_sent + (emb.bytes_sent if emb else 0), "stats": world.bytes_sent}
        bubble = self.last_run.wait_s if self.last_run else 0.0
        t = dict(result.timings)
        t["compute_s"] = max(0.0, t["compute_s"] - tp.exposed_s - bubble)
        t["exposed_comm_s"] += tp.exposed_s + world.exposed_s + (emb.exposed_s if emb else 0.0)
        t["comm_s"] += tp.comm_s + pp.comm_s + world.comm_s + (emb.comm_s if emb else 0.0)
        t["bubble_s"], t["pipeline_s"] = bubble, self.pipeline_s
        result.timings = t
        result.comm_bytes = sum(by_dim.values())
        result.comm_bytes_by_dim = by_dim

    def pipeline_report(self) -> dict:
        """This rank's figures for the run summary: mesh coordinates, the micro-batches of the last
        step, the most micro-batches in flight, the bubble formula."""
        m = len(self.last_run.chunks) if self.last_run else 0
        return {"coords": dict(self.mesh.coords), "micro_batches": m,
                "in_flight_peak": self.last_run.in_flight_peak if self.last_run else 0,
                "bubble_formula": bubble_formula(self.layout.pp, m) if m else 0.0}

    # ---- evaluation, full parameters, checkpoints ----------------------------------------------

    async def evaluate(self, s, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """See Strategy.evaluate: the metric sums of this dp slice's rows, on every rank of the slice."""
        run = StageRun(_Stage(self, s))
        try:
            metrics = await s._in_thread(run.evaluate, x, y)
            await s.collectives.drain()
            for acc in self.accounted():
                await acc.drain()
        except BaseException:
            await s._cancel_pending()
            raise
        names = s.loss.metric_names
        vector = np.array([metrics[k] for k in names] if metrics else [0.0] * len(names), dtype=np.float64)
        await self.pp_acc.broadcast(vector, self.layout.pp - 1)  # the last stage's sums, to the whole slice
        return dict(zip(names, vector.tolist()))

    async def full_params(self, s) -> list[np.ndarray]:
        return await self.full.full_params(s)

    def full_state(self, s, state: dict) -> dict:
        return self.full.full_state(s, state)

    def local_state(self, s, state: dict) -> dict:
        return self.full.local_state(s, state)

    async def sharded_state_dict(self, s) -> dict:
        await s._ensure_fresh()
        return await self.full.sharded_state_dict(s)


class _Stage:
    """This rank's stage as the pipeline executor (executor.py) reads it: the strategy's hooks and
    buffers; the part's layout, groups, activation dtype and receive shapes (`activation_shape`:
    the model's own boundary, so an MLP's stages exchange a different width at each boundary)."""

    def __init__(self, part: MeshParallel, s) -> None:
        self.layout, self.pp_acc, self.parallel = part.layout, part.pp_acc, part.parallel
        self.activation_dtype, self.activation_shape, self.wait_on = (
            part.activation_dtype, part.activation_shape, part.wait_on)
        self.model, self.loss, self.config, self.step, self.meter = s.model, s.loss, s.config, s.step, s.meter
        self._compute_params, self._grad_list = s._compute_params, s._grad_list
        self._hooks, self._eval_hooks = s._hooks, s._eval_hooks


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


def _dp_groups(name: str, mesh: Mesh) -> tuple:
    """(shard group, replicate group or None) of the dp dimension: hybrid sharding where the mesh
    replicates (zero and fsdp; ddp takes all of dp)."""
    replicate = mesh["dp_replicate"]
    if replicate.size == 1 or name == "ddp":
        return mesh["dp"], None
    return mesh["dp_shard"], replicate


def make_parallel_strategy(name: str, model: Model | GPTConfig, config: TrainConfig, mesh: Mesh, *,
                           parallel: ParallelConfig | None = None, **kw):
    """The data-parallel strategy ``name`` on the mesh's dp dimension over this rank's stage of
    ``model`` cut for its tp rank (the module docstring), with offload when ``config.offload`` asks
    for it. ``model``: a Model whose layers declare their splits, or a GPTConfig. Call
    ``await setup()`` next.

    Raises:
        ValueError: an unknown strategy; a model that does not split over the mesh.
    """
    part_ = MeshParallel(model, config, mesh, parallel)
    group, replicate = _dp_groups(name, mesh)
    offload = DiskOffload(config) if config.offload else None
    return make_strategy(name, part_.model, config, group, replicate=replicate, model_parallel=part_,
                         offload=offload, **kw)
