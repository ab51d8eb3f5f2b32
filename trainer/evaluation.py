"""Exact evaluation across ranks, and the group functions the training loop shares with it.

What it is: `evaluate(strategy, data)`, the mean of every metric of the strategy's loss over all
samples of a data set, each rank a contiguous shard of it (nothing padded or repeated, the sums
all-reduced), so the answer is the single-process one at any world size; and `rank_size`,
`sum_over`, `default_group`, which let `trainer.loop` run in one process without a group.

    metrics = await evaluate(strategy, split.val, group=world)   # {"loss": 0.06, "accuracy": 0.98}

What it is not: no training, no data loading beyond `dataset.get`, no metrics of its own (the
loss's `metrics` are the ones reported).
"""

from __future__ import annotations

import math

import numpy as np

from trainer.data import split_bounds
from trainer.sharding.base import Strategy

__all__ = ["evaluate", "rank_size", "sum_over", "default_group"]


# ---- the group: rank, size, sums ---------------------------------------------


def rank_size(group) -> tuple[int, int]:
    return (0, 1) if group is None else (group.rank, group.size)


async def sum_over(group, x: np.ndarray) -> np.ndarray:
    """Element-wise sum of `x` over the ranks of `group`, in place (nothing to do alone)."""
    if group is not None and group.size > 1:
        import collectives  # local: the loop runs single-process without the collectives package

        await collectives.all_reduce(x, op="sum", group=group)
    return x


def default_group(strategy: Strategy):
    group = getattr(strategy, "group", None)
    if group is not None:
        return group
    try:
        import runtime

        return runtime.world()
    except Exception:  # no runtime: a single process
        return None


# ---- evaluation --------------------------------------------------------------


def _as_dataset(data, y=None):
    """A data set from a data set, or from (x, y) arrays."""
    if y is None:
        return data
    from trainer.data import ArrayDataset

    return ArrayDataset(data, y)


async def evaluate(strategy: Strategy, data, y: np.ndarray | None = None, *, group=None,
                   batch_size: int = 4096, epoch: int = 0) -> dict[str, float]:
    """Exact means of every metric of the strategy's loss over all samples of `data`, across ranks.

    `data` is a data set (`len`, `get(indices, epoch)`), or an x array with `y` beside it.
    Rank r evaluates samples split_bounds(n, R)[r] : [r + 1] in chunks of at most
    `batch_size`; every rank calls `strategy.evaluate` the same number of times (a rank
    with fewer samples passes an empty chunk), because under zero3/fsdp each call
    gathers parameters collectively. The sums of the metrics are all-reduced, so the
    answer is the single-process one, e.g. {"loss": 0.061, "accuracy": 0.983}. Every
    rank must pass the same data. Returns NaN for every metric when there are no samples.
    """
    dataset = _as_dataset(data, y)
    if group is None:  # a mesh strategy's data are split over its dp dimension (trainer/parallel)
        group = getattr(strategy, "data_group", None) or default_group(strategy)
    rank, size = rank_size(group)
    n = len(dataset)
    bounds = split_bounds(n, size)
    lo, hi = bounds[rank], bounds[rank + 1]
    chunks = max(1, math.ceil(math.ceil(n / size) / batch_size))  # same on every rank
    totals: dict[str, float] = {}
    for c in range(chunks):
        a, b = min(hi, lo + c * batch_size), min(hi, lo + (c + 1) * batch_size)
        x_part, y_part = dataset.get(np.arange(a, b), epoch)
        for key, value in (await strategy.evaluate(x_part, y_part)).items():
            totals[key] = totals.get(key, 0.0) + value
    keys = sorted(totals)  # the loss's metric names: the same on every rank
    vector = np.array([totals[k] for k in keys], dtype=np.float64)
    await sum_over(group, vector)
    return {k: (float(v / n) if n else float("nan")) for k, v in zip(keys, vector)}
