"""The contract every sharding strategy (ddp, zero1, zero2, zero3/fsdp) fulfils.

The loop (trainer/loop.py) and checkpoints (trainer/checkpoint.py) talk to a
strategy only through this class, so the same loop trains under every
strategy. A strategy owns the model's flat buffers (whole or sharded), the
optimizer state, the gradient communication and the loss scaler.

Life of a strategy (grammar)::

    Strategy(...) -> await setup() -> (await train_step(...) | await evaluate(...)
                  | await full_params() | state_dict() / load_state_dict())* -> end

All ranks of ``group`` call the async methods in the same order (they run
collectives). Not here: data loading, logging, checkpoint files.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = "ddp"             # ddp | zero1 | zero2 | zero3 | fsdp
    optimizer: str = "adamw"          # adamw | sgd
    lr: float = 2e-3                  # peak learning rate
    weight_decay: float = 0.01
    momentum: float = 0.9             # sgd only
    warmup_steps: int = 0
    total_steps: int = 1              # for the cosine schedule
    param_dtype: str = "float32"      # compute copy and its all-gather: float32 | float16 | bfloat16
    reduce_dtype: str = "float32"     # gradient communication dtype
    master_dtype: str = "float32"     # float32, or float64 for exactness tests
    grad_accum: int = 1               # micro-batches per optimizer step
    clip_norm: float | None = None    # global-norm gradient clipping
    compression: str | None = None    # codec name for gradient collectives (compression issue)
    bucket_cap_mb: float = 25.0       # ddp bucket size
    reshard_after_forward: bool = True  # fsdp/zero3; False keeps gathered params until backward
    prefetch: bool = True             # fsdp/zero3: gather the next unit while this one computes
    loss_scale: bool | None = None    # dynamic loss scaling (default: on for float16)
    seed: int = 0
    check_every: int = 0              # every N steps check replicated state is equal across ranks (0: never)


@dataclass
class StepResult:
    loss: float                       # mean loss over the global batch (all micro-batches)
    skipped: bool = False             # the step was skipped (inf/NaN gradients under loss scaling)
    grad_norm: float | None = None    # global gradient norm before clipping (when computed)
    comm_bytes: int = 0               # bytes this rank sent in this step
    timings: dict = field(default_factory=dict)  # compute_s, comm_s, exposed_comm_s


class Strategy(abc.ABC):
    """Args of every strategy: ``model`` (trainer.nn.Model built with
    ``pad_to=group.size``), ``config`` (TrainConfig), ``group`` (runtime
    ProcessGroup)."""

    name: str

    @abc.abstractmethod
    async def setup(self) -> None:
        """Initialises parameters identically on every rank (from ``config.seed``,
        or broadcast from rank 0) and the optimizer state of this rank's shard."""

    @abc.abstractmethod
    async def train_step(self, micro_batches: list[tuple[np.ndarray, np.ndarray, int, int]]) -> StepResult:
        """One optimizer step over ``grad_accum`` micro-batches.

        Each micro-batch is ``(x_local, y_local, offset, global_size)``: this
        rank's rows of a global micro-batch of ``global_size`` rows starting at
        row ``offset`` of it. Gradients are communicated only at the last
        micro-batch. Returns the step's result (loss agreed by all ranks)."""

    @abc.abstractmethod
    async def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(sum of losses, number correct) over this rank's rows of an evaluation set."""

    @abc.abstractmethod
    async def full_params(self) -> list[np.ndarray]:
        """The full, unpadded-by-unit flat parameters of every unit (float32 or the
        master dtype), identical on every rank."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """This rank's part of the training state for a sharded checkpoint:
        ``{"step": int, "shards": {name: array}, "layout": {...}, "scaler": {...}}``."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned (possibly resharded by the checkpoint code)."""

    @abc.abstractmethod
    def memory_bytes(self) -> dict:
        """Bytes this rank holds now: ``{"params", "grads", "optim", "gathered_peak"}``."""
