"""Optimizers on flat 1-D shards (SGD, AdamW) and learning-rate schedules.

What it is: each optimizer is a small hyper-parameter object whose `step` updates ONE flat
parameter shard in place from the matching flat gradient shard, with its state held as flat arrays
of the same length. The shard is whatever the strategy owns (a whole unit's buffer under DDP, the
rank's 1/world slice under ZeRO/FSDP); the padding (zero params, zero grads) stays zero.

    opt = AdamW(weight_decay=0.01)
    state = opt.init_state(numel=shard.size, dtype=shard.dtype)   # OptimState
    opt.step(shard, grad_shard, state, lr=schedule(step))          # in place
    opt.step(shard, grad_shard, state, lr, segments=[(0, 4096, True), (4096, 4160, False)])
    state.nbytes                                                   # countable memory

`segments` [(lo, hi, decayed)] tile the shard: weight decay applies to the decayed ranges only
(the matrices; trainer.nn.Unit.decay_segments makes the list), each updated on a view, so no
per-element mask is stored. The updates follow torch.optim's (default flags, single-tensor path;
the formulas are in SGD's and AdamW's docstrings). AdamW has two kernels with one answer, bit for
bit: `adamw_reference` (NumPy, the readable one) and `adamw_fused` (Numba, one pass, nogil), picked
with `AdamW(kernel="numpy" | "numba")`. Schedules are pure functions of the step.

What it is not: no per-group learning rates (the groups differ in weight decay only), no gradient
clipping (the global norm needs a collective; the caller scales grads), no amsgrad / maximize /
foreach variants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import njit

__all__ = [
    "OptimState", "state_nbytes", "SGD", "AdamW", "adamw_reference", "adamw_fused",
    "Constant", "WarmupCosine",
]


@dataclass
class OptimState:
    step: int  # completed steps, e.g. 0 before the first
    buffers: dict[str, np.ndarray] = field(default_factory=dict)  # name -> flat (numel,)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


def state_nbytes(state: OptimState) -> int:
    """Bytes held by an optimizer state's arrays (the step counter is not counted)."""
    return state.nbytes


def _check(param: np.ndarray, grad: np.ndarray, state: OptimState) -> None:
    if param.ndim != 1 or grad.shape != param.shape:
        raise ValueError(f"param and grad must be 1-D of one length, got {param.shape} and {grad.shape}")
    for name, buf in state.buffers.items():
        if buf.shape != param.shape:
            raise ValueError(f"state buffer {name!r} has shape {buf.shape}, param shard {param.shape}")


def _segments(n: int, segments) -> list[tuple[int, int, bool]]:
    """The weight-decay groups of a shard of n elements (default: one decayed group); checks they tile [0, n)."""
    if segments is None:
        return [(0, n, True)]
    segments = [(int(lo), int(hi), bool(d)) for lo, hi, d in segments]
    ends = [0] + [hi for _, hi, _ in segments]
    if [lo for lo, _, _ in segments] != ends[:-1] or ends[-1] != n or any(hi < lo for lo, hi, _ in segments):
        raise ValueError(f"segments must tile [0, {n}) in order, got {segments}")
    return segments


class SGD:
    """Stochastic gradient descent with momentum, dampening, Nesterov and (L2) weight decay, as
    torch.optim.SGD computes it::

        g = grad + wd p;  b = g (first step) | mu b + (1 - dampening) g
        g = g + mu b (nesterov) | b;  p -= lr g
    """

    def __init__(self, *, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0) -> None:
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"momentum and weight_decay must be >= 0, got {momentum}, {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening == 0")
        self.momentum, self.dampening = momentum, dampening
        self.nesterov, self.weight_decay = nesterov, weight_decay

    def init_state(self, numel: int, dtype=np.float32) -> OptimState:
        buffers = {"momentum": np.zeros(numel, dtype=dtype)} if self.momentum else {}
        return OptimState(step=0, buffers=buffers)

    def step(self, param: np.ndarray, grad: np.ndarray, state: OptimState, lr: float, *, segments=None) -> None:
        _check(param, grad, state)
        for lo, hi, decayed in _segments(param.shape[0], segments):
            buffers = {k: b[lo:hi] for k, b in state.buffers.items()}
            self._step(param[lo:hi], grad[lo:hi], buffers, state.step, lr, self.weight_decay if decayed else 0.0)
        state.step += 1

    def _step(self, param, grad, buffers, step, lr, weight_decay) -> None:
        d = grad + weight_decay * param if weight_decay else grad  # (n,)
        if self.momentum:
            buf = buffers["momentum"]
            if step == 0:
                buf[...] = d
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * d
            d = d + self.momentum * buf if self.nesterov else buf
        param -= lr * d


def adamw_reference(param, grad, m, v, *, lr, beta1, beta2, eps, weight_decay, step, freeze_step=0) -> None:
    """NumPy AdamW step `step` (1-based) in place on flat arrays; the readable version.

    Arithmetic is float64 and each array is stored once, in its own dtype, at the
    end (as the fused kernel does), so a float32 shard is rounded once per step.
    ``freeze_step`` S > 0: from step S + 1 on, ``v`` is left as it is and its bias correction
    stays that of step S (1-bit Adam's frozen variance).
    """
    frozen = 0 < freeze_step < step
    bias_c1 = 1.0 - beta1**step
    bias_c2 = 1.0 - beta2**(freeze_step if frozen else step)
    g = grad.astype(np.float64)  # (n,)
    m64 = beta1 * m.astype(np.float64) + (1.0 - beta1) * g  # (n,)
    v64 = v.astype(np.float64) if frozen else beta2 * v.astype(np.float64) + (1.0 - beta2) * g * g  # (n,)
    denom = np.sqrt(v64) / math.sqrt(bias_c2) + eps  # (n,)
    param[...] = param.astype(np.float64) * (1.0 - lr * weight_decay) - (lr / bias_c1) * m64 / denom
    m[...] = m64
    v[...] = v64


@njit(nogil=True, cache=False)
def adamw_fused(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, bias_c1, bias_c2,
                frozen=False):  # pragma: no cover
    """Numba AdamW: the same formula as adamw_reference, one loop, float64 per element;
    ``frozen``: ``v`` read, not updated (``bias_c2`` then the freeze step's)."""
    decay = 1.0 - lr * weight_decay
    step_size = lr / bias_c1
    sqrt_bc2 = math.sqrt(bias_c2)
    for i in range(param.shape[0]):
        g = np.float64(grad[i])
        mi = beta1 * np.float64(m[i]) + (1.0 - beta1) * g
        if frozen:
            vi = np.float64(v[i])
        else:
            vi = beta2 * np.float64(v[i]) + (1.0 - beta2) * g * g
            v[i] = vi
        m[i] = mi
        param[i] = np.float64(param[i]) * decay - step_size * mi / (math.sqrt(vi) / sqrt_bc2 + eps)


class AdamW:
    """Adam with decoupled weight decay and bias correction (torch.optim.AdamW defaults)::

        p *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)   (t = 1, 2, ...)

    torch writes the m update as a lerp: the same expression up to rounding. Both kernels do
    float64 arithmetic and round to the shard's dtype once per array per step, so they agree bit
    for bit; on a float32 shard they differ from torch's float32 arithmetic by rounding only.
    ``kernel="numba"`` releases the GIL, so a strategy may run it beside communication.

    ``freeze_step=S`` (0: off): 1-bit Adam's frozen variance (Tang et al. 2021; DeepSpeed's
    ``freeze_step``). After S steps, ``v`` and its bias correction stay as they were at step S, so
    the update is linear in the gradient (m / a fixed per-coordinate scale): a compressed gradient
    with error feedback then adds up to what the uncompressed one would, as under SGD. With a
    varying ``v`` a coordinate that top-k sends once in 1/density steps with 1/density times its
    gradient inflates v by ~1/density and shrinks its step by ~sqrt(density)."""

    KERNELS = ("numpy", "numba")

    def __init__(self, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, kernel: str = "numpy", freeze_step: int = 0) -> None:
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if kernel not in self.KERNELS:
            raise ValueError(f"kernel must be one of {self.KERNELS}, got {kernel!r}")
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        if int(freeze_step) != freeze_step or freeze_step < 0:
            raise ValueError(f"freeze_step must be an integer >= 0, got {freeze_step!r}")
        self.eps, self.weight_decay, self.kernel = float(eps), float(weight_decay), kernel
        self.freeze_step = int(freeze_step)  # steps after which v is frozen, e.g. 52; 0: never

    def init_state(self, numel: int, dtype=np.float32) -> OptimState:
        return OptimState(step=0, buffers={"exp_avg": np.zeros(numel, dtype=dtype),
                                           "exp_avg_sq": np.zeros(numel, dtype=dtype)})

    def step(self, param: np.ndarray, grad: np.ndarray, state: OptimState, lr: float, *, segments=None) -> None:
        _check(param, grad, state)
        t = state.step + 1
        m, v = state.buffers["exp_avg"], state.buffers["exp_avg_sq"]
        for lo, hi, decayed in _segments(param.shape[0], segments):
            wd = self.weight_decay if decayed else 0.0
            p, g, ms, vs = param[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi]
            if self.kernel == "numba":
                frozen = 0 < self.freeze_step < t
                adamw_fused(p, g, ms, vs, float(lr), self.beta1, self.beta2, self.eps, wd, 1.0 - self.beta1**t,
                            1.0 - self.beta2**(self.freeze_step if frozen else t), frozen)
            else:
                adamw_reference(p, g, ms, vs, lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                                weight_decay=wd, step=t, freeze_step=self.freeze_step)
        state.step = t


# ---- schedules: pure functions of the 0-based step -------------------------


@dataclass(frozen=True)
class Constant:
    lr: float  # e.g. 1e-3

    def __call__(self, step: int) -> float:
        return self.lr


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up to `peak_lr`, then cosine decay to `min_lr` at `total_steps`.

    step < warmup:               lr = peak (step + 1) / warmup
    warmup <= step < total:      r = (step - warmup) / (total - warmup)
                                 lr = min + (peak - min) (1 + cos(pi r)) / 2
    step >= total:               lr = min
    """

    peak_lr: float  # e.g. 3e-3
    warmup_steps: int  # e.g. 100
    total_steps: int  # e.g. 1000
    min_lr: float = 0.0  # e.g. 3e-5

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {self.warmup_steps}, {self.total_steps}")

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr
        r = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * r))
