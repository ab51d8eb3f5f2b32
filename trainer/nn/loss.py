"""Softmax cross-entropy with an explicit denominator, forward and backward side by side.

What it is: the loss of a classifier head. The loss is a SUM over the local rows
divided by `denominator`, which defaults to the local batch size (plain mean).
A rank holding B_local of B_global samples passes `denominator=B_global`; then

    sum over ranks of loss_r            == mean loss over the global batch
    sum over ranks of d loss_r / d theta == gradient of the global-batch mean

exactly (up to summation order), which is what makes data-parallel training
match single-process training to ~1e-12 in float64. Gradient reduction must
therefore SUM, not average.

What it is not: no label smoothing, no ignore-index, no class weights.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cross_entropy_forward", "cross_entropy_backward", "softmax_cross_entropy"]


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
