"""Losses with an explicit denominator, forward and backward side by side, and their metrics.

What it is: the loss of a model's output. Every loss here is a SUM over the
local samples of a per-sample loss l_n, divided by `denominator`, which defaults
to the local batch size (plain mean). A rank holding B_local of B_global samples
passes `denominator=B_global`; then

    sum over ranks of loss_r            == mean loss over the global batch
    sum over ranks of d loss_r / d theta == gradient of the global-batch mean

exactly (up to summation order), which is what makes data-parallel training
match single-process training to ~1e-12 in float64. Gradient reduction must
therefore SUM, not average.

The loss objects (what a Model carries and a strategy calls; a caller may pass its own):

    loss.forward(out, target, denominator=None) -> (loss, cache)
    loss.backward(cache, dloss=1.0) -> dout                  # d loss / d out, times dloss
    loss.forward_backward(out, target, denominator, dloss) -> (loss, dout)
    loss.metrics(out, target) -> {"loss": sum_n l_n, ...}    # SUMS over samples (evaluation)

`CrossEntropyLoss`: out (N, K) with integer targets (N,), or (N, T, K) with (N, T)
(a language model: l_n is the mean over the T positions of sample n, so with equal
T the loss is the mean per token); metrics "loss" and "accuracy". `MSELoss`:
l_n = mean over the elements of sample n of (out - target)^2 (torch's MSELoss
when D = N); metric "loss". A metric is a sum of per-sample values, so the
loop divides by the number of samples after an all-reduce.

What it is not: no label smoothing, no ignore-index, no class weights.
"""

from __future__ import annotations

import numpy as np

from trainer.nn import layer_kernels

__all__ = ["cross_entropy_forward", "cross_entropy_backward", "softmax_cross_entropy", "Loss",
           "CrossEntropyLoss", "MSELoss"]


def _check(logits: np.ndarray, y: np.ndarray, denominator: float | None) -> float:
    if logits.ndim != 2:
        raise ValueError(f"logits must be (B, K), got shape {logits.shape}")
    if y.shape != (logits.shape[0],):
        raise ValueError(f"labels must be ({logits.shape[0]},) to match logits {logits.shape}, got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"labels must be integers, got dtype {y.dtype}")
    if y.size and (y.min() < 0 or y.max() >= logits.shape[1]):
        raise ValueError(f"labels must be in [0, {logits.shape[1]}), got range [{y.min()}, {y.max()}]")
    denom = logits.shape[0] if denominator is None else denominator
    if denom <= 0:
        raise ValueError(f"loss denominator must be > 0, got {denom} (empty batch needs an explicit one)")
    return float(denom)


def cross_entropy_forward(
    logits: np.ndarray, y: np.ndarray, denominator: float | None = None
) -> tuple[float, tuple]:
    """loss = -(1/D) sum_n log softmax(logits_n)[y_n].

    z = logits - max_k logits  (stability);  log p = z - log sum_k exp z
    Args: logits (B, K); y (B,) integer labels; D = denominator or B.
    Returns (loss as a Python float, cache for the backward).
    """
    denom = _check(logits, y, denominator)
    z = logits - logits.max(axis=1, keepdims=True)  # (B, K)
    e = np.exp(z)  # (B, K)
    sum_e = e.sum(axis=1, keepdims=True)  # (B, 1)
    logp_y = z[np.arange(len(y)), y] - np.log(sum_e[:, 0])  # (B,)
    loss = -float(logp_y.sum()) / denom
    return loss, (e / sum_e, y, denom)


def cross_entropy_backward(cache: tuple, dloss: float = 1.0) -> np.ndarray:
    """dlogits = dloss * (softmax(logits) - onehot(y)) / D, shape (B, K)."""
    probs, y, denom = cache
    dlogits = probs.copy()  # (B, K)
    dlogits[np.arange(len(y)), y] -= 1.0
    dlogits *= dloss / denom
    return dlogits


def softmax_cross_entropy(
    logits: np.ndarray, y: np.ndarray, denominator: float | None = None, dloss: float = 1.0
) -> tuple[float, np.ndarray]:
    """Both passes at once: returns (loss, dlogits)."""
    loss, cache = cross_entropy_forward(logits, y, denominator)
    return loss, cross_entropy_backward(cache, dloss)


# ---- loss objects -------------------------------------------------------------------


class Loss:
    """Base class of the loss objects (the protocol in the module docstring)."""

    metric_names: tuple[str, ...] = ("loss",)  # the keys `metrics` returns

    def forward(self, out: np.ndarray, target: np.ndarray, denominator: float | None = None) -> tuple[float, object]:
        raise NotImplementedError

    def backward(self, cache, dloss: float = 1.0) -> np.ndarray:
        raise NotImplementedError

    def forward_backward(self, out: np.ndarray, target: np.ndarray, denominator: float | None = None,
                         dloss: float = 1.0) -> tuple[float, np.ndarray]:
        loss, cache = self.forward(out, target, denominator)
        return loss, self.backward(cache, dloss)

    def metrics(self, out: np.ndarray, target: np.ndarray) -> dict[str, float]:
        """Sums over the samples of `out` (evaluation); at least "loss"."""
        loss, _ = self.forward(np.asarray(out, dtype=np.float64), target, 1.0)
        return {"loss": loss}


def _denominator(n: int, denominator: float | None) -> float:
    denom = n if denominator is None else denominator
    if denom <= 0:
        raise ValueError(f"loss denominator must be > 0, got {denom} (empty batch needs an explicit one)")
    return float(denom)


class CrossEntropyLoss(Loss):
    """Softmax cross-entropy over the last axis, per position for sequences.

    out (N, K), target (N,)       l_n = -log softmax(out_n)[y_n]
    out (N, T, K), target (N, T)  l_n = (1/T) sum_t -log softmax(out_nt)[y_nt]
    loss = sum_n l_n / D;  dout_nt = dloss (softmax(out_nt) - onehot(y_nt)) / (T D)

    kernel="fast": forward_backward runs trainer/nn/layer_kernels.py's (Numba passes around an
    in-place np.exp) for float32/float64 logits; "reference": the functions above. The
    metrics are computed in float64.
    """

    metric_names = ("loss", "accuracy")

    def __init__(self, kernel: str = "fast") -> None:
        if kernel not in ("fast", "reference"):
            raise ValueError(f"kernel must be 'fast' or 'reference', got {kernel!r}")
        self.kernel = kernel

    @staticmethod
    def _flatten(out: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(N*T, K) logits, (N*T,) labels and T (1 for a classifier)."""
        if out.ndim < 2 or target.shape != out.shape[:-1]:
            raise ValueError(f"CrossEntropyLoss needs out (N, [T,] K) and target (N, [T]) of the same leading "
                             f"shape, got out {out.shape} and target {target.shape}")
        positions = int(np.prod(out.shape[1:-1], dtype=np.int64))
        return out.reshape(-1, out.shape[-1]), target.reshape(-1), positions

    def forward(self, out, target, denominator=None):
        logits, y, T = self._flatten(out, target)
        denom = _denominator(out.shape[0], denominator)
        loss, cache = cross_entropy_forward(logits, y, denom * T)
        return loss, (cache, out.shape)

    def backward(self, cache, dloss=1.0):
        inner, shape = cache
        return cross_entropy_backward(inner, dloss).reshape(shape)

    def forward_backward(self, out, target, denominator=None, dloss=1.0):
        logits, y, T = self._flatten(out, target)
        if self.kernel != "fast" or not layer_kernels.use_fast(logits):
            return super().forward_backward(out, target, denominator, dloss)
        _check(logits, y, 1.0)
        denom = _denominator(out.shape[0], denominator) * T
        total, dlogits = layer_kernels.cross_entropy_forward_backward(logits, y, dloss / denom)  # (N*T, K)
        return total / denom, dlogits.reshape(out.shape)

    def metrics(self, out, target):
        logits, y, T = self._flatten(np.asarray(out, dtype=np.float64), target)
        if len(y) == 0:
            return {"loss": 0.0, "accuracy": 0.0}
        loss_sum, _ = cross_entropy_forward(logits, y, float(T))
        correct = float((logits.argmax(axis=1) == y).sum()) / T
        return {"loss": float(loss_sum), "accuracy": correct}


class MSELoss(Loss):
    """Mean squared error: l_n = mean over sample n's elements of (out - target)^2.

    out, target (N, ...) of one shape, E elements per sample
    loss = sum_n l_n / D;  dout = dloss 2 (out - target) / (E D)
    """

    def forward(self, out, target, denominator=None):
        if out.shape != target.shape:
            raise ValueError(f"MSELoss needs out and target of one shape, got {out.shape} and {target.shape}")
        denom = _denominator(out.shape[0], denominator)
        elements = int(np.prod(out.shape[1:], dtype=np.int64))
        diff = out - target  # (N, ...)
        loss = float(np.dot(diff.reshape(-1), diff.reshape(-1))) / (elements * denom)
        return loss, (diff, elements * denom)

    def backward(self, cache, dloss=1.0):
        diff, scale = cache
        return diff * (2.0 * dloss / scale)

    def metrics(self, out, target):
        if len(out) == 0:
            return {"loss": 0.0}
        return {"loss": self.forward(np.asarray(out, dtype=np.float64), np.asarray(target, np.float64), 1.0)[0]}
