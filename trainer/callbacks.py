"""Callbacks of the training loop: what they see (`LoopState`) and the two built in.

What it is: `fit` calls `on_step_end(state)` after every optimizer step and
`on_epoch_end(state)` after every epoch's evaluation, on every rank with the same
(agreed) numbers; a callback sets `state.stop_training = True` to stop, and the
loop ORs that flag across ranks before acting on it. `EarlyStopping` watches a
metric for `patience` epochs; `StopAtAccuracy` stops at a validation accuracy. `Best` keeps
the best value of a metric, minimised or maximised by its kind (`metric_mode`: accuracies up,
everything else, losses and bits per byte, down); EarlyStopping and the loop's `save_best` use it.

What it is not: no logging callbacks (the loop logs), no collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.history import EpochStats, History
from trainer.metrics import StepMetrics
from trainer.sharding.base import StepResult, Strategy

__all__ = ["LoopState", "Callback", "EarlyStopping", "StopAtAccuracy", "Best", "metric_mode", "epoch_metric",
           "EPOCH_METRICS"]

# the EpochStats fields a callback or `save_best` may watch
EPOCH_METRICS = ("val_loss", "val_acc", "train_loss", "train_acc", "train_eval_loss", "val_bits_per_byte")


def metric_mode(name: str) -> str:
    """"max" for an accuracy (a name ending in "acc" or "accuracy"), "min" for any other metric."""
    return "max" if name.endswith(("acc", "accuracy")) else "min"


class Best:
    """The best value of metric ``name`` seen so far, and at which step (``metric_mode`` says which
    way is better); a value improves on it by more than ``min_delta``. NaN never improves."""

    def __init__(self, name: str, min_delta: float = 0.0) -> None:
        self.name, self.mode, self.min_delta = name, metric_mode(name), min_delta
        self.value: float | None = None
        self.step: int | None = None

    def improves(self, value: float) -> bool:
        if value is None or math.isnan(value):
            return False
        if self.value is None:
            return True
        return value < self.value - self.min_delta if self.mode == "min" else value > self.value + self.min_delta

    def update(self, value: float, step: int | None = None) -> bool:
        """Takes ``value`` if it improves; returns whether it did."""
        if not self.improves(value):
            return False
        self.value, self.step = float(value), step
        return True

    def as_dict(self) -> dict:
        return {"metric": self.name, "mode": self.mode, "value": self.value, "step": self.step}


def epoch_metric(stats: EpochStats, name: str, who: str) -> float:
    """The value of field ``name`` of an epoch's stats; ValueError when this run does not compute it."""
    value = getattr(stats, name, None)
    if value is None:
        raise ValueError(f"{who} watches {name!r}, which this run does not compute (its metrics: "
                         f"{', '.join(n for n in EPOCH_METRICS if getattr(stats, n, None) is not None)})")
    return value


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
    metrics: StepMetrics | None = None  # the last step's loss, lr, grad norm, throughput (on_step_end)
    stop_training: bool = False


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
    `min_delta` for `patience` epochs (accuracies must rise, other metrics fall: `metric_mode`)."""

    def __init__(self, monitor: str = "val_loss", patience: int = 2, min_delta: float = 0.0) -> None:
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.best = Best(monitor, min_delta)
        self.bad_epochs = 0

    def on_epoch_end(self, state: LoopState) -> None:
        if self.best.update(epoch_metric(state.epoch_stats, self.monitor, "EarlyStopping")):
            self.bad_epochs = 0
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
