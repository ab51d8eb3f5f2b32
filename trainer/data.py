"""Data: the distributed sampler, global/local batching, the digits set and synthetic data.

What it is:

* `epoch_order(n, seed=, epoch=)`: the epoch's permutation of 0..n-1, a pure function of (seed,
  epoch), the same on every process.
* `iter_local_batches`: this rank's contiguous block of every global batch of the epoch, so that
  the blocks of ranks 0..R-1 concatenated are the global batch row for row, nothing padded or
  repeated (a rank may get an empty block of a short last batch); with R = 1 this is exactly the
  single-process run. The data-parallel equivalence rests on it. `local_batches_from` is the same
  from a step boundary of the epoch at any world size (`repartition`: every rank's share), so a job
  that shrinks or grows between steps sees each sample once, in the same global batch.
* `DistributedSampler`: torch.utils.data.DistributedSampler's semantics (padded or cut to equal
  lengths; NumPy's permutation, so not torch's indices bit for bit), for evaluation or anything that
  need not equal a single-process run.
* Data sets, what `trainer.loop.fit` reads: anything with `len(ds)` samples and
  `ds.get(indices, epoch) -> (x, y)`; `ArrayDataset(x, y)`, and a split of two (`Split`,
  `trainer.text.TextSplit`).
* `load_digits_split` (sklearn's 8x8 digits, shipped with scikit-learn, no download: the
  `trainer` extra, a one-line MissingExtra without it) and
  `make_synthetic` (Gaussian class clusters of any size).

    for b in iter_local_batches(len(ds), 64, world, rank, seed=0, epoch=e):   # LocalBatch
        x, y = ds.get(b.indices, e)          # b.offset, b.global_size: the block's place in the batch

What it is not: no loader threads, no prefetching, no file formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from trainer.extras import need

__all__ = [
    "epoch_order", "DistributedSampler", "split_bounds", "num_global_batches", "LocalBatch",
    "iter_local_batches", "local_batches_from", "repartition", "epoch_position", "ArrayDataset", "Split", "train_val_split", "load_digits_split", "make_synthetic",
]


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Permutation of range(n) for this epoch (int64), from (seed, epoch) only."""
    if n < 0:
        raise ValueError(f"data set size must be >= 0, got {n}")
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])))
    return rng.permutation(n).astype(np.int64)


class DistributedSampler:
    """Indices of one rank, torch semantics: same length on every rank, disjoint when n % R == 0.

    Ranks take the order with stride num_replicas; without drop_last the order is padded by
    repeating its head so every rank has ceil(n / R) samples; with drop_last the tail is cut so
    every rank has floor(n / R)."""

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got rank={rank} of {num_replicas}")
        if n < 0:
            raise ValueError(f"data set size must be >= 0, got {n}")
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)  # == n // R
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle: the next iteration uses the permutation for `epoch`."""
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        order = epoch_order(self.n, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)  # (n,)
        if self.drop_last:
            order = order[: self.total_size]
        elif self.total_size > self.n:
            if self.n == 0:
                raise ValueError("cannot pad an empty data set to a positive length")
            reps = math.ceil((self.total_size - self.n) / self.n)
            order = np.concatenate([order, np.tile(order, reps)[: self.total_size - self.n]])
        return order[self.rank : self.total_size : self.num_replicas]  # (num_samples,)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples


def split_bounds(size: int, num_replicas: int) -> list[int]:
    """Row bounds of each rank's block, np.array_split sizes: split_bounds(10, 4) == [0, 3, 6, 8, 10]."""
    q, rem = divmod(size, num_replicas)
    bounds = [0]
    for r in range(num_replicas):
        bounds.append(bounds[-1] + q + (1 if r < rem else 0))
    return bounds


def num_global_batches(n: int, global_batch_size: int, drop_last: bool = False) -> int:
    return n // global_batch_size if drop_last else math.ceil(n / global_batch_size)


@dataclass(frozen=True)
class LocalBatch:
    step: int  # index of the global batch within the epoch, e.g. 3
    indices: np.ndarray  # (b_local,) data set rows held by this rank
    offset: int  # first row of this rank inside the global batch, e.g. 64
    global_size: int  # rows in the global batch (the loss denominator), e.g. 128


def iter_local_batches(n: int, global_batch_size: int, num_replicas: int = 1, rank: int = 0, *,
                       seed: int = 0, epoch: int = 0, shuffle: bool = True,
                       drop_last: bool = False) -> Iterator[LocalBatch]:
    """This rank's block of every global batch of the epoch, in this order::

        order   = epoch_order(n, seed, epoch, shuffle)           # (n,)
        global batch k = order[k G : (k + 1) G]                  # G = global_batch_size
                         (the last one is shorter unless drop_last)
        rank r's local batch k = global_batch_k[bounds[r] : bounds[r + 1]]
        bounds = split_bounds(len(global_batch_k), R)            # np.array_split sizes:
                                                                # the first (size % R) ranks hold one more

    Each `LocalBatch` carries `offset` (= bounds[r], for `Context.batch_offset`, which keeps
    dropout masks equal) and `global_size` (for `loss_denominator`). A rank gets an EMPTY local
    batch when the last global batch has fewer rows than ranks; the model handles that."""
    yield from local_batches_from(epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle), 0, global_batch_size,
                                  num_replicas, rank, drop_last=drop_last)


def local_batches_from(order: np.ndarray, consumed: int, global_batch_size: int, num_replicas: int = 1,
                       rank: int = 0, *, drop_last: bool = False) -> Iterator[LocalBatch]:
    """`iter_local_batches` of the epoch's ``order`` from where committed steps left it: after
    ``consumed`` samples (a whole number of global batches, steps being all or nothing; or the
    whole epoch). The global batches do not depend on the world size, so a job that shrinks or
    grows between two steps sees each sample of the epoch exactly once, at the same place of the
    same global batch as an undisturbed run; only the blocks (and their sizes) change.

    Raises:
        ValueError: ``consumed`` is not a step boundary of the epoch, or the arguments are out of range.
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got rank={rank} of {num_replicas}")
    steps = num_global_batches(len(order), global_batch_size, drop_last)
    end = min(len(order), steps * global_batch_size)  # the samples the epoch's steps use
    if not (0 <= consumed <= end and (consumed % global_batch_size == 0 or consumed == end)):
        raise ValueError(f"{consumed} samples consumed is no step boundary of an epoch of {len(order)} samples "
                         f"in global batches of {global_batch_size} (0, {global_batch_size}, ... or {end})")
    for k in range(-(-consumed // global_batch_size), steps):
        batch = order[k * global_batch_size : min(end, (k + 1) * global_batch_size)]  # (G,) or shorter at the end
        bounds = split_bounds(len(batch), num_replicas)
        lo, hi = bounds[rank], bounds[rank + 1]
        yield LocalBatch(step=k, indices=batch[lo:hi], offset=lo, global_size=len(batch))


def repartition(order: np.ndarray, consumed: int, global_batch_size: int, num_replicas: int, *,
                drop_last: bool = False) -> list[list[np.ndarray]]:
    """Every rank's sample indices for each step still to come in the epoch (``[step][rank]``), the
    new world size's share of what `local_batches_from` leaves: what a job that changed size holds."""
    per_rank = [list(local_batches_from(order, consumed, global_batch_size, num_replicas, r, drop_last=drop_last))
                for r in range(num_replicas)]
    return [[per_rank[r][j].indices for r in range(num_replicas)] for j in range(len(per_rank[0]))]


def epoch_position(step: int, n: int, global_batch_size: int, drop_last: bool = False) -> tuple[int, int]:
    """(epoch, samples consumed in it) after ``step`` committed steps of a run over ``n`` samples
    with a fixed global batch: where a member that joins at ``step`` starts reading."""
    per_epoch = num_global_batches(n, global_batch_size, drop_last)
    if step < 0 or per_epoch < 1:
        raise ValueError(f"need step >= 0 and at least one step per epoch, got step {step}, {per_epoch} per epoch")
    epoch, k = divmod(step, per_epoch)
    return epoch, k * global_batch_size


# ---- data sets ---------------------------------------------------------------


class ArrayDataset:
    """Sample k is (x[k], y[k]): rows of two arrays of one length (y: labels, targets, anything)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        if len(x) != len(y):
            raise ValueError(f"x and y must have one length, got {len(x)} and {len(y)}")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def get(self, indices: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The rows `indices` (any epoch: the samples do not change)."""
        return self.x[indices], self.y[indices]


@dataclass(frozen=True)
class Split:
    x_train: np.ndarray  # (N_train, D)
    y_train: np.ndarray  # (N_train,) int64 labels, or (N_train, ...) float targets
    x_val: np.ndarray  # (N_val, D)
    y_val: np.ndarray  # (N_val,) like y_train
    num_classes: int  # e.g. 10 (0 for regression)

    @property
    def in_dim(self) -> int:
        return self.x_train.shape[1]

    @property
    def train(self) -> ArrayDataset:
        return ArrayDataset(self.x_train, self.y_train)

    @property
    def val(self) -> ArrayDataset:
        return ArrayDataset(self.x_val, self.y_val)


def train_val_split(x: np.ndarray, y: np.ndarray, *, val_fraction: float, seed: int,
                    num_classes: int, standardize: bool = True, dtype=np.float32) -> Split:
    """Shuffle by seed, cut off the validation part, standardize with TRAIN mean/std."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), 0xDA7A]))).permutation(len(x))
    n_val = int(round(len(x) * val_fraction))
    val, train = perm[:n_val], perm[n_val:]
    x = np.asarray(x, dtype=np.float64)
    x_train, x_val = x[train], x[val]
    if standardize:
        mean = x_train.mean(axis=0)  # (D,)
        std = x_train.std(axis=0)  # (D,)
        std[std == 0] = 1.0  # constant features (the digits' corner pixels) stay at zero
        x_train, x_val = (x_train - mean) / std, (x_val - mean) / std
    y = np.asarray(y, dtype=np.int64)
    return Split(x_train.astype(dtype), y[train], x_val.astype(dtype), y[val], num_classes)


def load_digits_split(*, seed: int = 0, val_fraction: float = 0.2, dtype=np.float32) -> Split:
    """sklearn digits: 1797 samples of 64 features, 10 classes; 360 validation rows by default."""
    # local: scikit-learn is slow to import, only this needs it, and it is the trainer extra's
    datasets = need("sklearn.datasets", package="scikit-learn", extra="trainer", what="the digits data set")
    digits = datasets.load_digits()
    return train_val_split(digits.data, digits.target, val_fraction=val_fraction, seed=seed,
                           num_classes=10, dtype=dtype)


def make_synthetic(n: int, in_dim: int = 64, num_classes: int = 10, *, seed: int = 0,
                   class_sep: float = 0.5, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters: x = center[y] + N(0, I), centers ~ class_sep N(0, I).

    Returns x (n, in_dim) of `dtype` and y (n,) int64. Memory is n * in_dim
    elements of `dtype`, generated in chunks, so large sets fit as long as x does.
    """
    if n < 0 or in_dim < 1 or num_classes < 1:
        raise ValueError(f"need n >= 0, in_dim >= 1, num_classes >= 1, got {n}, {in_dim}, {num_classes}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), 0x5E7])))
    centers = (class_sep * rng.standard_normal((num_classes, in_dim))).astype(dtype)  # (K, D)
    y = rng.integers(0, num_classes, size=n, dtype=np.int64)  # (n,)
    x = np.empty((n, in_dim), dtype=dtype)
    chunk = max(1, (1 << 22) // in_dim)  # ~4M elements per chunk
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        x[lo:hi] = rng.standard_normal((hi - lo, in_dim)).astype(dtype) + centers[y[lo:hi]]
    return x, y
