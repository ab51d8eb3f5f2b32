"""The training loop: `fit` and `evaluate` over any sharding strategy.

What it is: the driver every rank runs in the same order. Per optimizer step it
takes `grad_accum` consecutive global micro-batches of `global_batch_size` rows
(`trainer.data.iter_local_batches`: this rank's contiguous block of each), hands
them to `strategy.train_step`, and records the agreed loss. Per epoch it
evaluates the training and validation sets exactly (each rank evaluates a
contiguous shard, nothing padded or repeated, and the sums of loss and correct
predictions are all-reduced), calls the callbacks, and saves a checkpoint.

    history = await fit(strategy, split, config, epochs=5, global_batch_size=64)
    history.epochs[-1].val_acc            # 0.983...
    loss, acc = await evaluate(strategy, split.x_val, split.y_val, group=world)

Step schedule of an epoch (G = global_batch_size, A = config.grad_accum)::

    micro-batches  m_0 .. m_{M-1},  M = ceil(n_train / G)        (the last may be short)
    step k         micro-batches m_{kA} .. m_{kA + A - 1}         (the last step may hold fewer)
    steps/epoch    ceil(M / A)

Every rank gets the same number of micro-batches (a short last global batch is
split with np.array_split sizes, so a rank may hold zero rows of it but still
takes part in the step's collectives): uneven inputs never hang.

Early stopping: a callback sets `state.stop_training = True`. The flag is
OR-ed across ranks (an all-reduce) before the loop acts on it, so a callback
that decided on rank 0 alone still stops every rank at the same step.

Resume: with `checkpoint_dir`, a checkpoint is saved at the end of every epoch
and, with `checkpoint_every=N`, every N optimizer steps; it holds the
strategy's state (parameters, optimizer state, step, loss scaler) and the
loop's position (epoch, steps done in the epoch, the epoch's running sums, the
history). `resume=True` loads the newest one and continues at that epoch and
step, skipping the micro-batches already consumed (the data order is a pure
function of (seed, epoch)), so the losses equal an uninterrupted run's.

Progress and logs go to stderr on rank 0 only: a redrawn bar on a terminal,
one line every `log_every` steps otherwise (e.g. under the launcher, which
prefixes lines). The summary (`format_summary`) goes to stdout on rank 0.

What it is not: no data loader threads, no metrics beyond loss and accuracy
(callbacks compute their own), no learning-rate logic (the strategy owns the
schedule through TrainConfig).
"""

from __future__ import annotations

import dataclasses
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from trainer import preempt
from trainer.data import iter_local_batches, num_global_batches, split_bounds
from trainer.sharding.base import Strategy, StepResult, TrainConfig

__all__ = [
    "fit", "evaluate", "steps_per_epoch", "EpochStats", "RankStats", "History", "LoopState",
    "Callback", "EarlyStopping", "StopAtAccuracy", "format_summary", "format_bytes",
]


# ---- results -----------------------------------------------------------------


@dataclass
class EpochStats:
    epoch: int  # 0-based, e.g. 4
    steps: int  # optimizer steps run in this epoch (fewer after a resume or an early stop)
    train_loss: float  # mean per-sample loss of the steps, weighted by rows (as trained)
    train_acc: float | None  # accuracy on the whole training set after the epoch (None: not evaluated)
    val_loss: float | None  # exact mean over the validation set, all ranks
    val_acc: float | None
    samples_per_s: float  # training rows per second of training time (all ranks together)
    effective_batch_size: int  # global_batch_size * grad_accum, e.g. 256
    train_time_s: float  # seconds in train_step calls and batching
    epoch_time_s: float  # the whole epoch, evaluation and checkpoint included
    skipped_steps: int = 0  # steps skipped by loss scaling (inf/NaN)
    train_eval_loss: float | None = None  # loss on the whole training set after the epoch

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RankStats:
    """What one rank did and holds, gathered to every rank at the end of `fit`."""
    rank: int
    params_bytes: int  # strategy.memory_bytes()["params"]
    grads_bytes: int
    optim_bytes: int
    gathered_peak_bytes: int
    maxrss_bytes: int  # resource.getrusage peak resident set size
    comm_bytes: int  # sum of StepResult.comm_bytes over the run
    compute_s: float  # sums of StepResult.timings over the run
    comm_s: float
    exposed_comm_s: float
    steps: int


@dataclass
class History:
    epochs: list[EpochStats] = field(default_factory=list)
    ranks: list[RankStats] = field(default_factory=list)  # by rank, filled at the end
    world_size: int = 1
    strategy: str = ""
    steps: int = 0  # optimizer steps run by this call (not counting steps before a resume)
    samples: int = 0  # training rows run by this call
    train_time_s: float = 0.0
    stopped_early: bool = False
    resumed_from: tuple[int, int] | None = None  # (epoch, step in epoch) of the checkpoint

    @property
    def comm_bytes(self) -> int:
        """Bytes sent by all ranks together during training."""
        return sum(r.comm_bytes for r in self.ranks)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_time_s if self.train_time_s > 0 else 0.0

    @property
    def final(self) -> EpochStats | None:
        return self.epochs[-1] if self.epochs else None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(comm_bytes=self.comm_bytes, samples_per_s=self.samples_per_s)
        return out


@dataclass
class LoopState:
    """What callbacks see. Set `stop_training = True` to stop (after this step / epoch)."""
    epoch: int
    epochs: int
    step: int  # optimizer steps completed in total (resumed runs count the earlier ones)
    step_in_epoch: int  # steps completed in this epoch
    steps_per_epoch: int
    rank: int
    world_size: int
    history: History
    strategy: Strategy
    result: StepResult | None = None  # the last step's result (on_step_end)
    epoch_stats: EpochStats | None = None  # this epoch's stats (on_epoch_end)
    stop_training: bool = False


# ---- callbacks ---------------------------------------------------------------


class Callback:
    """Optional base: override either method. Any object with them works.

    Callbacks run on every rank with the same (agreed) numbers, so a
    deterministic callback decides the same everywhere; the loop ORs
    `stop_training` across ranks anyway.
    """

    def on_step_end(self, state: LoopState) -> None:
        pass

    def on_epoch_end(self, state: LoopState) -> None:
        pass


class EarlyStopping(Callback):
    """Stops when `monitor` ("val_loss" | "val_acc" | "train_loss" ...) has not improved by
    `min_delta` for `patience` epochs."""

    def __init__(self, monitor: str = "val_loss", patience: int = 2, min_delta: float = 0.0) -> None:
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.sign = 1.0 if monitor.endswith("loss") else -1.0  # minimise losses, maximise accuracies
        self.best: float | None = None
        self.bad_epochs = 0

    def on_epoch_end(self, state: LoopState) -> None:
        value = getattr(state.epoch_stats, self.monitor)
        if value is None:
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, which this run does not compute")
        value = self.sign * value
        if self.best is None or value < self.best - self.min_delta:
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1
            state.stop_training = self.bad_epochs >= self.patience


class StopAtAccuracy(Callback):
    """Stops once validation accuracy reaches `target` (e.g. 0.97)."""

    def __init__(self, target: float) -> None:
        self.target = target

    def on_epoch_end(self, state: LoopState) -> None:
        if state.epoch_stats.val_acc is not None and state.epoch_stats.val_acc >= self.target:
            state.stop_training = True


# ---- communication helpers ---------------------------------------------------


def _rank_size(group) -> tuple[int, int]:
    return (0, 1) if group is None else (group.rank, group.size)


async def _sum(group, x: np.ndarray) -> np.ndarray:
    """Element-wise sum of `x` over the ranks of `group`, in place (nothing to do alone)."""
    if group is not None and group.size > 1:
        import collectives  # local: the loop runs single-process without the collectives package

        await collectives.all_reduce(x, op="sum", group=group)
    return x


def _default_group(strategy: Strategy):
    group = getattr(strategy, "group", None)
    if group is not None:
        return group
    try:
        import runtime

        return runtime.world()
    except Exception:  # no runtime: a single process
        return None


# ---- evaluation --------------------------------------------------------------


async def evaluate(strategy: Strategy, x: np.ndarray, y: np.ndarray, *, group=None,
                   batch_size: int = 4096) -> tuple[float, float]:
    """Exact (mean loss, accuracy) over all rows of (x, y), computed across ranks.

    Rank r evaluates rows split_bounds(n, R)[r] : [r + 1] in chunks of at most
    `batch_size` rows; every rank calls `strategy.evaluate` the same number of
    times (a rank with fewer rows passes an empty chunk), because under
    zero3/fsdp each call gathers parameters collectively. The sums of losses and
    correct predictions are all-reduced, so the answer is the single-process one.
    Every rank must pass the same full (x, y). Returns (nan, nan) for n == 0.
    """
    if group is None:
        group = _default_group(strategy)
    rank, size = _rank_size(group)
    n = len(x)
    bounds = split_bounds(n, size)
    lo, hi = bounds[rank], bounds[rank + 1]
    chunks = max(1, math.ceil(math.ceil(n / size) / batch_size))  # same on every rank
    totals = np.zeros(2, dtype=np.float64)  # (loss sum, correct)
    for c in range(chunks):
        a, b = min(hi, lo + c * batch_size), min(hi, lo + (c + 1) * batch_size)
        loss_sum, correct = await strategy.evaluate(x[a:b], y[a:b])
        totals += (loss_sum, correct)
    await _sum(group, totals)
    if n == 0:
        return float("nan"), float("nan")
    return float(totals[0] / n), float(totals[1] / n)


# ---- the loop ----------------------------------------------------------------


def steps_per_epoch(n_train: int, global_batch_size: int, grad_accum: int = 1) -> int:
    """Optimizer steps in one epoch: ceil(ceil(n / G) / A)."""
    return math.ceil(num_global_batches(n_train, global_batch_size) / grad_accum)


class _Progress:
    """Rank 0's progress on stderr: a redrawn bar on a terminal, else a line per `log_every` steps."""

    def __init__(self, stream, enabled: bool, log_every: int) -> None:
        self.stream, self.enabled, self.log_every = stream, enabled, max(0, log_every)
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self._last_draw = 0.0

    def step(self, epoch: int, epochs: int, k: int, steps: int, loss: float, rate: float) -> None:
        if not self.enabled:
            return
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < 0.1 and k != steps:
                return
            self._last_draw = now
            width = 24
            done = int(width * k / max(1, steps))
            bar = "#" * done + "." * (width - done)
            self.stream.write(f"\repoch {epoch + 1}/{epochs} [{bar}] {k}/{steps} "
                              f"loss {loss:.4f} {rate:,.0f} samples/s")
            self.stream.flush()
        elif self.log_every and (k % self.log_every == 0 or k == steps):
            self.stream.write(f"epoch {epoch + 1}/{epochs} step {k}/{steps} loss {loss:.4f} "
                              f"{rate:,.0f} samples/s\n")
            self.stream.flush()

    def epoch_end(self, epochs: int, s: EpochStats) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\n")
        parts = [f"epoch {s.epoch + 1}/{epochs}: train loss {s.train_loss:.4f}"]
        if s.train_acc is not None:
            parts.append(f"acc {s.train_acc:.4f}")
        if s.val_acc is not None:
            parts.append(f"| val loss {s.val_loss:.4f} acc {s.val_acc:.4f}")
        parts.append(f"| {s.samples_per_s:,.0f} samples/s, batch {s.effective_batch_size}, {s.epoch_time_s:.2f} s")
        if s.skipped_steps:
            parts.append(f"({s.skipped_steps} steps skipped)")
        self.stream.write(" ".join(parts) + "\n")
        self.stream.flush()

    def log(self, message: str) -> None:
        if self.enabled:
            self.stream.write(message + "\n")
            self.stream.flush()


async def _agree_stop(group, stop: bool) -> bool:
    flag = np.array([1.0 if stop else 0.0])
    await _sum(group, flag)
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


def _fresh_sums() -> dict:
    """An epoch's running sums before its first step."""
    return {"loss_x_rows": 0.0, "rows": 0, "skipped": 0, "train_time_s": 0.0}


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
    resume: bool = False,
    log_every: int = 10,
    checkpoint_every: int = 0,
    eval_train: bool = True,
    eval_batch_size: int = 4096,
    group=None,
    progress_stream=None,
    summary_stream=None,
    print_summary: bool = True,
) -> History:
    """Trains `strategy` on `data` for `epochs` epochs; returns the History on every rank.

    Args:
        strategy: set up already (`await strategy.setup()`), see trainer.sharding.base.
        data: a trainer.data.Split (x_train, y_train, x_val, y_val), the same on every rank.
        config: the TrainConfig the strategy was built with (grad_accum, seed: the data order).
        epochs: total epochs, counting those done before a resume.
        global_batch_size: rows per global micro-batch (all ranks together); an
            optimizer step takes `config.grad_accum` of them.
        callbacks: objects with `on_step_end(state)` / `on_epoch_end(state)` (either optional).
        checkpoint_dir: where to save (end of each epoch, and every `checkpoint_every` steps).
        keep_last: checkpoints kept in `checkpoint_dir`.
        resume: load the newest checkpoint in `checkpoint_dir` (if any) and continue from it.
        log_every: progress line every N steps (non-terminal streams; 0: epoch lines only).
        eval_train: also evaluate the whole training set after each epoch (train_acc).
        group: the process group (default: the strategy's `group`, else the runtime's world).
        progress_stream / summary_stream: default stderr / stdout; used on rank 0 only.
        print_summary: print `format_summary(history)` at the end (rank 0).

    Raises:
        ValueError: bad sizes; whatever the strategy or the collectives raise
        (a lost peer, a mismatch) propagates unchanged.
    """
    if epochs < 0 or global_batch_size < 1 or config.grad_accum < 1:
        raise ValueError(f"need epochs >= 0, global_batch_size >= 1, grad_accum >= 1, got "
                         f"{epochs}, {global_batch_size}, {config.grad_accum}")
    if resume and not checkpoint_dir:
        raise ValueError("resume=True needs a checkpoint_dir")
    if group is None:
        group = _default_group(strategy)
    rank, size = _rank_size(group)
    progress = _Progress(progress_stream or sys.stderr, rank == 0, log_every)
    accum = config.grad_accum
    n_train = len(data.x_train)
    steps_total = steps_per_epoch(n_train, global_batch_size, accum)
    history = History(world_size=size, strategy=getattr(strategy, "name", type(strategy).__name__))
    callbacks = list(callbacks)
    step_callbacks = [c for c in callbacks if hasattr(c, "on_step_end")]
    epoch_callbacks = [c for c in callbacks if hasattr(c, "on_epoch_end")]

    # what must match for a resume to continue the same data order
    run_key = {"n_train": n_train, "global_batch_size": global_batch_size, "grad_accum": accum, "seed": config.seed}
    # where to start: (epoch, steps done in it, running sums of that epoch)
    start_epoch, start_k, global_step = 0, 0, 0
    carried = _fresh_sums()
    if resume:
        meta = await _load_checkpoint(checkpoint_dir, strategy, group, run_key)
        if meta is not None:
            start_epoch, start_k, global_step = meta["epoch"], meta["step_in_epoch"], meta["step"]
            carried = meta["carried"]
            history.epochs = [EpochStats(**e) for e in meta["history"]]
            history.resumed_from = (start_epoch, start_k)
            progress.log(f"resumed from {checkpoint_dir}: epoch {start_epoch + 1}, step {start_k} "
                         f"of {steps_total} (optimizer step {global_step})")

    comm_bytes = 0
    timings = {"compute_s": 0.0, "comm_s": 0.0, "exposed_comm_s": 0.0}
    state = LoopState(epoch=start_epoch, epochs=epochs, step=global_step, step_in_epoch=start_k,
                      steps_per_epoch=steps_total, rank=rank, world_size=size, history=history,
                      strategy=strategy)

    async def save(epoch: int, k: int, sums: dict) -> None:
        meta = {"epoch": epoch, "step_in_epoch": k, "step": state.step, "carried": sums, "run": run_key,
                "history": [e.as_dict() for e in history.epochs]}
        await _save_checkpoint(checkpoint_dir, strategy, group, meta, keep_last)

    stop = False
    for epoch in range(start_epoch, epochs):
        epoch_start = time.perf_counter()
        first_k = start_k if epoch == start_epoch else 0
        sums = dict(carried) if epoch == start_epoch else _fresh_sums()
        micro = list(iter_local_batches(n_train, global_batch_size, size, rank, seed=config.seed,
                                        epoch=epoch, shuffle=True))
        state.epoch, state.step_in_epoch, state.epoch_stats = epoch, first_k, None
        steps_run = 0
        for k in range(first_k, steps_total):
            t0 = time.perf_counter()
            group_batches = micro[k * accum : (k + 1) * accum]
            batch = [(data.x_train[b.indices], data.y_train[b.indices], b.offset, b.global_size)
                     for b in group_batches]
            result = await strategy.train_step(batch)
            dt = time.perf_counter() - t0
            rows = sum(b.global_size for b in group_batches)
            sums["loss_x_rows"] += result.loss * rows
            sums["rows"] += rows
            sums["skipped"] += int(result.skipped)
            sums["train_time_s"] += dt
            history.steps += 1
            history.samples += rows
            history.train_time_s += dt
            comm_bytes += int(result.comm_bytes)
            for key in timings:
                timings[key] += float(result.timings.get(key, 0.0))
            steps_run += 1
            state.step += 1
            state.step_in_epoch = k + 1
            state.result = result
            rate = sums["rows"] / sums["train_time_s"] if sums["train_time_s"] > 0 else 0.0
            progress.step(epoch, epochs, k + 1, steps_total, result.loss, rate)
            if await _run_callbacks(step_callbacks, "on_step_end", state, group):
                stop = True
            if checkpoint_dir and checkpoint_every and state.step % checkpoint_every == 0 and k + 1 < steps_total:
                await save(epoch, k + 1, dict(sums))
            # a scheduler's signal on any rank: all save here and raise Preempted (trainer/preempt.py)
            await preempt.at_step_boundary(group, (lambda: save(epoch, k + 1, dict(sums))) if checkpoint_dir else None)
            if stop:
                break

        # end of epoch: exact evaluation across ranks
        train_loss = sums["loss_x_rows"] / sums["rows"] if sums["rows"] else float("nan")
        train_eval_loss = train_acc = val_loss = val_acc = None
        if eval_train:
            train_eval_loss, train_acc = await evaluate(strategy, data.x_train, data.y_train, group=group,
                                                        batch_size=eval_batch_size)
        if len(data.x_val):
            val_loss, val_acc = await evaluate(strategy, data.x_val, data.y_val, group=group,
                                               batch_size=eval_batch_size)
        stats = EpochStats(
            epoch=epoch, steps=steps_run, train_loss=train_loss, train_acc=train_acc,
            val_loss=val_loss, val_acc=val_acc,
            samples_per_s=sums["rows"] / sums["train_time_s"] if sums["train_time_s"] > 0 else 0.0,
            effective_batch_size=global_batch_size * accum, train_time_s=sums["train_time_s"],
            epoch_time_s=0.0, skipped_steps=sums["skipped"], train_eval_loss=train_eval_loss)
        history.epochs.append(stats)
        state.epoch_stats = stats
        if await _run_callbacks(epoch_callbacks, "on_epoch_end", state, group):
            stop = True
        if checkpoint_dir:
            complete = state.step_in_epoch >= steps_total
            # a finished epoch resumes at the next one; a stopped one where it stopped
            next_pos = (epoch + 1, 0) if complete else (epoch, state.step_in_epoch)
            if complete:
                await save(*next_pos, _fresh_sums())
            else:  # an early stop mid-epoch: this epoch's stats are provisional, do not keep them
                history.epochs.pop()
                await save(*next_pos, dict(sums))
                history.epochs.append(stats)
        stats.epoch_time_s = time.perf_counter() - epoch_start
        progress.epoch_end(epochs, stats)
        if stop:
            history.stopped_early = True
            progress.log(f"stopped early after epoch {epoch + 1} (step {state.step})")
            break

    history.ranks = await _gather_rank_stats(strategy, group, comm_bytes, timings, history.steps)
    if print_summary and rank == 0:
        stream = summary_stream or sys.stdout
        stream.write(format_summary(history) + "\n")
        stream.flush()
    return history


async def _gather_rank_stats(strategy: Strategy, group, comm_bytes: int, timings: dict,
                             steps: int) -> list[RankStats]:
    """Every rank's memory, traffic and timings, on every rank (one all-reduce of an (R, 10) table)."""
    rank, size = _rank_size(group)
    mem = strategy.memory_bytes()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    table = np.zeros((size, 10), dtype=np.float64)  # float64 holds integers exactly below 2**53
    table[rank] = (mem.get("params", 0), mem.get("grads", 0), mem.get("optim", 0), mem.get("gathered_peak", 0),
                   maxrss, comm_bytes, timings["compute_s"], timings["comm_s"], timings["exposed_comm_s"], steps)
    await _sum(group, table)
    return [RankStats(rank=r, params_bytes=int(t[0]), grads_bytes=int(t[1]), optim_bytes=int(t[2]),
                      gathered_peak_bytes=int(t[3]), maxrss_bytes=int(t[4]), comm_bytes=int(t[5]),
                      compute_s=float(t[6]), comm_s=float(t[7]), exposed_comm_s=float(t[8]), steps=int(t[9]))
            for r, t in enumerate(table)]


# ---- checkpoints (trainer.checkpoint does the files; the loop adds its position) ----


async def _save_checkpoint(directory: str, strategy: Strategy, group, meta: dict, keep_last: int) -> None:
    from trainer import checkpoint

    await checkpoint.save(strategy, directory, extra={"loop": meta}, keep_last=keep_last)


async def _load_checkpoint(directory: str, strategy: Strategy, group, run: dict) -> dict | None:
    """Loads the newest checkpoint that loads on every rank into `strategy` (an older one when the
    newest is damaged: trainer.checkpoint.load_newest_valid); returns the loop's position, or None
    if there is none.

    Raises:
        ValueError: the checkpoint was not written by `fit`, or by a run whose batching
            (data size, global batch, accumulation, seed) differs, so skipping the
            consumed batches would not continue the same run.
    """
    from trainer import checkpoint

    meta = await checkpoint.load_newest_valid(strategy, directory)  # a damaged newest: the one before
    if meta is None:
        return None
    loop = (meta.get("extra") or {}).get("loop")
    if loop is None:
        raise ValueError(f"{meta['path']} was not written by trainer.loop.fit (no loop position in its "
                         f"metadata); cannot resume from it")
    if loop.get("run") != run:
        raise ValueError(f"{meta['path']} was saved by a run with batching {loop.get('run')}, this run has {run}; "
                         f"resuming would not continue the same data order")
    if int(meta["step"]) != int(loop["step"]):
        raise ValueError(f"{meta['path']}: strategy step {meta['step']} != loop step {loop['step']}")
    return loop


# ---- summary -----------------------------------------------------------------


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def format_summary(history: History) -> str:
    """The end-of-run report: accuracy, throughput, traffic and per-rank memory."""
    lines = [f"== {history.strategy} on {history.world_size} rank(s): {len(history.epochs)} epoch(s), "
             f"{history.steps} steps this run" + (" (stopped early)" if history.stopped_early else "")]
    final = history.final
    if final is not None:
        if final.val_acc is not None:
            lines.append(f"validation accuracy {final.val_acc:.4f}  loss {final.val_loss:.4f}")
        if final.train_acc is not None:
            lines.append(f"training accuracy   {final.train_acc:.4f}  loss {final.train_eval_loss:.4f}")
    lines.append(f"throughput          {history.samples_per_s:,.0f} samples/s "
                 f"({history.samples} samples in {history.train_time_s:.2f} s of training)")
    lines.append(f"communicated        {format_bytes(history.comm_bytes)} sent by all ranks")
    if history.ranks:
        lines.append("rank      params       grads       optim   gathered peak   sent         max RSS")
        for r in history.ranks:
            lines.append(f"{r.rank:>4} {format_bytes(r.params_bytes):>11} {format_bytes(r.grads_bytes):>11} "
                         f"{format_bytes(r.optim_bytes):>11} {format_bytes(r.gathered_peak_bytes):>15} "
                         f"{format_bytes(r.comm_bytes):>11} {format_bytes(r.maxrss_bytes):>15}")
    return "\n".join(lines)
