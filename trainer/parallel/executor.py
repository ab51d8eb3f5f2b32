"""Running a pipeline schedule on one stage: forwards, backwards, and the activations and their
gradients sent between stages, on the strategy's compute thread.

What it is: `StageRun(strategy, chunks, denominator, scale).train()` runs the stage's list of
compute actions (schedules.py) for one optimizer step and returns the stage's loss sum;
`.evaluate(x, y)` runs one forward through the pipeline and returns the metric sums on every
stage. The strategy's hooks (trainer/sharding: fsdp's gathers, zero2's gradient buffers, the
data-parallel reduction at grad_ready) run as in data-parallel training: a forward takes the
forward hooks, a backward the backward hooks, and the stage's LAST backward (B of the last
micro-batch, in both schedules) is the one that reduces gradients across dp.

    F j:  input = the tokens (first stage) or the activation received from stage s - 1
          out, tape = model.forward_tape(stage calls)          # kept until B j (checkpointed
                                                               # calls keep only their input)
          last stage: loss_j, dlogits_j = loss(out, y_j)       # the loss's gradient waits for B j
          else:       send(out, stage + 1, tag 2 j)            # launched: travels while we compute
    B j:  dout = dlogits_j (last stage) or the gradient received from stage s + 1
          dx = model.backward_tape(tape_j, dout)               # frees the tape as it goes
          first stage: nothing to send; else send(dx, stage - 1, tag 2 j + 1)

Point-to-point (collectives/p2p.py through the strategy's AccountedCollectives on the pp
group): every send is launched on the event loop and not waited for (the array stays
referenced until it has left; nothing is copied: the transport writes from it); every
receive is posted before its message can arrive, into the buffer the action computes on, so
it lands there straight off the connection (a message that finds no receive is kept and
copied once more):

    gradient of j     posted right after F j: the next stage can only send it after that
    activation of j   posted while j < backwards done + peak + 2, peak = the schedule's most
                      micro-batches in flight (1F1B: pp - stage; GPipe: m, so all at once): the
                      stage before runs at most one forward ahead of its own bound, which is
                      this stage's plus one (the receive buffers are activations held anyway)

Receives are posted when the step starts, so a stage still finishing its previous step (its
optimizer update) when its neighbour already sends finds those first messages kept: one copy
each (pp = 4, m = 8, ranks as tasks of one process: none to two activations a step per rank under
1F1B; under GPipe the first stage, which waits on nothing, sent all m before the next one started).

The time the compute thread blocks on a receive is the stage's measured bubble (it includes the
transfer itself, small beside the compute).

Micro-batch j's Context has batch_offset = the row of its first sample in the step's global
batch, so dropout masks, and the whole step, are the single-process ones.

What it is not: no schedule of its own (schedules.py), no collectives across dp or tp
(the hooks and layers run those).
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from trainer.nn import EVAL, Context
from trainer.parallel.schedules import in_flight_peak, schedule

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
        self.recvs: dict[tuple[str, int], tuple[concurrent.futures.Future, np.ndarray]] = {}
        self.sends: list[tuple[concurrent.futures.Future, np.ndarray]] = []
        self.wait_s = 0.0  # blocked on receives (the bubble, with the transfers)
        self.in_flight_peak = 0  # micro-batches whose forward ran and backward did not, at most
        self._posted_f = 0  # activation receives posted: micro-batches [0, _posted_f)

    # ---- point to point --------------------------------------------------------------

    def _shape(self, j: int) -> tuple[int, ...]:
        x = self.chunks[j][0]
        return (*x.shape, self.s.config_model.n_embd)  # (B_j, T, C): every stage's output

    def _post(self, kind: str, j: int) -> None:
        """Posts the receive of micro-batch j's activation ("F") or gradient ("B")."""
        if (kind, j) in self.recvs:
            return
        buf = np.empty(self._shape(j), self.s.activation_dtype)
        src, tag = (self.layout.stage - 1, 2 * j) if kind == "F" else (self.layout.stage + 1, 2 * j + 1)
        self.recvs[(kind, j)] = (self.acc.launch(self.acc.recv(buf, src, tag)), buf)

    def _take(self, kind: str, j: int) -> np.ndarray:
        self._post(kind, j)
        fut, buf = self.recvs.pop((kind, j))
        t0 = time.perf_counter()
        try:
            self.s.wait_on(self.acc, fut)
        finally:
            self.wait_s += time.perf_counter() - t0
        return buf

    def _send(self, x: np.ndarray, dst: int, tag: int) -> None:
        x = np.ascontiguousarray(x, dtype=self.s.activation_dtype)  # a copy only if a layer changed dtype
        self.sends = [(f, a) for f, a in self.sends if not f.done()]  # what has left is let go
        self.sends.append((self.acc.launch(self.acc.send(x, dst, tag)), x))

    def _post_forwards(self, upto: int) -> None:
        """Posts the activation receives of micro-batches below ``upto`` (module docstring)."""
        if not self.layout.first:
            for j in range(self._posted_f, min(upto, len(self.chunks))):
                self._post("F", j)
            self._posted_f = max(self._posted_f, min(upto, len(self.chunks)))

    # ---- the step ------------------------------------------------------------------------

    def train(self) -> float:
        s, layout = self.s, self.layout
        model, loss_fn = s.model, s.loss
        m = len(self.chunks)
        actions = schedule(s.parallel.schedule, layout.pp, layout.stage, m)
        last_b = max(k for k, a in enumerate(actions) if a.kind == "B")
        params, grads = s._compute_params(), s._grad_list()
        s.meter.clear()  # what a failed step may have left
        tapes, dlogits, tickets = {}, {}, {}
        loss, backwards = 0.0, 0
        checkpoint = s.config.activation_checkpointing
        ahead = in_flight_peak(actions) + 2  # activation receives posted ahead (module docstring)
        self._post_forwards(ahead)
        for k, a in enumerate(actions):
            x, y, offset = self.chunks[a.mb]
            if a.kind == "F":
                inp = x if layout.first else self._take("F", a.mb)
                hooks = s._hooks(False, params, grads)
                ctx = Context(training=True, seed=s.config.seed, step=s.step, batch_offset=int(offset))
                out, tapes[a.mb] = model.forward_tape(
                    params, inp, ctx, checkpoint=checkpoint, meter=s.meter,
                    before_unit_forward=hooks.get("before_unit_forward"),
                    after_unit_forward=hooks.get("after_unit_forward"))
                self.in_flight_peak = max(self.in_flight_peak, len(tapes))
                if layout.last:
                    value, dlogits[a.mb] = loss_fn.forward_backward(out, y, self.denominator, self.scale)
                    loss += value
                    tickets[a.mb] = s.meter.hold((out, dlogits[a.mb]))
                else:
                    self._send(out, layout.stage + 1, 2 * a.mb)
                    self._post("B", a.mb)  # its gradient can come back from now on
                del out
            else:
                dout = dlogits.pop(a.mb) if layout.last else self._take("B", a.mb)
                sync = k == last_b
                hooks = s._hooks(sync, params, grads)
                if sync:
                    s._with_injection(hooks, grads)
                dx = model.backward_tape(
                    params, grads, tapes.pop(a.mb), dout, grads_zero=backwards == 0, meter=s.meter,
                    before_unit_backward=hooks.get("before_unit_backward"),
                    after_unit_backward=hooks.get("after_unit_backward"), grad_ready=hooks.get("grad_ready"),
                    release_after_first=tickets.pop(a.mb, None))
                backwards += 1
                self._post_forwards(backwards + ahead)
                if not layout.first:
                    self._send(dx, layout.stage - 1, 2 * a.mb + 1)
                del dout, dx
        return loss

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float] | None:
        """One forward through the pipeline; the metric sums on the last stage (None elsewhere)."""
        s, layout = self.s, self.layout
        self.chunks = [(x, y, 0)]
        params = s._compute_params()
        hooks = s._eval_hooks(params)
        if layout.first:
            inp = x
        else:
            inp = np.empty(self._shape(0), s.activation_dtype)
            self.s.wait_on(self.acc, self.acc.launch(self.acc.recv(inp, layout.stage - 1, EVAL_TAG)))
        out = s.model.forward(params, inp, EVAL, **hooks)
        if not layout.last:
            out = np.ascontiguousarray(out, dtype=s.activation_dtype)  # what the next stage posted, as in _send
            self.s.wait_on(self.acc, self.acc.launch(self.acc.send(out, layout.stage + 1, EVAL_TAG)))
            return None
        return s.loss.metrics(out, y)
