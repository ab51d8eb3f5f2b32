"""Model: a list of Units run in order, plus the MLP builder.

What it is: the single-process driver over units that the sharding strategies
hook into. `forward_backward` runs

    for i in 0 .. U-1:   before_unit_forward(i);  h = units[i].forward(params[i], h);  after_unit_forward(i)
    loss, dlogits = softmax_cross_entropy(h, y, loss_denominator)
    for i in U-1 .. 0:   before_unit_backward(i); d = units[i].backward(params[i], ..., grads[i]); after_unit_backward(i)

Hooks are plain callables taking the unit index (no asyncio here; a strategy
that needs to wait does so inside its hook or hands work to its own thread).
`params_list[i]` is read AFTER `before_unit_forward(i)` / `before_unit_backward(i)`
return, and `grads_list[i]` after `before_unit_backward(i)`, so a hook may
install a freshly gathered buffer into the list (FSDP) or free it afterwards
(`after_unit_forward`: replace the entry with None until the backward needs it).

Gradients ACCUMULATE into `grads_list`; zero them (`zero_grads`) between steps.
A caller that knows they hold zeros (the first micro-batch of a step) passes
`grads_zero=True`, and layers may write instead of add (same bits, fewer passes).

What it is not: no optimizer, no communication, no checkpointing.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from trainer.nn.context import EVAL, Context
from trainer.nn.layers import GELU, Dropout, LayerNorm, Linear, ReLU
from trainer.nn.loss import cross_entropy_backward, cross_entropy_forward
from trainer.nn.unit import Unit

__all__ = ["Model", "mlp"]

Hook = Callable[[int], None] | None


def _call(hook: Hook, i: int) -> None:
    if hook is not None:
        hook(i)


class Model:
    """An ordered list of units; unit i gets `index = i` (which keys its dropout)."""

    def __init__(self, units: Sequence[Unit]) -> None:
        if not units:
            raise ValueError("a Model needs at least one unit")
        self.units: list[Unit] = list(units)
        for i, unit in enumerate(self.units):
            unit.index = i

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded_numel for u in self.units)

    def init_params(self, seed: int) -> list[np.ndarray]:
        """One flat padded buffer per unit, a pure function of `seed` (same on every process)."""
        return [u.init_params(seed) for u in self.units]

    def zeros(self, dtype=None) -> list[np.ndarray]:
        """One zero flat buffer per unit, e.g. the gradient lists."""
        return [u.zeros(dtype) for u in self.units]

    @staticmethod
    def zero_grads(grads_list: Sequence[np.ndarray]) -> None:
        for g in grads_list:
            g.fill(0)

    def forward(
        self,
        params_list: Sequence[np.ndarray],
        x: np.ndarray,
        ctx: Context = EVAL,
        *,
        before_unit_forward: Hook = None,
        after_unit_forward: Hook = None,
    ) -> np.ndarray:
        """Logits (B, K) without keeping caches (evaluation)."""
        h = x
        for i, unit in enumerate(self.units):
            _call(before_unit_forward, i)
            h, _ = unit.forward(params_list[i], h, ctx)
            _call(after_unit_forward, i)
        return h

    def forward_backward(
        self,
        params_list: list[np.ndarray],
        grads_list: list[np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        ctx: Context,
        *,
        loss_denominator: float | None = None,
        grad_scale: float = 1.0,
        grads_zero: bool = False,
        before_unit_forward: Hook = None,
        after_unit_forward: Hook = None,
        before_unit_backward: Hook = None,
        after_unit_backward: Hook = None,
    ) -> float:
        """Forward, loss, and backward over units in reverse; returns the (unscaled) loss.

        Args:
            x: (B, in) local inputs; y: (B,) integer labels.
            loss_denominator: D in loss = sum_n loss_n / D; default B. Pass the global
                batch size on each rank so that SUMMED gradients equal the global mean's.
            grad_scale: multiplies dloss (the loss scale of mixed precision); the
                returned loss is not scaled.
            grads_zero: every ``grads_list[i]`` (as read after before_unit_backward(i))
                holds +0.0 only, e.g. freshly zeroed; the result is the same bits
                either way, with fewer temporaries when True.
        Returns:
            The local loss sum_n loss_n / D as a Python float.
        """
        caches = []
        h = x
        for i, unit in enumerate(self.units):
            _call(before_unit_forward, i)
            h, cache = unit.forward(params_list[i], h, ctx)
            caches.append(cache)
            _call(after_unit_forward, i)
        loss, loss_cache = cross_entropy_forward(h, y, loss_denominator)
        d = cross_entropy_backward(loss_cache, grad_scale)  # (B, K)
        for i in reversed(range(len(self.units))):
            _call(before_unit_backward, i)
            d = self.units[i].backward(params_list[i], caches[i], d, grads_list[i], grads_zero=grads_zero)
            caches[i] = None  # free activations as we go
            _call(after_unit_backward, i)
        return loss

    def predict(self, params_list: Sequence[np.ndarray], x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
        """Arg-max class (B,) in eval mode, in chunks of batch_size rows."""
        out = [self.forward(params_list, x[s : s + batch_size]).argmax(axis=1) for s in range(0, len(x), batch_size)]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def accuracy(self, params_list: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        return float((self.predict(params_list, x) == y).mean())


_ACTIVATIONS = {"gelu": GELU, "relu": ReLU}


def mlp(
    in_dim: int,
    hidden: Sequence[int] = (256, 256),
    out_dim: int = 10,
    *,
    activation: str = "gelu",
    layernorm: bool = True,
    dropout: float = 0.0,
    pad_to: int = 1,
    dtype=np.float32,
) -> Model:
    """An MLP with one unit per hidden block and the classifier head as the last unit.

    hidden unit j:  Linear(d_j, hidden[j]) -> LayerNorm -> GELU|ReLU [-> Dropout(p)]
    head unit:      Linear(hidden[-1], out_dim)

    Example: mlp(64, (256, 256), 10, pad_to=4) has 3 units with numels
    16640 + 512, 65792 + 512 and 2570 (each padded up to a multiple of 4).
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    units, d = [], in_dim
    for width in hidden:
        layers = [Linear(d, width)]
        layers += [LayerNorm(width)] if layernorm else []
        layers.append(_ACTIVATIONS[activation]())
        layers += [Dropout(dropout)] if dropout > 0 else []
        units.append(Unit(layers, pad_to=pad_to, dtype=dtype))
        d = width
    units.append(Unit([Linear(d, out_dim)], pad_to=pad_to, dtype=dtype))
    return Model(units)
