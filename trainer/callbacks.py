"""Callbacks of the training loop: what they see (`LoopState`) and the two built in.

What it is: `fit` calls `on_step_end(state)` after every optimizer step and
`on_epoch_end(state)` after every epoch's evaluation, on every rank with the same
(agreed) numbers; a callback sets `state.stop_training = True` to stop, and the
loop ORs that flag across ranks before acting on it. `EarlyStopping` watches a
metric for `patience` epochs; `StopAtAccuracy` stops at a validation accuracy.

What it is not: no logging callbacks (the loop logs), no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.history import EpochStats, History
from trainer.sharding.base import StepResult, Strategy

__all__ = ["LoopState", "Callback", "EarlyStopping", "StopAtAccuracy"]


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
