"""Stopping for the scheduler: every rank checkpoints at the same step, then exits with a code.

A scheduler that wants a job's nodes back signals it first (SLURM's SIGTERM on preemption,
``sbatch --signal=USR1@60`` before the time limit, mpirun forwarding SIGUSR1), reaching some
ranks or all, each anywhere in a step. Inside a :class:`Preemption` scope a handler for each
signal (``RINGWEAVE_PREEMPT_SIGNALS``) only notes it, and a second one takes the default action.
The loop calls :func:`at_step_boundary` after every step; about once a second
(``RINGWEAVE_PREEMPT_CHECK_S``) every rank joins one small all_reduce that says whether any rank
noted a signal, so all ranks read the same answer at the same step, save the checkpoint there and
raise :class:`Preempted`, whose ``exit_code`` is 128 + the signal (143 for SIGTERM). ``--resume``
then continues as if the run had never stopped. Why once a second and not every step:
bench/results/preempt.md#a-check-and-the-steps-between.

    with Preemption():                       # from the main thread; elsewhere it warns, catches nothing
        await fit(strategy, data, config, checkpoint_dir="ckpt", ...)   # raises Preempted

How the checking steps are agreed: docs/design.md, "The trainer: units and strategies"
(**Preemption**). A rank whose launcher died is not asked to checkpoint (runtime/lifeline.py): its
signal takes the default action.

In an elastic job (trainer/leave.py) the same scope notes the signal, and the members agree on it
at every step boundary instead: a rank signalled while enough others stay leaves the job
(:class:`Left`, exit 0); the whole job signalled, or too few left, stops as above.

What it is not: no checkpoint outside step boundaries (a signal during evaluation is acted on at
the next step, or not at all when the run ends first), no requeueing (the scheduler and the batch
script do that), no signals other than those configured.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Awaitable, Callable

import numpy as np

from runtime import env
from runtime import lifeline

__all__ = ["Preemption", "Preempted", "Left", "at_step_boundary", "stop", "active", "noted"]

log = logging.getLogger("ringweave.preempt")

_active: "Preemption | None" = None  # the entered scope of this process, if any


class Preempted(Exception):
    """Raised on every rank at the same step boundary after the checkpoint was saved.

    Attributes:
        signum: the signal (the largest number any rank noted), e.g. 10 for SIGUSR1.
        exit_code: what the process should exit with, e.g. 138.
        step_saved: whether a checkpoint was written (False: the loop had no checkpoint_dir).
    """

    def __init__(self, signum: int, exit_code: int, step_saved: bool):
        self.signum, self.exit_code, self.step_saved = signum, exit_code, step_saved
        super().__init__(f"stopped by {_signal_name(signum)} at a step boundary every rank agreed on"
                         f"{', checkpoint saved' if step_saved else ', no checkpoint (no checkpoint_dir)'}; "
                         f"exit code {exit_code}")


class Left(Exception):
    """Raised on a rank of an elastic job that left it at a step boundary on a signal (its state
    went to the others, who go on without it): the process should exit 0.

    Attributes:
        signum: the signal it got, e.g. 15.
        step: the optimizer steps applied when it left, e.g. 12.
    """

    exit_code = 0

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"left the elastic job on {_signal_name(signum)} after optimizer step {step}; the others "
                         f"go on with its state")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Preemption:
    """The scope in which preemption signals are caught.

    ``Preemption(signals=("SIGTERM", "SIGUSR1"), check_s=1.0)``; ``signals=None`` reads
    ``RINGWEAVE_PREEMPT_SIGNALS``, ``check_s=None`` ``RINGWEAVE_PREEMPT_CHECK_S`` (0: agree
    at every step); ``enabled=False`` makes a scope that catches nothing (so callers need
    not branch). Scopes do not nest: entering a second raises.

    Call order: ``__enter__ -> [signal | at_step_boundary]* -> __exit__`` (the handlers
    are restored on exit, whatever ends the scope).
    """

    def __init__(self, signals: tuple[str, ...] | None = None, *, enabled: bool = True,
                 check_s: float | None = None):
        self.signals = tuple(signal.Signals[s] for s in (env.PREEMPT_SIGNALS.get() if signals is None else signals))
        self.enabled = enabled and bool(self.signals)
        self.check_s = env.PREEMPT_CHECK.get() if check_s is None else check_s  # about this often, e.g. 1.0
        self.received = 0  # the first signal noted, 0 if none
        self._previous: dict[signal.Signals, object] = {}
        self._countdown = 0  # boundaries to pass before the next check (0: check at the next one)
        self._since = time.monotonic()  # when the last check was (or the scope began)
        self._steps = 0  # boundaries since then
        self._flag = np.zeros(2, dtype=np.int64)  # (signal, mean step time in us); in place: the job's max

    def __enter__(self) -> "Preemption":
        global _active
        if not self.enabled:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals are not caught: handlers can only be installed from the main thread")
            self.enabled = False
            return self
        if _active is not None:
            raise RuntimeError("a Preemption scope is already entered in this process")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)
        self._since = time.monotonic()
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if _active is self:
            _active = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        """The handler: note the signal; default action for a second one, or when the launcher died."""
        if self.received or lifeline.launcher_gone():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    async def agreed(self, group) -> int:
        """At a step boundary: the signal the job agreed on (0: none, or not a checking boundary).
        ``group``: any group of the job (its world takes part; None: one process). A check is an
        all_reduce (max) of (the signal noted, the mean step time since the last check); it sets
        the next check ``check_s / slowest mean step`` boundaries later, the same on every rank."""
        self._steps += 1
        if group is None or group.runtime.world_size == 1:
            return self.received
        if self._countdown > 0:
            self._countdown -= 1
            return 0
        now = time.monotonic()
        self._flag[0] = self.received
        self._flag[1] = max(1, int((now - self._since) / self._steps * 1e6))
        import collectives  # local, as in trainer.loop: the trainer imports without the collectives package

        await collectives.all_reduce(self._flag, op="max", group=group.runtime.world)
        if self._flag[0]:
            return int(self._flag[0])
        self._countdown = max(1, int(self.check_s * 1e6 // int(self._flag[1]))) - 1
        self._since, self._steps = now, 0
        return 0


def active() -> Preemption | None:
    """The entered scope of this process, or None."""
    return _active


def noted() -> int:
    """The signal the entered scope noted on this rank (0: none, or no scope)."""
    return _active.received if _active is not None else 0


async def at_step_boundary(group, save: Callable[[], Awaitable[None]] | None) -> None:
    """The training loop's hook after each optimizer step (every rank of the job calls it at
    every step; ``group`` is the loop's, the agreement spans its whole job).

    Without an entered scope: returns at once, no collective. With one: at a checking
    boundary, if the job agreed that some rank noted a signal, awaits ``save()`` (None:
    nothing to save) and raises :class:`Preempted` on every rank.

    Raises:
        Preempted: a signal was noted on some rank.
        whatever the all_reduce or ``save`` raise (a lost peer, a checkpoint error).
    """
    scope = _active
    if scope is None:
        return
    signum = await scope.agreed(group)
    if signum:
        await stop(signum, save)


async def stop(signum: int, save: Callable[[], Awaitable[None]] | None) -> None:
    """Every rank, once the job agreed on ``signum``: awaits ``save()`` (None: nothing to save),
    then raises :class:`Preempted`."""
    if save is not None:
        await save()
    raise Preempted(signum, env.preempt_exit_code(signum), save is not None)
