"""The training loop: `fit` and `evaluate` over any sharding strategy, any model and loss.

What it is: the driver every rank runs in the same order. Per optimizer step it takes
`grad_accum` consecutive global micro-batches of `global_batch_size` samples (this rank's block
of each, `trainer.data.iter_local_batches`), hands them to `strategy.train_step` and records the
agreed loss. Per epoch it evaluates the validation set exactly (each rank a contiguous shard,
nothing padded or repeated, the sums of every metric all-reduced), then runs the callbacks and
saves a checkpoint. Every rank takes part in every step, even one with no rows of a short last
batch, so uneven inputs never hang; a callback's `state.stop_training` is OR-ed across ranks, so
all stop at the same step.

    history = await fit(strategy, split, config, epochs=5, global_batch_size=64)
    history.epochs[-1].val_acc            # 0.983... (classifiers; None for a regression)
    metrics = await evaluate(strategy, split.val, group=world)   # {"loss": 0.06, "accuracy": 0.98}

With `checkpoint_dir` each checkpoint holds the strategy's state and the loop's position, and
names its run (trainer/rundir.py decides whether a call continues it); a continued run skips the
micro-batches already consumed, so its losses equal an uninterrupted run's; `save_best` keeps the
best epoch's checkpoint too. The step schedule and the run's parts: `_Run`, and docs/design.md,
"The training loop". Rank 0 shows progress on stderr (trainer/progress.py), logs every checkpoint
saved or loaded, writes every step's metrics to a file when asked (trainer/metrics.py) and the
summary to stdout. `evaluate` lives in trainer/evaluation.py.

What it is not: no data loader threads, no metrics beyond the loss's (callbacks compute their own),
no learning-rate logic (the strategy owns the schedule through TrainConfig), no command line
(trainer/cli.py).
"""

from __future__ import annotations

import itertools
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from trainer import checkpoint, leave, preempt, rundir, runid
from trainer.callbacks import EPOCH_METRICS, Best, Callback, EarlyStopping, LoopState, StopAtAccuracy, epoch_metric
from trainer import elastic
from trainer.data import epoch_order, iter_local_batches, local_batches_from, num_global_batches
from trainer.evaluation import default_group, evaluate, rank_size, sum_over
from trainer.history import EpochStats, History, RankStats, format_bytes, format_summary
from trainer.metrics import MetricsLog, StepMetrics, metrics_format
from trainer.progress import Progress
from trainer.sharding.base import StepResult, Strategy, TrainConfig

__all__ = [
    "fit", "evaluate", "steps_per_epoch", "EpochStats", "RankStats", "History", "LoopState",
    "Callback", "EarlyStopping", "StopAtAccuracy", "format_summary", "format_bytes", "EpochSums",
]


# ---- the loop ----------------------------------------------------------------


def steps_per_epoch(n_train: int, global_batch_size: int, grad_accum: int = 1) -> int:
    """Optimizer steps in one epoch: ceil(ceil(n / G) / A)."""
    return math.ceil(num_global_batches(n_train, global_batch_size) / grad_accum)


@dataclass
class EpochSums:
    """An epoch's running sums (saved in mid-epoch checkpoints, so a resumed epoch reports the whole)."""
    loss_x_rows: float = 0.0  # sum over steps of the step's loss times its rows
    rows: int = 0  # training samples run
    skipped: int = 0  # steps skipped by loss scaling
    train_time_s: float = 0.0  # seconds in train_step and batching

    def add(self, result: StepResult, rows: int, seconds: float) -> None:
        self.loss_x_rows += result.loss * rows
        self.rows += rows
        self.skipped += int(result.skipped)
        self.train_time_s += seconds

    @property
    def train_loss(self) -> float:
        return self.loss_x_rows / self.rows if self.rows else float("nan")

    @property
    def samples_per_s(self) -> float:
        return self.rows / self.train_time_s if self.train_time_s > 0 else 0.0


async def _agree_stop(group, stop: bool) -> bool:
    flag = np.array([1.0 if stop else 0.0])
    await sum_over(group, flag)
    return bool(flag[0] > 0)


async def _run_callbacks(callbacks: list, method: str, state: LoopState, group) -> bool:
    """Calls ``method`` ("on_step_end" / "on_epoch_end") of every callback; True if any
    callback on any rank asked to stop. No callbacks: False, without a collective."""
    if not callbacks:
        return False
    state.stop_training = False
    for cb in callbacks:
        getattr(cb, method)(state)
    return await _agree_stop(group, state.stop_training)


@dataclass(frozen=True)
class _Options:
    epochs: int
    global_batch_size: int
    checkpoint_dir: str | None
    keep_last: int
    checkpoint_every: int
    eval_train: bool
    eval_batch_size: int
    save_best: str | None = None  # an EpochStats field, e.g. "val_loss"


class _Run:
    """One call of `fit`: its state and its named parts, each a clear boundary::

        open_run()          with a checkpoint directory: which run this is (trainer/rundir.py) and,
                            when it continues one, its newest valid checkpoint: epoch, step, sums, history
        for each epoch:
            train_epoch()   for each step: train_step() -> the step's result
                                           step_boundary() -> callbacks, periodic checkpoint; stop?
            end_epoch()     evaluation, EpochStats, callbacks, the epoch's checkpoint, progress
        finish()            every rank's figures (RankStats), the summary

    `step_boundary` is where every rank stands between two optimizer steps with nothing in flight:
    the place for anything that must act on all ranks at one step (a stop, a checkpoint, a signal
    to save and exit)."""

    def __init__(self, strategy: Strategy, data, config: TrainConfig, options: _Options, callbacks: list,
                 group, progress: Progress) -> None:
        self.strategy, self.data, self.config, self.options, self.group = strategy, data, config, options, group
        self.progress = progress
        self.metrics_log: MetricsLog | None = None  # rank 0's --metrics file, opened once the run's position is known
        self.rank, self.size = rank_size(group)
        # the ranks the data is split over: the group, or a mesh strategy's dp dimension (trainer/parallel)
        self.data_group = getattr(strategy, "data_group", None) or group
        self.data_rank, self.data_size = rank_size(self.data_group)
        self.accum = config.grad_accum
        self.n_train = len(data.train)
        self.steps_total = steps_per_epoch(self.n_train, options.global_batch_size, self.accum)
        self.history = History(world_size=self.size, strategy=getattr(strategy, "name", type(strategy).__name__),
                               tokens_per_sample=getattr(data, "tokens_per_sample", None))
        self.best = Best(options.save_best) if options.save_best else None  # the kept checkpoint's metric
        self.started = time.perf_counter()
        self.step_callbacks = [c for c in callbacks if hasattr(c, "on_step_end")]
        self.epoch_callbacks = [c for c in callbacks if hasattr(c, "on_epoch_end")]
        # what must match for a resume to continue the same data order
        self.run_key = {"n_train": self.n_train, "global_batch_size": options.global_batch_size,
                        "grad_accum": self.accum, "seed": config.seed}
        self.start_epoch, self.start_k = 0, 0
        self.run: dict | None = None  # {"id", "config"} once open_run has decided: every checkpoint's "run"
        self.sums = EpochSums()  # the running epoch's
        self.comm_bytes = 0
        self.timings = {"compute_s": 0.0, "comm_s": 0.0, "exposed_comm_s": 0.0, "bubble_s": 0.0, "pipeline_s": 0.0}
        self.comm_by_dim: dict[str, int] = {}  # a mesh strategy's bytes per dimension
        self.stop = False
        self.elastic, self.settle = None, False  # an elastic job's ElasticJob; whether its members agree first
        self.state = LoopState(epoch=0, epochs=options.epochs, step=0, step_in_epoch=0,
                               steps_per_epoch=self.steps_total, rank=self.rank, world_size=self.size,
                               history=self.history, strategy=strategy)

    # ---- resume -------------------------------------------------------------------

    async def open_run(self, resume: runid.Resume, move_aside: bool, fields: Mapping | None,
                       environ: Mapping[str, str]) -> None:
        """Settles with checkpoint_dir which run this is (trainer/rundir.py: refuses with RunError, or
        moves another run aside) and, when it continues one, loads its newest valid checkpoint and
        moves to its position."""
        directory = self.options.checkpoint_dir
        model = getattr(self.strategy, "logical_model", self.strategy.model)
        config = runid.run_config(model, optimizer=self.config.optimizer, batching=self.run_key, fields=fields)
        opened = await rundir.open_run(directory, self.group, environ=environ, config=config,
                                       shapes=runid.param_shapes(getattr(model, "units", [])), resume=resume,
                                       move_aside=move_aside)
        self.run = {"id": opened.run_id, "config": config}
        if not opened.candidates:
            if opened.note:
                self.progress.log(opened.note)
            return
        path, meta = await _load_checkpoint(directory, self.strategy, self.run_key, opened.candidates)
        self.start_epoch, self.start_k = meta["epoch"], meta["step_in_epoch"]
        self.state.step = meta["step"]
        self.sums = EpochSums(**meta["carried"])
        self.history.epochs = [EpochStats(**e) for e in meta["history"]]
        self.history.resumed_from = (self.start_epoch, self.start_k)
        saved_best = meta.get("best")
        if self.best is not None and isinstance(saved_best, dict) and saved_best.get("metric") == self.best.name:
            self.best.value, self.best.step = saved_best.get("value"), saved_best.get("step")
        note = f" ({opened.note})" if opened.note else ""
        self.progress.log(f"resumed from {path}: epoch {self.start_epoch + 1}, step {self.start_k} of "
                          f"{self.steps_total} (optimizer step {self.state.step}){note}")

    def _best_record(self) -> dict | None:
        if self.best is None or self.best.step is None:
            return None
        return {**self.best.as_dict(), "path": os.path.join(self.options.checkpoint_dir,
                                                            checkpoint.step_dir_name(self.best.step))}

    async def save(self, epoch: int, k: int, sums: EpochSums) -> None:
        """A checkpoint of this position (every rank); the best one, with save_best, is never pruned."""
        best = self._best_record()
        meta = {"epoch": epoch, "step_in_epoch": k, "step": self.state.step, "carried": asdict(sums),
                "run": self.run_key, "history": [e.as_dict() for e in self.history.epochs]}
        if best is not None:
            meta["best"] = best
        protected = (os.path.basename(best["path"]),) if best else ()
        path = await checkpoint.save(self.strategy, self.options.checkpoint_dir, extra={"loop": meta},
                                     keep_last=self.options.keep_last, run=self.run, protected=protected)
        where = f"after epoch {epoch}" if k == 0 else f"epoch {epoch + 1}, step {k} of {self.steps_total}"
        self.progress.log(f"saved checkpoint {path} (optimizer step {self.state.step}, {where})"
                          + (f"; best {best['metric']} {best['value']:.4f}: {best['path']}" if best else ""))

    async def restore_newest(self, strategy) -> tuple[int, int, int] | None:
        """An elastic job whose shard has no copy left in memory (trainer/elastic.py): this run's
        newest checkpoint loaded into ``strategy`` (every member); its position, or None: none yet."""
        _, candidates = rundir.checkpoints_to_read(self.options.checkpoint_dir)
        if not candidates:
            return None
        path, meta = await _load_checkpoint(self.options.checkpoint_dir, strategy, self.run_key, candidates)
        self.sums = EpochSums(**meta["carried"])
        self.progress.log(f"a shard had no copy left in memory: continuing from {path} (optimizer step "
                          f"{meta['step']})")
        return meta["epoch"], meta["step_in_epoch"], meta["step"]

    async def open_metrics(self, path: str) -> None:
        """Rank 0 opens the metrics file (a resumed run keeps its rows up to here); every rank
        learns whether it could, so a path rank 0 cannot write stops all before the first step."""
        error = None
        if self.rank == 0:
            try:
                self.metrics_log = MetricsLog(path, resume_step=self.state.step if self.history.resumed_from else None,
                                              say=self.progress.log)
            except OSError as exc:
                error = exc
        if await _agree_stop(self.group, error is not None):
            raise OSError(f"metrics file {path}: rank 0 cannot write it" + (f": {error}" if error else ""))

    # ---- one epoch ------------------------------------------------------------------

    async def train_epoch(self, epoch: int) -> None:
        """The epoch's steps, from start_k after a resume; may stop early (self.stop)."""
        self.epoch_start = time.perf_counter()
        first_k = self.start_k if epoch == self.start_epoch else 0
        if epoch != self.start_epoch:
            self.sums = EpochSums()
        self.state.epoch, self.state.step_in_epoch, self.state.epoch_stats = epoch, first_k, None
        self.steps_run = 0
        if self.elastic is not None:
            await self._elastic_epoch(epoch, first_k)
            return
        micro = list(iter_local_batches(self.n_train, self.options.global_batch_size, self.data_size, self.data_rank,
                                        seed=self.config.seed, epoch=epoch, shuffle=True))
        for k in range(first_k, self.steps_total):
            await self.train_step(epoch, micro[k * self.accum : (k + 1) * self.accum])
            self.state.step_in_epoch = k + 1
            if await self.step_boundary(epoch, k + 1):
                break

    async def _elastic_epoch(self, epoch: int, k: int) -> None:
        """train_epoch's steps in an elastic job: a step a lost member interrupted runs again over the re-formed
        job (trainer/elastic.py); between steps, joiners come in and signalled ranks go (trainer/leave.py)."""
        order = epoch_order(self.n_train, seed=self.config.seed, epoch=epoch, shuffle=True)
        g = self.options.global_batch_size
        while True:
            try:
                if self.settle:  # after a boundary or a re-form (a joiner: its entry), before a step
                    k, self.settle = await leave.settle(self, epoch, k), False
                if k >= self.steps_total:
                    break
                micro = list(itertools.islice(local_batches_from(order, k * self.accum * g, g, self.data_size,
                                                                 self.data_rank), self.accum))
                await self.train_step(epoch, micro)
                self.elastic.step_done()
                k = self.state.step_in_epoch = k + 1
                if await self.step_boundary(epoch, k):
                    break
                self.settle = True  # a joiner starts with a step: the members agree after theirs
            except elastic.RECOVERABLE as exc:
                if elastic.peer_failure(exc) is None:
                    raise  # this rank's own error: re-forming would not cure it
                if self.strategy.step > self.state.step:  # failed after the commit: the step counts
                    k = self.state.step_in_epoch = k + 1
                    self.state.step += 1
                self.progress.log(f"rank {self.rank}: {type(exc).__name__}: {exc}; re-forming the job")
                await self.regroup(epoch, k, exc)
                k, self.settle = self.state.step_in_epoch, True

    async def regroup(self, epoch: int, k: int, exc: BaseException | None, lost: list[int] | None = None) -> None:
        """Re-forms the job (trainer/elastic.py) and takes rank 0's position in the epoch."""
        at_epoch, k, self.state.step = await self.elastic.recover(self.strategy, (epoch, k, self.state.step), exc,
                                                                  lost=lost)
        if at_epoch != epoch:
            raise RuntimeError(f"after re-forming the job, its rank 0 is in epoch {at_epoch}, this rank in {epoch}")
        self.take_world()
        self.state.step_in_epoch = k
        self.progress.log(f"generation {self.elastic.rt.generation}: {self.size} ranks, epoch {epoch + 1} "
                          f"step {k} of {self.steps_total} (optimizer step {self.state.step})")

    def take_world(self) -> None:
        """The elastic job's current generation (a re-form, or a joiner's entry) is the loop's group."""
        self.group = self.data_group = self.elastic.group
        self.rank, self.size = self.data_rank, self.data_size = rank_size(self.group)
        self.state.rank, self.state.world_size = self.rank, self.size
        self.progress.enabled = self.rank == 0

    async def train_step(self, epoch: int, batches: list) -> StepResult:
        """One optimizer step over this rank's part of `batches` (the step's global micro-batches)."""
        t0 = time.perf_counter()
        micro_batches = []
        for b in batches:
            x, y = self.data.train.get(b.indices, epoch)
            micro_batches.append((x, y, b.offset, b.global_size))
        result = await self.strategy.train_step(micro_batches)
        seconds = time.perf_counter() - t0
        rows = sum(b.global_size for b in batches)
        self.sums.add(result, rows, seconds)
        self.history.steps += 1
        self.history.samples += rows
        self.history.train_time_s += seconds
        self.comm_bytes += int(result.comm_bytes)
        for key in self.timings:
            self.timings[key] += float(result.timings.get(key, 0.0))
        for dim, nbytes in result.comm_bytes_by_dim.items():
            self.comm_by_dim[dim] = self.comm_by_dim.get(dim, 0) + int(nbytes)
        self.steps_run += 1
        self.state.step += 1
        self.state.result = result
        self.state.metrics = self._step_metrics(epoch, result, rows, seconds)
        return result

    def _step_metrics(self, epoch: int, result: StepResult, rows: int, seconds: float) -> StepMetrics:
        schedule = getattr(self.strategy, "schedule", None)  # step -> lr (trainer.optim), of this step's index
        scaler = getattr(self.strategy, "scaler", None)
        scaling = getattr(scaler, "enabled", result.loss_scale != 1.0)
        rate = rows / seconds if seconds > 0 else 0.0
        tokens = self.history.tokens_per_sample
        return StepMetrics(step=self.state.step, epoch=epoch, step_in_epoch=self.state.step_in_epoch + 1,
                           loss=float(result.loss), lr=float(schedule(self.state.step - 1)) if callable(schedule)
                           else None, grad_norm=None if result.grad_norm is None else float(result.grad_norm),
                           loss_scale=float(result.loss_scale) if scaling else None, skipped=bool(result.skipped),
                           samples_per_s=rate, tokens_per_s=rate * tokens if tokens else None,
                           elapsed_s=time.perf_counter() - self.started)

    async def step_boundary(self, epoch: int, k: int) -> bool:
        """Between two steps (k steps of the epoch done), on every rank: progress, the step
        callbacks, the periodic checkpoint. Returns True to stop the epoch."""
        rate = self.sums.samples_per_s * (self.history.tokens_per_sample or 1)
        steps_left = (self.options.epochs - epoch) * self.steps_total - k
        self.progress.step(self.state.metrics, epochs=self.options.epochs, steps=self.steps_total, rate=rate,
                           steps_left=steps_left)
        if self.metrics_log is not None:
            self.metrics_log.step(self.state.metrics)
        if await _run_callbacks(self.step_callbacks, "on_step_end", self.state, self.group):
            self.stop = True
        every = self.options.checkpoint_every
        if self.options.checkpoint_dir and every and self.state.step % every == 0 and k < self.steps_total:
            await self.save(epoch, k, EpochSums(**asdict(self.sums)))
        # a scheduler's signal on any rank: all save here and raise Preempted (trainer/preempt.py; elastic: leave.py)
        save = (lambda: self.save(epoch, k, EpochSums(**asdict(self.sums)))) if self.options.checkpoint_dir else None
        if self.elastic is None:
            await preempt.at_step_boundary(self.group, save)
        return self.stop

    async def _evaluate(self, dataset) -> dict[str, float]:
        return await evaluate(self.strategy, dataset, group=self.data_group, batch_size=self.options.eval_batch_size)

    async def end_epoch(self, epoch: int) -> EpochStats:
        """Exact evaluation across ranks, the epoch's stats, callbacks, checkpoint, progress."""
        train_metrics = await self._evaluate(self.data.train) if self.options.eval_train else {}
        val_metrics = await self._evaluate(self.data.val) if len(self.data.val) else {}
        bytes_per_token = getattr(self.data, "bytes_per_token", None)
        val_loss = val_metrics.get("loss")
        stats = EpochStats(
            epoch=epoch, steps=self.steps_run, train_loss=self.sums.train_loss,
            train_acc=train_metrics.get("accuracy"), val_loss=val_loss, val_acc=val_metrics.get("accuracy"),
            samples_per_s=self.sums.samples_per_s,
            effective_batch_size=self.options.global_batch_size * self.accum,
            train_time_s=self.sums.train_time_s, epoch_time_s=0.0, skipped_steps=self.sums.skipped,
            train_eval_loss=train_metrics.get("loss"), val_metrics=val_metrics,
            val_bits_per_byte=(val_loss / math.log(2) / bytes_per_token
                               if bytes_per_token and val_loss is not None else None),
            tokens_per_s=(self.sums.samples_per_s * self.history.tokens_per_sample
                          if self.history.tokens_per_sample else None))
        self.history.epochs.append(stats)
        self.state.epoch_stats = stats
        if await _run_callbacks(self.epoch_callbacks, "on_epoch_end", self.state, self.group):
            self.stop = True
        if self.best is not None:  # the same numbers on every rank: every rank decides alike
            self.best.update(epoch_metric(stats, self.best.name, "save_best"), self.state.step)
        if self.options.checkpoint_dir:
            await self._save_epoch(epoch, stats)
        stats.epoch_time_s = time.perf_counter() - self.epoch_start
        self.progress.epoch_end(self.options.epochs, stats)
        if self.metrics_log is not None:
            self.metrics_log.epoch({"step": self.state.step, "epoch": epoch,
                                    "elapsed_s": time.perf_counter() - self.started, "samples_per_s": stats.samples_per_s, "tokens_per_s": stats.tokens_per_s,
                                    **{k: getattr(stats, k) for k in EPOCH_METRICS}})
        if self.stop:
            self.history.stopped_early = True
            self.progress.log(f"stopped early after epoch {epoch + 1} (step {self.state.step})")
        return stats

    async def _save_epoch(self, epoch: int, stats: EpochStats) -> None:
        """A finished epoch resumes at the next one; a stopped one where it stopped."""
        if self.state.step_in_epoch >= self.steps_total:
            await self.save(epoch + 1, 0, EpochSums())
            return
        self.history.epochs.pop()  # an early stop mid-epoch: this epoch's stats are provisional, not saved
        await self.save(epoch, self.state.step_in_epoch, EpochSums(**asdict(self.sums)))
        self.history.epochs.append(stats)

    # ---- the end ------------------------------------------------------------------------

    async def finish(self) -> History:
        self.history.best = self._best_record()
        self.history.ranks = await _gather_rank_stats(self.strategy, self.group, self.comm_bytes, self.timings,
                                                      self.history.steps, self.comm_by_dim)
        return self.history


async def fit(
    strategy: Strategy,
    data,
    config: TrainConfig,
    *,
    epochs: int,
    global_batch_size: int,
    callbacks: Sequence[Any] = (),
    checkpoint_dir: str | None = None,
    keep_last: int = 2,
    resume: bool | str = False,
    move_aside: bool = False,
    run_fields: Mapping | None = None,
    environ: Mapping[str, str] | None = None,
    log_every: int = 10,
    checkpoint_every: int = 0,
    eval_train: bool = True,
    eval_batch_size: int = 4096,
    group=None,
    progress_stream=None,
    summary_stream=None,
    print_summary: bool = True,
    metrics: str | None = None,
    save_best: str | None = None,
    elastic: "elastic.ElasticJob | None" = None,
) -> History:
    """Trains `strategy` on `data` for `epochs` epochs; returns the History on every rank.

    Args:
        strategy: set up already (`await strategy.setup()`), see trainer.sharding.base.
        data: a split with `.train` and `.val` data sets (trainer.data.Split,
            trainer.text.TextSplit, or your own), the same on every rank.
        config: the TrainConfig the strategy was built with (grad_accum, seed: the data order).
        epochs: total epochs, counting those done before a resume.
        global_batch_size: samples per global micro-batch (all ranks together); an
            optimizer step takes `config.grad_accum` of them.
        callbacks: objects with `on_step_end(state)` / `on_epoch_end(state)` (either optional).
        checkpoint_dir: where to save (end of each epoch, and every `checkpoint_every` steps).
        keep_last: checkpoints of this run kept in `checkpoint_dir` (another run's are never deleted).
        resume: False: a new run (a restarted attempt of the same job still continues its own run);
            True ("always"): continue the directory's run, and RunError if there is no checkpoint;
            "auto": continue it if there is a checkpoint, else start. Every case: trainer/runid.py.
        move_aside: a new run in a directory that holds another run's checkpoints moves them
            into a sub-directory first (without it, RunError).
        run_fields: what else must match to continue this run, {name: JSON scalar or list of
            scalars} (e.g. the data set, an MLP's widths), added to the model's and the batching's.
        environ: where the job's id and restart count are read (default os.environ).
        log_every: progress line every N steps (non-terminal streams; 0: epoch lines only).
        eval_train: also evaluate the whole training set after each epoch (train_acc).
        eval_batch_size: samples per evaluation call (a language model's windows: keep it small).
        group: the process group (default: the strategy's `group`, else the runtime's world).
        progress_stream / summary_stream: default stderr / stdout; used on rank 0 only.
        print_summary: print `format_summary(history)` at the end (rank 0).
        metrics: a file (``.csv`` or ``.jsonl``) rank 0 writes every step's metrics to, and
            TensorBoard event files beside it where a writer is installed (trainer/metrics.py).
        save_best: an EpochStats field ("val_loss", "val_acc", ...: callbacks.EPOCH_METRICS); the
            checkpoint of the epoch where it was best (lowest, or highest for an accuracy) is kept
            beside the `keep_last` newest and never pruned. Needs checkpoint_dir.
        elastic: an elastic job's trainer.elastic.ElasticJob, with a strategy built with
            ``redundancy=elastic.redundancy()``: a lost member costs a re-formed job and the step
            run again; a joiner starts from the members' state and position.

    Raises:
        RunError (a ValueError): on every rank, before any step, when the checkpoint directory
            holds another run, no checkpoint for resume=True, or a run whose config differs.
        ValueError: bad sizes; whatever the strategy or the collectives raise
        (a lost peer, a mismatch) propagates unchanged.
    """
    if epochs < 0 or global_batch_size < 1 or config.grad_accum < 1:
        raise ValueError(f"need epochs >= 0, global_batch_size >= 1, grad_accum >= 1, got "
                         f"{epochs}, {global_batch_size}, {config.grad_accum}")
    mode = runid.Resume.of(resume)
    if mode is not runid.Resume.NEVER and not checkpoint_dir:
        raise ValueError("resume=True needs a checkpoint_dir")
    if move_aside and mode is not runid.Resume.NEVER:
        raise ValueError("move_aside starts a new run: it cannot go with resume")
    if metrics:
        metrics_format(metrics)  # ValueError on every rank before anything runs
    if save_best is not None and (not checkpoint_dir or save_best not in EPOCH_METRICS):
        raise ValueError(f"save_best={save_best!r} needs a checkpoint_dir and one of {EPOCH_METRICS}")
    if elastic is not None and not getattr(getattr(strategy, "redundancy", None), "enabled", False):
        raise ValueError("fit(elastic=job) needs a strategy built with redundancy=job.redundancy() (every "
                         "step voted, shards replicated)")
    if group is None:
        group = default_group(strategy)
    rank, _ = rank_size(group)
    options = _Options(epochs=epochs, global_batch_size=global_batch_size, checkpoint_dir=checkpoint_dir,
                       keep_last=keep_last, checkpoint_every=checkpoint_every, eval_train=eval_train,
                       eval_batch_size=eval_batch_size, save_best=save_best)
    unit = "tokens" if getattr(data, "tokens_per_sample", None) else "samples"
    run = _Run(strategy, data, config, options, list(callbacks), group,
               Progress(progress_stream or sys.stderr, rank == 0, log_every, unit=unit))
    joiner = elastic is not None and elastic.joined
    if checkpoint_dir and not joiner:  # a joiner takes the members' run (ElasticJob.sync), not a collective of its own
        await run.open_run(mode, move_aside, run_fields, os.environ if environ is None else environ)
    run.elastic = elastic
    if elastic is not None and checkpoint_dir:  # trainer/elastic.py: the run's id, and a shard with no copy left
        elastic.carry, elastic.restore = run.run or {}, run.restore_newest
    if joiner:  # the members' state and position (trainer/elastic.py)
        run.start_epoch, run.start_k, run.state.step = await elastic.enter(strategy)
        run.run = elastic.carry or None
        run.take_world()  # a member lost while it entered: a later generation than the one it joined
        run.settle = True  # then the members' agreement (trainer/leave.py)
    try:
        if metrics and not joiner:  # a joiner is never rank 0
            await run.open_metrics(metrics)
        for epoch in range(run.start_epoch, epochs):
            await run.train_epoch(epoch)
            await run.end_epoch(epoch)
            if run.stop:
                break
    finally:
        if run.metrics_log is not None:
            run.metrics_log.close()
    history = await run.finish()
    if print_summary and rank == 0:
        stream = summary_stream or sys.stdout
        stream.write(format_summary(history) + "\n")
        stream.flush()
    return history


async def _gather_rank_stats(strategy: Strategy, group, comm_bytes: int, timings: dict,
                             steps: int, comm_by_dim: dict | None = None) -> list[RankStats]:
    """Every rank's memory, traffic and timings, on every rank (one all-reduce of an (R, 23) table);
    a mesh strategy adds its coordinates, bytes per dimension and pipeline figures."""
    rank, size = rank_size(group)
    mem = strategy.memory_bytes()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    report = strategy.pipeline_report() if hasattr(strategy, "pipeline_report") else None
    coords = report["coords"] if report else {"pp": -1, "dp": -1, "tp": -1}
    dims = comm_by_dim or {}
    table = np.zeros((size, 23), dtype=np.float64)  # float64 holds integers exactly below 2**53
    table[rank] = (mem.get("params", 0), mem.get("grads", 0), mem.get("optim", 0), mem.get("gathered_peak", 0),
                   maxrss, comm_bytes, timings["compute_s"], timings["comm_s"], timings["exposed_comm_s"], steps,
                   mem.get("activations_peak", 0), coords["pp"], coords["dp"], coords["tp"], dims.get("dp", 0),
                   dims.get("tp", 0), dims.get("pp", 0), timings.get("bubble_s", 0.0), timings.get("pipeline_s", 0.0),
                   report["bubble_formula"] if report else 0.0, report["in_flight_peak"] if report else 0,
                   mem.get("resident", 0), mem.get("offloaded", 0))
    await sum_over(group, table)
    return [RankStats(rank=r, params_bytes=int(t[0]), grads_bytes=int(t[1]), optim_bytes=int(t[2]),
                      gathered_peak_bytes=int(t[3]), maxrss_bytes=int(t[4]), comm_bytes=int(t[5]),
                      compute_s=float(t[6]), comm_s=float(t[7]), exposed_comm_s=float(t[8]), steps=int(t[9]),
                      activations_peak_bytes=int(t[10]),
                      coords={"pp": int(t[11]), "dp": int(t[12]), "tp": int(t[13])} if t[11] >= 0 else None,
                      sent_by_dim={"dp": int(t[14]), "tp": int(t[15]), "pp": int(t[16])}, bubble_s=float(t[17]),
                      pipeline_s=float(t[18]), bubble_formula=float(t[19]), in_flight_peak=int(t[20]),
                      resident_bytes=int(t[21]), offloaded_bytes=int(t[22]))
            for r, t in enumerate(table)]


# ---- checkpoints (trainer.checkpoint does the files; the loop adds its position) ----


async def _load_checkpoint(directory: str, strategy: Strategy, run: dict, candidates) -> tuple[str, dict]:
    """Loads the newest of `candidates` (step directories of `directory`, oldest first) that loads on
    every rank into `strategy` (an older one when the newest is damaged:
    trainer.checkpoint.load_newest_valid); returns its path and the loop's position.

    Raises:
        ValueError: the checkpoint was not written by `fit`, or by a run whose batching
            (data size, global batch, accumulation, seed) differs, so skipping the
            consumed batches would not continue the same run.
    """
    paths = [os.path.join(directory, name) for name in candidates]
    meta = await checkpoint.load_newest_valid(strategy, directory, paths)  # a damaged newest: the one before
    loop = (meta.get("extra") or {}).get("loop")
    if loop is None:
        raise ValueError(f"{meta['path']} was not written by trainer.loop.fit (no loop position in its "
                         f"metadata); cannot resume from it")
    if loop.get("run") != run:
        raise ValueError(f"{meta['path']} was saved by a run with batching {loop.get('run')}, this run has {run}; "
                         f"resuming would not continue the same data order")
    if int(meta["step"]) != int(loop["step"]):
        raise ValueError(f"{meta['path']}: strategy step {meta['step']} != loop step {loop['step']}")
    return meta["path"], loop
