"""The contract every sharding strategy (ddp, zero1, zero2, zero3/fsdp) fulfils.

The loop (trainer/loop.py) and checkpoints (trainer/checkpoint.py) talk to a strategy only
through this class. A strategy owns the model's flat buffers (whole or sharded), the optimizer
state, the gradient communication and the loss scaler.

Life of a strategy (grammar)::

    Strategy(...) -> await setup() -> (await train_step(...) | await evaluate(...)
                  | await full_params() | await check_replicas()
                  | state_dict() / load_state_dict())* -> close() -> end

All ranks of ``group`` call the async methods in the same order (they run collectives).
``load_state_dict`` is local; the collectives it implies run at the start of the next async call.

Checkpoint state (``state_dict``), the format trainer/checkpoint.py writes::

    {"strategy": "zero3", "world_size": 4, "rank": 1,
     "step": 17,                   # train_step calls done (skipped steps included)
     "optim_step": 16,             # optimizer updates applied (skipped steps excluded)
     "optimizer": "adamw", "master_dtype": "float32",
     "scaler": {"scale": 65536.0, "good_steps": 3},
     "shards": {"unit0.param": array, "unit0.exp_avg": array, ...},
     "layout": {"unit0.param": {"numel": 17152, "start": 4288, "replicated": False}, ...}}

Every name is one unit's UNPADDED flat array of ``numel`` elements; this rank's shard covers
``[start, start + len(shard))`` of it (a replicated array, ddp's, is written from rank 0 only).
``load_state_dict`` takes the shards ``state_dict()["layout"]`` asks for, cut from any layout.
Not here: data loading, logging, checkpoint files.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TrainConfig", "StepResult", "ReplicaMismatchError", "StepAbortedError", "ShardLostError", "Strategy"]


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = "ddp"             # ddp | zero1 | zero2 | zero3 | fsdp
    optimizer: str = "adamw"          # adamw | sgd
    lr: float = 2e-3                  # peak learning rate
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)  # adamw's (beta1, beta2), e.g. (0.9, 0.95) as nanoGPT
    decay: str = "matrices"           # which parameters decay: matrices (not biases, norms, embeddings) | all
    momentum: float = 0.9             # sgd only
    nesterov: bool = False            # sgd only
    adam_kernel: str = "numba"        # adamw kernel: numba (fused, releases the GIL) | numpy (reference)
    warmup_steps: int = 0
    total_steps: int = 1              # for the cosine schedule; <= 1 means a constant lr
    min_lr: float = 0.0               # cosine schedule's floor, e.g. 2e-5
    param_dtype: str = "float32"      # compute copy and its all-gather: float32 | float16 | bfloat16 | float64
    reduce_dtype: str = "float32"     # gradient communication (and accumulation) dtype
    master_dtype: str = "float32"     # float32, or float64 for exactness tests
    grad_accum: int = 1               # micro-batches per optimizer step
    clip_norm: float | None = None    # global-norm gradient clipping, e.g. 1.0
    compression: str | None = None    # gradient codec, e.g. "int8+ef" (ddp all_reduce; zero/fsdp reduce_scatter)
    bucket_cap_mb: float = 25.0       # ddp bucket size
    compression_start: int = 0        # the first N steps' gradients uncompressed, then the codec (any strategy)
    freeze_variance: bool = False     # adamw: v frozen from compression_start on (1-bit Adam's freeze_step)
    compression_host_first: bool = True  # ddp on several hosts of several ranks: codec across hosts only
    reshard_after_forward: bool = True  # fsdp/zero3; False keeps gathered params until backward
    prefetch: bool = True             # fsdp/zero3: gather the next unit while this one computes
    loss_scale: bool | None = None    # dynamic loss scaling (default: on for float16)
    init_scale: float = 2.0**16       # first loss scale when scaling is on
    growth_interval: int = 2000       # good steps before the loss scale doubles
    seed: int = 0
    check_every: int = 0              # every N steps check replicated state is equal across ranks (0: never)
    activation_checkpointing: bool = False  # recompute the calls marked checkpoint (GPT blocks) in backward
    offload: str | None = None        # None | "optimizer" | "params": to memory-mapped files (trainer/parallel/offload.py)
    offload_dir: str | None = None    # where those files go, e.g. "/scratch" (default: the temporary directory)


@dataclass
class StepResult:
    loss: float                       # mean loss over the global batch (all micro-batches)
    skipped: bool = False             # the step was skipped (inf/NaN gradients under loss scaling)
    grad_norm: float | None = None    # global gradient norm before clipping (inf/nan when skipped)
    comm_bytes: int = 0               # bytes this rank sent in this step (ring-algorithm volume)
    timings: dict = field(default_factory=dict)  # compute_s, comm_s, exposed_comm_s, step_s
    loss_scale: float = 1.0           # loss scale this step's backward used
    comm_bytes_by_dim: dict = field(default_factory=dict)  # under a mesh: {"dp": 4096, "tp": 81920, "pp": 2048, ...}


class ReplicaMismatchError(RuntimeError):
    """Replicated state differs across ranks (``check_replicas``); names the ranks."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class StepAbortedError(RuntimeError):
    """Elastic training: the step was discarded on every member (a collective of it failed on some
    member, or the commit vote said no); no state changed, and the next generation runs it again.
    ``step`` is the discarded step's number; ``__cause__`` the local failure, if any."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class ShardLostError(RuntimeError):
    """Elastic re-sharding: every in-memory copy of some shard is gone (its rank and the rank holding
    its replica were both lost): the state must come from the newest checkpoint on disk. ``ranks``
    are the old ranks whose shards have no copy left."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class Strategy(abc.ABC):
    """Args of every strategy: ``model`` (trainer.nn.Model; the strategy pads its
    units to its world size), ``config`` (TrainConfig), ``group`` (runtime
    ProcessGroup), and keyword ``loss`` (default ``model.loss``: the loss object the
    step trains on and whose metrics ``evaluate`` returns)."""

    name: str
    step: int  # train_step calls done so far (restored by load_state_dict)

    @abc.abstractmethod
    async def setup(self) -> None:
        """Initialises parameters identically on every rank (from ``config.seed``,
        then broadcast from rank 0 for replicated strategies) and the optimizer
        state of this rank's shard."""

    @abc.abstractmethod
    async def train_step(self, micro_batches: list[tuple[np.ndarray, np.ndarray, int, int]]) -> StepResult:
        """One optimizer step over the micro-batches given (``grad_accum`` of them in ``fit``).

        Each micro-batch is ``(x_local, y_local, offset, global_size)``: this
        rank's rows of a global micro-batch of ``global_size`` rows starting at
        row ``offset`` of it. The step's global batch is the concatenation of
        the global micro-batches in order, so the loss (and the gradient) is the
        mean over ``sum(global_size)`` rows, exactly as single-process training
        on that batch. Gradients are communicated only at the last micro-batch.
        Every rank passes the same number of micro-batches (an empty local
        part is fine). Returns the step's result (loss agreed by all ranks).

        Raises:
            ReplicaMismatchError: ``config.check_every`` is set and replicated
                state differs across ranks after this step.
            runtime.errors.CollectiveError (and subclasses): a peer failed.
            StepAbortedError: elastic training (trainer/sharding/redundancy.py): the step was
                discarded on every member, no state changed; run it again.
        """

    @abc.abstractmethod
    async def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """The loss's metric SUMS over this rank's rows of an evaluation set, e.g.
        ``{"loss": 41.2, "accuracy": 57.0}`` (``loss.metrics``: sums of per-sample values).
        Every rank calls it (zero3 gathers parameters), with any number of rows, 0 included."""

    @abc.abstractmethod
    async def full_params(self) -> list[np.ndarray]:
        """The full parameters of every unit as unpadded flat arrays of the master
        dtype (``unit.numel`` each), identical on every rank; ``model.forward`` takes them."""

    async def check_replicas(self) -> None:
        """Checksums replicated state on every rank and compares them.

        Raises:
            ReplicaMismatchError: naming the ranks whose state differs from the majority.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """This rank's part of the training state (format in the module docstring)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned (possibly resharded by the checkpoint code).

        Raises:
            ValueError: a shard is missing or has the wrong length / optimizer.
        """

    @abc.abstractmethod
    def memory_bytes(self) -> dict:
        """Bytes this rank holds now: ``{"params", "grads", "optim", "total",
        "gathered_peak", ...}``; params/grads/optim are the persistent buffers
        (ZeRO accounting), gathered_peak the most bytes of gathered (unsharded)
        parameter units alive at once since setup or :meth:`reset_peak`, and
        activations_peak the most bytes of activations the model held for its
        backward (trainer.nn.ActivationMeter)."""

    def reset_peak(self) -> None:
        """Restarts the ``gathered_peak`` measurement."""

    def close(self) -> None:
        """Releases the compute thread. Idempotent."""
