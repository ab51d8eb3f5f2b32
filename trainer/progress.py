"""What rank 0 shows while `trainer.loop.fit` runs: a progress bar on a terminal, plain lines in a log.

What it is: `Progress`, fed one `StepMetrics` per optimizer step and one `EpochStats` per epoch.
On a terminal (``stream.isatty()``) it redraws one bar, at most ten times a second; elsewhere (a
log file, the launcher's pipe) it writes a line every `log_every` steps and at the epoch's last::

    epoch 2/5 step 10/23 loss 0.1639 lr 7.04e-04 grad norm 0.725 | 25,397 samples/s | ETA 0:04
    epoch 1/1 step 10/20 loss 3.8708 lr 2.00e-03 grad norm 1.89 scale 65536 | 2,840 tokens/s | ETA 0:14

The rate is the epoch's so far (tokens/s where a sample is a window of tokens, trainer/text.py);
grad norm, when the strategy reports one, is the global norm before clipping; scale is the loss
scale, shown only where dynamic loss scaling is on; the ETA extrapolates this call's steps per
second (evaluation and checkpoints included) over the steps left of every epoch. `log` writes a
message (a checkpoint saved or loaded), ending the bar's line first.

What it is not: no metrics files (trainer/metrics.py), no collectives, no other rank's output.
"""

from __future__ import annotations

import math
import time

from trainer.history import EpochStats
from trainer.metrics import StepMetrics

__all__ = ["Progress", "format_eta"]


def format_eta(seconds: float) -> str:
    """62 -> '1:02', 3723 -> '1:02:03'; '?' when not known."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    hours, rest = divmod(s, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _rate(value: float, unit: str) -> str:
    return f"{value:,.0f} {unit}/s"


class Progress:
    """Rank 0's progress on ``stream`` (the module docstring); ``enabled=False`` (other ranks) is silent."""

    def __init__(self, stream, enabled: bool, log_every: int, *, unit: str = "samples") -> None:
        self.stream, self.enabled, self.log_every, self.unit = stream, enabled, max(0, log_every), unit
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self._last_draw = 0.0
        self._bar_open = False  # a bar is drawn on the current line
        self._t0 = time.monotonic()
        self._done = 0  # steps this call

    def eta_s(self, steps_left: int) -> float:
        """Seconds for ``steps_left`` more steps at this call's pace so far (inf before the first)."""
        elapsed = time.monotonic() - self._t0
        return steps_left * elapsed / self._done if self._done else math.inf

    def _fields(self, m: StepMetrics, rate: float) -> str:
        parts = [f"loss {m.loss:.4f}"]
        if m.lr is not None:
            parts.append(f"lr {m.lr:.2e}")
        if m.grad_norm is not None:
            parts.append(f"grad norm {m.grad_norm:.3g}")
        if m.loss_scale is not None:
            parts.append(f"scale {m.loss_scale:g}")
        if m.skipped:
            parts.append("(skipped)")
        return " ".join(parts) + f" | {_rate(rate, self.unit)}"

    def step(self, m: StepMetrics, *, epochs: int, steps: int, rate: float, steps_left: int) -> None:
        """Step ``m.step_in_epoch`` of ``steps`` done; ``rate``: the epoch's samples (tokens) per second."""
        self._done += 1
        if not self.enabled:
            return
        k = m.step_in_epoch
        eta = f" | ETA {format_eta(self.eta_s(steps_left))}"
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < 0.1 and k != steps:
                return
            self._last_draw = now
            width = 24
            done = int(width * k / max(1, steps))
            bar = "#" * done + "." * (width - done)
            self.stream.write(f"\r\033[Kepoch {m.epoch + 1}/{epochs} [{bar}] {k}/{steps} {self._fields(m, rate)}{eta}")
            self._bar_open = True
            self.stream.flush()
        elif self.log_every and (k % self.log_every == 0 or k == steps):
            self.stream.write(f"epoch {m.epoch + 1}/{epochs} step {k}/{steps} {self._fields(m, rate)}{eta}\n")
            self.stream.flush()

    def _end_bar(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False

    def epoch_end(self, epochs: int, s: EpochStats) -> None:
        if not self.enabled:
            return
        self._end_bar()
        parts = [f"epoch {s.epoch + 1}/{epochs}: train loss {s.train_loss:.4f}"]
        if s.train_acc is not None:
            parts.append(f"acc {s.train_acc:.4f}")
        if s.val_loss is not None:
            parts.append(f"| val loss {s.val_loss:.4f}")
            if s.val_acc is not None:
                parts.append(f"acc {s.val_acc:.4f}")
            if s.val_bits_per_byte is not None:
                parts.append(f"({s.val_bits_per_byte:.3f} bits per byte)")
        rate = s.tokens_per_s if s.tokens_per_s is not None else s.samples_per_s
        parts.append(f"| {_rate(rate, self.unit)}, batch {s.effective_batch_size}, {s.epoch_time_s:.2f} s")
        if s.skipped_steps:
            parts.append(f"({s.skipped_steps} steps skipped)")
        self.stream.write(" ".join(parts) + "\n")
        self.stream.flush()

    def log(self, message: str) -> None:
        if self.enabled:
            self._end_bar()
            self.stream.write(message + "\n")
            self.stream.flush()
