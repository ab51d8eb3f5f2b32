"""A test double for loss-scaling tests: a Model whose backward puts +inf into unit 0's gradient at one
step, as a float16 overflow would, just before the strategy communicates it.

    model = OverflowAt(tiny_model(), step=2)       # this rank only: the others train the plain model
    strategy = make_strategy("zero2", model, config, group)
    mesh_strategy.model = OverflowAt(mesh_strategy.model, step=1)   # a stage's model, after construction

Everything else is the wrapped model's. At ``step`` (the Context's), every backward sets element 0 of
unit 0's gradient to +inf at grad_ready(0), before the strategy's own grad_ready runs; under zero2/zero3
only the rank that holds element 0 in its shard sees the inf after the reduction, which tests that the
skip is agreed by every rank.
"""

from __future__ import annotations

import numpy as np

__all__ = ["OverflowAt"]


class OverflowAt:
    def __init__(self, model, step: int) -> None:
        self._model, self.step = model, int(step)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _ready(self, grads, ctx, grad_ready):
        if ctx.step != self.step:
            return grad_ready

        def ready(i: int) -> None:
            if i == 0:
                grads[0][0] = np.inf
            if grad_ready is not None:
                grad_ready(i)

        return ready

    def forward_backward(self, params, grads, x, y, ctx, *, grad_ready=None, **kw):
        return self._model.forward_backward(params, grads, x, y, ctx, grad_ready=self._ready(grads, ctx, grad_ready),
                                            **kw)

    def backward_tape(self, params, grads, tape, dout, *, grad_ready=None, **kw):
        return self._model.backward_tape(params, grads, tape, dout, grad_ready=self._ready(grads, tape.ctx, grad_ready),
                                         **kw)
