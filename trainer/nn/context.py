"""Per-call context for the forward pass: training/eval mode and the dropout key.

What it is: a small frozen value passed to every `Unit.forward`. Dropout derives
its random stream only from `(seed, step, *stream)`, where `stream` names the
unit and the layer inside it, so masks never depend on global RNG state, on
which process computes them, or on how many calls came before.

`batch_offset` is the row of this process's first sample inside the GLOBAL batch
(see `trainer.data.iter_local_batches`). Dropout generates the mask rows for the
global batch up to `batch_offset + B_local` and keeps the last `B_local`, so a
data-parallel run with dropout sees exactly the masks of the single-process run.

What it is not: not a config object, and it holds no arrays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

__all__ = ["Context", "TRAIN", "EVAL"]


@dataclass(frozen=True)
class Context:
    training: bool = True  # dropout active iff True
    seed: int = 0  # dropout seed, e.g. 1234
    step: int = 0  # optimizer step, e.g. 17; part of the dropout key
    batch_offset: int = 0  # first global-batch row held by this process, e.g. 64

    def __post_init__(self) -> None:
        if self.seed < 0 or self.step < 0 or self.batch_offset < 0:
            raise ValueError(
                f"Context seed, step and batch_offset must be >= 0, got "
                f"seed={self.seed} step={self.step} batch_offset={self.batch_offset}"
            )

    def replace(self, **changes) -> "Context":
        """A copy with some fields changed, e.g. `ctx.replace(step=ctx.step + 1)`."""
        return dataclasses.replace(self, **changes)

    def rng(self, stream: tuple[int, ...]) -> np.random.Generator:
        """The generator for one (seed, step, stream); same on every process."""
        entropy = [int(self.seed), int(self.step), *(int(s) for s in stream)]
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


TRAIN = Context(training=True)
EVAL = Context(training=False)
