"""The tensor-parallel group as the layers see it: blocking calls from the compute thread, and parts.

What it is: `TPGroup`, what the tensor-parallel layers (tensor.py, vocab.py) talk through. The
model's forward and backward run on the strategy's compute thread (trainer/sharding/
accounted.py), so a layer that needs the sum of its partial results over the tp group
launches the collective on the event loop and blocks until it is done: a tensor-parallel
all-reduce sits on the critical path by nature (the next matmul needs its result), and the
time blocked is counted as exposed communication of the tp dimension. At tp = 1 every call
returns at once (the layers then equal the plain ones).

    tp = TPGroup(AccountedCollectives(mesh["tp"]))   # or TPGroup() alone
    tp.all_reduce(y)                                 # in place, sum over the tp group (y C-contiguous)
    tp.rank, tp.size                                 # this rank's tp coordinate and the tp size

`part(n, rank, size)` is the split every tensor-parallel dimension uses: contiguous, the
first n % size ranks one element more (np.array_split), e.g. 11 vocabulary rows over 4
ranks: [0, 3) [3, 6) [6, 9) [9, 11).

What it is not: no algorithm (collectives/ chooses it), no dtype casts.
"""

from __future__ import annotations

import numpy as np

from trainer.data import split_bounds

__all__ = ["TPGroup", "part"]


def part(n: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of rank ``rank``'s contiguous part of ``n`` items over ``size`` ranks (np.array_split)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need 0 <= rank < size, got rank={rank} size={size}")
    bounds = split_bounds(n, size)  # the data loader's split: one copy of the arithmetic
    return bounds[rank], bounds[rank + 1]


class TPGroup:
    """See the module docstring. ``accounted``: an AccountedCollectives over the tp group
    (None: a group of one)."""

    def __init__(self, accounted=None) -> None:
        self.acc = accounted
        self.size = 1 if accounted is None else accounted.size
        self.rank = 0 if accounted is None else accounted.rank
        self.calls = 0  # collectives run (tests count them against the formulas)

    @classmethod
    def shape_only(cls, rank: int, size: int) -> "TPGroup":
        """A TPGroup that knows a rank and a size and cannot communicate: builds another rank's
        layers to learn how they cut the parameters (checkpoints, full_params)."""
        tp = cls()
        tp.rank, tp.size = rank, size
        return tp

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"

    def all_reduce(self, x: np.ndarray, op: str = "sum") -> np.ndarray:
        """``x`` reduced over the tp group, in place (x must be C-contiguous and writeable); returns x."""
        if self.size == 1:
            return x
        if self.acc is None:
            raise RuntimeError(f"{self!r} describes a rank's layers and cannot communicate")
        if not x.flags.c_contiguous or not x.flags.writeable:
            raise ValueError(f"tensor-parallel all_reduce needs a C-contiguous writeable array, got {x.flags}")
        self.calls += 1
        self.acc.wait(self.acc.launch(self.acc.all_reduce(x, op)))
        return x
