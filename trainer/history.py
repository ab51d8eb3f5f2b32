"""What a training run reports: per-epoch statistics, per-rank figures, the history and its summary.

What it is: the plain records `trainer.loop.fit` fills and returns (`EpochStats`,
`RankStats`, `History`), and `format_summary`, the report rank 0 prints at the end
(validation figures, throughput, traffic, and per rank the ZeRO memory of
parameters, gradients and optimizer state, the gathered and activation peaks and
the process's maximum RSS).

What it is not: no collectives, no logging, no training.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

__all__ = ["EpochStats", "RankStats", "History", "format_summary", "format_bytes"]


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
    val_metrics: dict = field(default_factory=dict)  # every metric of the loss, means over the validation set
    val_bits_per_byte: float | None = None  # val_loss / ln 2 / bytes per token, for text (None otherwise)
    tokens_per_s: float | None = None  # samples_per_s x tokens per sample, for text windows (None otherwise)

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
    activations_peak_bytes: int = 0  # strategy.memory_bytes()["activations_peak"]
    coords: dict | None = None  # mesh coordinates, e.g. {"pp": 1, "dp": 0, "tp": 1} (None: no mesh)
    sent_by_dim: dict = field(default_factory=dict)  # bytes sent per mesh dimension, e.g. {"dp": 0, "tp": 4096, ...}
    bubble_s: float = 0.0  # time blocked on pipeline receives (the measured bubble, transfers included)
    pipeline_s: float = 0.0  # time in the pipeline schedules
    bubble_formula: float = 0.0  # (pp - 1) / (m + pp - 1) of the last step
    in_flight_peak: int = 0  # most micro-batches of activations held at once (last step)
    resident_bytes: int = 0  # params + grads + optimizer state in memory (offload: what is not on disk)
    offloaded_bytes: int = 0  # optimizer state and master weights in memory-mapped files

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.pipeline_s if self.pipeline_s > 0 else 0.0


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
    tokens_per_sample: int | None = None  # a text window's tokens, e.g. 64 (None: samples are not token windows)
    best: dict | None = None  # save_best: {"metric", "mode", "value", "step", "path"} of the best checkpoint

    @property
    def comm_bytes(self) -> int:
        """Bytes sent by all ranks together during training."""
        return sum(r.comm_bytes for r in self.ranks)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_time_s if self.train_time_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None

    @property
    def final(self) -> EpochStats | None:
        return self.epochs[-1] if self.epochs else None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(comm_bytes=self.comm_bytes, samples_per_s=self.samples_per_s, tokens_per_s=self.tokens_per_s)
        return out


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_summary(history: History) -> str:
    """The end-of-run report: validation figures, throughput, traffic and per-rank memory."""
    lines = [f"== {history.strategy} on {history.world_size} rank(s): {len(history.epochs)} epoch(s), "
             f"{history.steps} steps this run" + (" (stopped early)" if history.stopped_early else "")]
    final = history.final
    if final is not None:
        if final.val_loss is not None:
            line = (f"validation accuracy {_fmt(final.val_acc)}  loss {_fmt(final.val_loss)}"
                    if final.val_acc is not None else f"validation loss     {_fmt(final.val_loss)}")
            if final.val_bits_per_byte is not None:
                line += f"  ({_fmt(final.val_bits_per_byte, '.3f')} bits per byte)"
            lines.append(line)
        if final.train_eval_loss is not None:
            lines.append(f"training accuracy   {_fmt(final.train_acc)}  loss {_fmt(final.train_eval_loss)}"
                         if final.train_acc is not None else f"training loss       {_fmt(final.train_eval_loss)}")
    if history.tokens_per_s is not None:
        lines.append(f"throughput          {history.tokens_per_s:,.0f} tokens/s ({history.samples_per_s:,.0f} samples/s"
                     f" of {history.tokens_per_sample} tokens; {history.samples} samples in "
                     f"{history.train_time_s:.2f} s of training)")
    else:
        lines.append(f"throughput          {history.samples_per_s:,.0f} samples/s "
                     f"({history.samples} samples in {history.train_time_s:.2f} s of training)")
    if history.best is not None:
        b = history.best
        lines.append(f"best checkpoint     {b['path']} ({b['metric']} {_fmt(b['value'])} at step {b['step']})")
    lines.append(f"communicated        {format_bytes(history.comm_bytes)} sent by all ranks")
    if history.ranks:
        lines.append("rank      params       grads       optim   gathered peak  activations peak"
                     "        sent         max RSS")
        for r in history.ranks:
            lines.append(f"{r.rank:>4} {format_bytes(r.params_bytes):>11} {format_bytes(r.grads_bytes):>11} "
                         f"{format_bytes(r.optim_bytes):>11} {format_bytes(r.gathered_peak_bytes):>15} "
                         f"{format_bytes(r.activations_peak_bytes):>17} "
                         f"{format_bytes(r.comm_bytes):>11} {format_bytes(r.maxrss_bytes):>15}")
        if any(r.coords for r in history.ranks):
            lines.append("rank  pp  dp  tp     sent dp     sent tp     sent pp  in flight  "
                         "bubble measured / (p-1)/(m+p-1)")
            for r in history.ranks:
                c = r.coords or {"pp": 0, "dp": 0, "tp": 0}
                lines.append(f"{r.rank:>4} {c['pp']:>3} {c['dp']:>3} {c['tp']:>3} "
                             + " ".join(f"{format_bytes(r.sent_by_dim.get(d, 0)):>11}" for d in ("dp", "tp", "pp"))
                             + f" {r.in_flight_peak:>10}   {r.bubble_fraction:>8.3f} / {r.bubble_formula:.3f}")
        if any(r.offloaded_bytes for r in history.ranks):
            lines.append("rank    resident   offloaded   (params + grads + optimizer state: in memory / on disk)")
            for r in history.ranks:
                lines.append(f"{r.rank:>4} {format_bytes(r.resident_bytes):>11} {format_bytes(r.offloaded_bytes):>11}")
    return "\n".join(lines)
