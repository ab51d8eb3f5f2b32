"""Model: units run by a list of calls, a loss, activation checkpointing; and the MLP builder.

What it is: the single-process driver over units that the sharding strategies hook into. A
model is its units (flat parameter buffers), the CALLS that run them in order, and its loss. A
call names a unit and one of its entry points, so a unit may run at two places (the GPT's unit 0
embeds the tokens first and, with the same tied matrix, computes the logits last):

    MLP:  calls = [Call(0), Call(1), Call(2)]
    GPT:  calls = [Call(0, "embed"), Call(1, checkpoint=True), ..., Call(L, checkpoint=True), Call(0, "head")]

`forward_backward` is `forward_tape`, the loss, then `backward_tape`:

    for call c in calls:            before_unit_forward(c.unit); h = unit.forward(params[c.unit], h, entry)
                                    after_unit_forward(c.unit)
    loss, d = loss.forward_backward(h, y, loss_denominator, dloss=grad_scale)
    for call c in reversed(calls):  before_unit_backward(c.unit); d = unit.backward(...)
                                    after_unit_backward(c.unit)
                                    grad_ready(c.unit)   # after the unit's LAST backward call only

Hooks are plain callables taking the unit index; `params_list[i]` is read after
`before_unit_forward(i)` / `before_unit_backward(i)` and `grads_list[i]` after the latter, so a
hook may install a freshly gathered buffer (FSDP) or free it afterwards. Calls marked
`checkpoint` keep only their input under activation checkpointing and run their forward again in
the backward (the same bits). `forward_tape(calls=range(a, b))` / `backward_tape` run a slice (a
pipeline stage). Gradients ACCUMULATE into `grads_list` (`grads_zero=True` when they hold zeros).

What it is not: no optimizer, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from trainer.nn.context import EVAL, Context
from trainer.nn.layers import GELU, Dropout, LayerNorm, Linear, ReLU
from trainer.nn.loss import CrossEntropyLoss, Loss
from trainer.nn.meter import ActivationMeter
from trainer.nn.unit import Unit

__all__ = ["Call", "Tape", "Model", "mlp", "HOOK_NAMES"]

Hook = Callable[[int], None] | None
HOOK_NAMES = ("before_unit_forward", "after_unit_forward", "before_unit_backward", "after_unit_backward",
              "grad_ready")


def _call(hook: Hook, i: int) -> None:
    if hook is not None:
        hook(i)


@dataclass(frozen=True)
class Call:
    unit: int  # index of the unit whose parameters the call uses, e.g. 0
    entry: str | None = None  # the unit's entry point, e.g. "head"; None: its module
    checkpoint: bool = False  # recomputed in backward under activation checkpointing


class _Saved:
    """A checkpointed call's cache: only its input (the forward runs again in backward)."""
    __slots__ = ("x",)

    def __init__(self, x: np.ndarray) -> None:
        self.x = x


@dataclass
class Tape:
    """What forward_tape keeps for backward_tape: per call run, its position and cache."""
    positions: list[int]  # indices into model.calls, in forward order
    caches: list[Any]  # the call's cache, or _Saved(input) when checkpointed
    tickets: list[list[int]]  # ActivationMeter tickets (empty without a meter)
    ctx: Context


class Model:
    """Units, the calls that run them, and the loss (the module docstring).

    Args:
        units: unit i gets `index = i` (which keys its dropout).
        calls: the order the units run in (default: each unit once, in order).
        loss: the loss object (default CrossEntropyLoss); a strategy or caller may pass another.
    """

    def __init__(self, units: Sequence[Unit], *, calls: Sequence[Call] | None = None, loss: Loss | None = None) -> None:
        if not units:
            raise ValueError("a Model needs at least one unit")
        self.units: list[Unit] = list(units)
        for i, unit in enumerate(self.units):
            unit.index = i
        self.calls: list[Call] = list(calls) if calls is not None else [Call(i) for i in range(len(self.units))]
        used = {c.unit for c in self.calls}
        if not self.calls or not used <= set(range(len(self.units))) or len(used) != len(self.units):
            raise ValueError(f"calls must use every unit 0..{len(self.units) - 1} and no other, "
                             f"got units {sorted(used)}")
        self.loss: Loss = loss if loss is not None else CrossEntropyLoss()

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded_numel for u in self.units)

    def grad_ready_order(self) -> list[int]:
        """Units in the order their gradients complete in a backward: by their first call, reversed."""
        first = []
        for c in self.calls:
            if c.unit not in first:
                first.append(c.unit)
        return first[::-1]

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

    # ---- forward ------------------------------------------------------------------

    def forward(
        self,
        params_list: Sequence[np.ndarray],
        x: np.ndarray,
        ctx: Context = EVAL,
        *,
        before_unit_forward: Hook = None,
        after_unit_forward: Hook = None,
    ) -> np.ndarray:
        """The output (e.g. logits (B, K) or (B, T, V)) without keeping caches (evaluation)."""
        h = x
        for c in self.calls:
            _call(before_unit_forward, c.unit)
            h, _ = self.units[c.unit].forward(params_list[c.unit], h, ctx, c.entry)
            _call(after_unit_forward, c.unit)
        return h

    def forward_tape(
        self,
        params_list: Sequence[np.ndarray],
        x: np.ndarray,
        ctx: Context,
        *,
        calls: range | None = None,
        checkpoint: bool = False,
        meter: ActivationMeter | None = None,
        before_unit_forward: Hook = None,
        after_unit_forward: Hook = None,
    ) -> tuple[np.ndarray, Tape]:
        """Runs `calls` (positions in self.calls, default all) keeping what backward_tape needs.

        checkpoint: calls marked `checkpoint` keep only their input (recomputed in backward).
        Returns (the last call's output, the tape)."""
        positions = list(range(len(self.calls)) if calls is None else calls)
        tape = Tape(positions, [], [], ctx)
        h = x
        for pos in positions:
            c = self.calls[pos]
            _call(before_unit_forward, c.unit)
            saved = checkpoint and c.checkpoint
            out, cache = self.units[c.unit].forward(params_list[c.unit], h, ctx, c.entry)
            if saved:
                cache = _Saved(h)
            tape.caches.append(cache)
            tape.tickets.append(meter.hold(cache.x if saved else cache) if meter is not None else [])
            h = out
            _call(after_unit_forward, c.unit)
        return h, tape

    # ---- backward -----------------------------------------------------------------

    def backward_tape(
        self,
        params_list: Sequence[np.ndarray],
        grads_list: list[np.ndarray],
        tape: Tape,
        dout: np.ndarray,
        *,
        grads_zero: bool = False,
        meter: ActivationMeter | None = None,
        before_unit_backward: Hook = None,
        after_unit_backward: Hook = None,
        grad_ready: Hook = None,
        release_after_first: list[int] | None = None,
    ) -> np.ndarray | None:
        """Backward of the calls on `tape`, last first; frees each cache as it goes. Returns the
        gradient with respect to the tape's input (None for integer inputs, e.g. token ids).
        `release_after_first`: a meter ticket given back after the first backward call (the
        output and its gradient, which that call consumes)."""
        last_use = {}  # unit -> the tape index of its first call (its last backward)
        first_use = {}  # unit -> the tape index of its last call (its first backward)
        for k, pos in enumerate(tape.positions):
            last_use.setdefault(self.calls[pos].unit, k)
            first_use[self.calls[pos].unit] = k
        d = dout
        for k in reversed(range(len(tape.positions))):
            c = self.calls[tape.positions[k]]
            unit = self.units[c.unit]
            _call(before_unit_backward, c.unit)
            params = params_list[c.unit]
            cache, recomputed = tape.caches[k], None
            if isinstance(cache, _Saved):  # activation checkpointing: run the forward again
                _, cache = unit.forward(params, cache.x, tape.ctx, c.entry)
                recomputed = meter.hold(cache) if meter is not None else None
            d = unit.backward(params, cache, d, grads_list[c.unit], entry=c.entry,
                              grads_zero=grads_zero and first_use[c.unit] == k)
            tape.caches[k] = cache = None  # free activations as we go
            if meter is not None:
                meter.release(tape.tickets[k])
                if recomputed is not None:
                    meter.release(recomputed)
                if release_after_first is not None:
                    meter.release(release_after_first)
                    release_after_first = None
            _call(after_unit_backward, c.unit)
            if last_use[c.unit] == k:
                _call(grad_ready, c.unit)
        return d

    def forward_backward(
        self,
        params_list: list[np.ndarray],
        grads_list: list[np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        ctx: Context,
        *,
        loss: Loss | None = None,
        loss_denominator: float | None = None,
        grad_scale: float = 1.0,
        grads_zero: bool = False,
        checkpoint: bool = False,
        meter: ActivationMeter | None = None,
        before_unit_forward: Hook = None,
        after_unit_forward: Hook = None,
        before_unit_backward: Hook = None,
        after_unit_backward: Hook = None,
        grad_ready: Hook = None,
    ) -> float:
        """Forward, loss, and backward over the calls in reverse; returns the (unscaled) loss.

        Args:
            x: (B, ...) local inputs; y: (B, ...) targets (what the loss takes).
            loss: the loss object (default self.loss).
            loss_denominator: D in loss = sum_n l_n / D; default B. Pass the global
                batch size on each rank so that SUMMED gradients equal the global mean's.
            grad_scale: multiplies dloss (the loss scale of mixed precision); the
                returned loss is not scaled.
            grads_zero: every ``grads_list[i]`` (as read after before_unit_backward(i))
                holds +0.0 only, e.g. freshly zeroed; the result is the same bits
                either way, with fewer temporaries when True.
            checkpoint: activation checkpointing of the calls marked `checkpoint`.
            meter: counts the activation bytes held (ActivationMeter).
        Returns:
            The local loss sum_n l_n / D as a Python float.
        """
        loss_fn = self.loss if loss is None else loss
        out, tape = self.forward_tape(params_list, x, ctx, checkpoint=checkpoint, meter=meter,
                                      before_unit_forward=before_unit_forward,
                                      after_unit_forward=after_unit_forward)
        value, d = loss_fn.forward_backward(out, y, loss_denominator, grad_scale)
        ticket = meter.hold((out, d)) if meter is not None else None  # the output and its gradient
        del out
        self.backward_tape(params_list, grads_list, tape, d, grads_zero=grads_zero, meter=meter,
                           before_unit_backward=before_unit_backward, after_unit_backward=after_unit_backward,
                           grad_ready=grad_ready, release_after_first=ticket)
        return float(value)

    # ---- evaluation ----------------------------------------------------------------

    def metrics(self, params_list: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, *,
                loss: Loss | None = None) -> dict[str, float]:
        """The loss's metric sums over (x, y) in eval mode, e.g. {"loss": 12.3, "accuracy": 57.0}."""
        return (self.loss if loss is None else loss).metrics(self.forward(params_list, x), y)

    def predict(self, params_list: Sequence[np.ndarray], x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
        """Arg-max class (B,) in eval mode, in chunks of batch_size rows."""
        out = [self.forward(params_list, x[s : s + batch_size]).argmax(axis=-1) for s in range(0, len(x), batch_size)]
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
    gelu: str = "tanh",
    kernel: str = "fast",
    loss: Loss | None = None,
) -> Model:
    """An MLP with one unit per hidden block and the head as the last unit.

    hidden unit j:  Linear(d_j, hidden[j]) -> LayerNorm -> GELU|ReLU [-> Dropout(p)]
    head unit:      Linear(hidden[-1], out_dim)
    gelu: "tanh" (default) or "none" (exact erf form), as torch.nn.GELU(approximate=...).
    loss: default CrossEntropyLoss (classification); e.g. MSELoss() for regression.

    Tensor-parallel declarations (trainer/nn/layers.py): the Linears pair up in order, the
    first of a pair "column" (its LayerNorm and Dropout act on the cut features) and the
    second "row"; an odd last one (the head, then) is replicated. At tp = 1 they change nothing.

    Example: mlp(64, (256, 256), 10, pad_to=4) has 3 units with numels
    16640 + 512, 65792 + 512 and 2570 (each padded up to a multiple of 4); under tp = 2
    unit 0's Linear is column-split, unit 1's row-split, the head whole.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    linears = len(hidden) + 1

    def split(k: int) -> str | None:  # the k-th Linear's tensor-parallel split
        return "row" if k % 2 else ("column" if k + 1 < linears else None)

    units, d = [], in_dim
    for j, width in enumerate(hidden):
        cut = "column" if split(j) == "column" else None  # what follows a column Linear acts on its parts
        layers = [Linear(d, width, split=split(j))]
        layers += [LayerNorm(width, kernel=kernel, split=cut)] if layernorm else []
        layers.append(GELU(gelu, kernel=kernel) if activation == "gelu" else ReLU())
        layers += [Dropout(dropout, split=cut)] if dropout > 0 else []
        units.append(Unit(layers, pad_to=pad_to, dtype=dtype))
        d = width
    units.append(Unit([Linear(d, out_dim, split=split(len(hidden)))], pad_to=pad_to, dtype=dtype))
    return Model(units, loss=loss)
