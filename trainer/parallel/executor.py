"""Running one pipeline stage's lowered schedule on the strategy's compute thread: forwards,
backwards, and the activations and gradients sent between stages.

`StageRun(strategy, chunks, denominator, scale).train()` runs the stage's list from
schedules.lower for one optimizer step and returns the stage's loss sum; `.evaluate(x, y)` runs
the one-forward list [F0], lowered the same way (tags of its own), and returns the metric sums on
the last stage. The list says where each receive is posted and each send launched; this file says
what each action does, through the strategy's AccountedCollectives on the pp group:

    RECV_F j / RECV_B j   post the receive of j's activation (from stage - 1, tag 2 j) / gradient
                          (from stage + 1, tag 2 j + 1) into the buffer F j / B j computes on, of
                          the shape the stage names (``activation_shape(kind, x_j.shape)``)
    F j       the forward of micro-batch j on its tokens (first stage) or on the received
              activation, waited for here (the stage's bubble); the last stage takes the loss and
              keeps its gradient for B j; the tape is kept until B j
    B j       the backward of j on that gradient or the received one; the stage's last B runs the
              data-parallel gradient reduction (the strategy's hooks, as in data-parallel training)
    SEND_F j / SEND_B j   launch the send of F j's output / B j's input gradient, never waited for
                          (the array stays referenced until it has left; nothing is copied)

Micro-batch j's Context has batch_offset = its first row in the step's global batch, so dropout
masks, and the whole step, are the single-process ones. Why receives are posted where they are and
what a message that finds none costs: docs/design.md, "The lowered schedule".
Not here: the schedule (schedules.py), collectives across dp or tp (the hooks and layers run them).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable

import numpy as np

from trainer.nn import EVAL, Context
from trainer.parallel.schedules import Action, lower, schedule

__all__ = ["StageRun", "EVAL_TAG"]

EVAL_TAG = 1 << 30  # evaluation's activations: a tag of their own (training uses 2 j and 2 j + 1)


class StageRun:
    """One step (or one evaluation) of this rank's pipeline stage (the module docstring)."""

    def __init__(self, strategy, chunks=(), denominator: float = 1.0, scale: float = 1.0) -> None:
        self.s = strategy
        self.layout = strategy.layout
        self.chunks = list(chunks)  # [(x, y, batch_offset)] per micro-batch
        self.denominator, self.scale = denominator, scale
        self.acc = strategy.pp_acc
        self.tag_base = 0  # EVAL_TAG for evaluation
        self.recvs: dict[tuple[str, int], tuple[concurrent.futures.Future, np.ndarray]] = {}
        self.sends: list[tuple[concurrent.futures.Future, np.ndarray]] = []
        self.wait_s = 0.0  # blocked on receives (the bubble, with the transfers)
        self.in_flight_peak = 0  # micro-batches whose forward ran and backward did not, at most

    # ---- point to point --------------------------------------------------------------

    def _post(self, kind: str, j: int, src: int) -> None:
        """Posts the receive of micro-batch j's activation ("F") or gradient ("B") from ``src``."""
        shape = self.s.activation_shape(kind, self.chunks[j][0].shape)  # the model's own boundary shape
        buf = np.empty(shape, self.s.activation_dtype)
        tag = self.tag_base + 2 * j + (kind == "B")
        self.recvs[(kind, j)] = (self.acc.launch(self.acc.recv(buf, src, tag)), buf)

    def _take(self, kind: str, j: int) -> np.ndarray:
        """Waits for the receive that RECV_<kind> j posted; the wait is the stage's bubble."""
        try:
            fut, buf = self.recvs.pop((kind, j))
        except KeyError:
            raise RuntimeError(f"{kind}{j} on pipeline stage {self.layout.stage} takes a receive that its "
                               f"lowered list did not post before it (schedules.lower)") from None
        t0 = time.perf_counter()
        try:
            self.s.wait_on(self.acc, fut)
        finally:
            self.wait_s += time.perf_counter() - t0
        return buf

    def _send(self, x: np.ndarray, kind: str, j: int, dst: int) -> None:
        x = np.ascontiguousarray(x, dtype=self.s.activation_dtype)  # a copy only if a layer changed dtype
        self.sends = [(f, a) for f, a in self.sends if not f.done()]  # what has left is let go
        tag = self.tag_base + 2 * j + (kind == "B")
        self.sends.append((self.acc.launch(self.acc.send(x, dst, tag)), x))

    # ---- the lowered list ---------------------------------------------------------------

    def _run(self, lowered: list[Action], forward: Callable, backward: Callable | None) -> None:
        """Runs ``lowered`` in order. ``forward(j, inp)`` and ``backward(j, dout, last)`` return
        what SEND_F j / SEND_B j send (None on the stage that sends nothing); ``dout`` is None on
        the last stage, ``last`` is True for the list's last backward."""
        stage = self.layout.stage
        first = self.layout.first
        last_b = max((k for k, a in enumerate(lowered) if a.kind == "B"), default=-1)
        outbox: dict[tuple[str, int], np.ndarray] = {}  # computed, not sent yet
        for k, a in enumerate(lowered):
            j = a.mb
            if a.kind == "RECV_F":
                self._post("F", j, stage - 1)
            elif a.kind == "RECV_B":
                self._post("B", j, stage + 1)
            elif a.kind == "F":
                out = forward(j, self.chunks[j][0] if first else self._take("F", j))
                if out is not None:
                    outbox[("F", j)] = out
                del out
            elif a.kind == "B":
                dx = backward(j, None if self.layout.last else self._take("B", j), k == last_b)
                if dx is not None:
                    outbox[("B", j)] = dx
                del dx
            elif a.kind == "SEND_F":
                self._send(outbox.pop(("F", j)), "F", j, stage + 1)
            else:  # SEND_B
                self._send(outbox.pop(("B", j)), "B", j, stage - 1)
        if outbox or self.recvs:
            raise RuntimeError(f"pipeline stage {stage}'s lowered list left outputs unsent {sorted(outbox)} "
                               f"or receives untaken {sorted(self.recvs)} (schedules.lower)")

    # ---- the step ------------------------------------------------------------------------

    def train(self) -> float:
        s, layout = self.s, self.layout
        model, loss_fn = s.model, s.loss
        actions = schedule(s.parallel.schedule, layout.pp, layout.stage, len(self.chunks))
        params, grads = s._compute_params(), s._grad_list()
        s.meter.clear()  # what a failed step may have left
        tapes, dlogits, tickets = {}, {}, {}
        loss, backwards = 0.0, 0
        checkpoint = s.config.activation_checkpointing

        def forward(j: int, inp: np.ndarray) -> np.ndarray | None:
            nonlocal loss
            _, y, offset = self.chunks[j]
            hooks = s._hooks(False, params, grads)
            ctx = Context(training=True, seed=s.config.seed, step=s.step, batch_offset=int(offset))
            out, tapes[j] = model.forward_tape(
                params, inp, ctx, checkpoint=checkpoint, meter=s.meter,
                before_unit_forward=hooks.get("before_unit_forward"),
                after_unit_forward=hooks.get("after_unit_forward"))
            self.in_flight_peak = max(self.in_flight_peak, len(tapes))
            if not layout.last:
                return out
            value, dlogits[j] = loss_fn.forward_backward(out, y, self.denominator, self.scale)
            loss += value
            tickets[j] = s.meter.hold((out, dlogits[j]))  # the loss's gradient waits for B j
            return None

        def backward(j: int, dout: np.ndarray | None, sync: bool) -> np.ndarray | None:
            nonlocal backwards
            if dout is None:
                dout = dlogits.pop(j)
            hooks = s._hooks(sync, params, grads)
            dx = model.backward_tape(
                params, grads, tapes.pop(j), dout, grads_zero=backwards == 0, meter=s.meter,
                before_unit_backward=hooks.get("before_unit_backward"),
                after_unit_backward=hooks.get("after_unit_backward"), grad_ready=hooks.get("grad_ready"),
                release_after_first=tickets.pop(j, None))
            backwards += 1
            return None if layout.first else dx

        self._run(lower(actions, layout.pp, layout.stage), forward, backward)
        return loss

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float] | None:
        """One forward through the pipeline; the metric sums on the last stage (None elsewhere)."""
        s, layout = self.s, self.layout
        self.chunks, self.tag_base = [(x, y, 0)], EVAL_TAG
        params = s._compute_params()
        hooks = s._eval_hooks(params)
        metrics = None

        def forward(j: int, inp: np.ndarray) -> np.ndarray | None:
            nonlocal metrics
            out = s.model.forward(params, inp, EVAL, **hooks)
            if not layout.last:
                return out
            metrics = s.loss.metrics(out, y)
            return None

        self._run(lower([Action("F", 0)], layout.pp, layout.stage), forward, None)
        for fut, _ in self.sends:  # evaluation waits for its activation to leave
            s.wait_on(self.acc, fut)
        return metrics
