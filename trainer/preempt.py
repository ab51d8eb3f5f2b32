"""Stopping for the scheduler: every rank checkpoints at the same step, then exits with a code.

A scheduler that wants a job's nodes back signals it first: SLURM sends SIGTERM on
``scancel`` and on preemption (KillWait / GraceTime seconds before SIGKILL), and the
signal ``sbatch --signal=USR1@60`` names before the time limit; Open MPI's mpirun
forwards SIGUSR1 to its ranks. The signal reaches some ranks or all of them, each at
its own moment, while they are anywhere in a step. So:

1. While a :class:`Preemption` is entered (``async with Preemption(): await fit(...)``),
   a handler for each of its signals (``RINGWEAVE_PREEMPT_SIGNALS``, default SIGTERM and
   SIGUSR1) only notes the signal's number. A second signal while one is pending takes
   the default action (a user's second kill still kills).
2. At every step boundary the training loop calls :func:`at_step_boundary`. Each rank
   contributes the number of the signal it has noted (0 if none) to an all_reduce (max)
   of one int32 over the whole job, on a group of its own, started at boundary k and
   awaited at boundary k + 1: it runs during step k + 1, so a step waits for it only
   when the step is shorter than the all_reduce. Every rank reads the same answer at the
   same boundary, so all stop after the same step, even a rank that got no signal (one
   step after the signal reached the first rank, at the latest two). Outside a scope:
   no collective at all.
3. If the answer is not 0: the loop's checkpoint is saved (collective and atomic,
   trainer/checkpoint.py: it is committed when ``save`` returns on any rank) and every
   rank raises :class:`Preempted`, whose ``exit_code`` is 128 + the signal (143 for
   SIGTERM, 138 for SIGUSR1, what srun, mpirun and shells report for a process that
   signal ended), or ``RINGWEAVE_PREEMPT_EXIT_CODE``. ``python -m trainer`` exits with
   it; a batch script can requeue itself on it (README: Running on a cluster), and
   ``--resume`` continues from the checkpoint, with the same losses and parameters as a
   run that was never stopped.

Per step this costs the hook's bookkeeping and one 4-byte all_reduce that overlaps the
step (bench/results/preempt.md). Handlers are installed only from the main thread
(Python's rule); elsewhere the scope warns and catches nothing. A rank whose launcher
died (runtime/lifeline.py sends it SIGTERM) is not asked to checkpoint: the signal takes
its default action, since the rank's peers and store may be gone with the launcher.

What it is not: no checkpoint outside step boundaries (a signal during evaluation is
acted on at the next step, or not at all when the run ends first), no requeueing (the
scheduler and the batch script do that), no signals other than those configured.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Awaitable, Callable

import numpy as np

from runtime import env as rwenv
from runtime import lifeline

__all__ = ["Preemption", "Preempted", "at_step_boundary", "active"]

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
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        super().__init__(f"stopped by {name} at a step boundary every rank agreed on"
                         f"{', checkpoint saved' if step_saved else ', no checkpoint (no checkpoint_dir)'}; "
                         f"exit code {exit_code}")


class Preemption:
    """The scope in which preemption signals are caught (see the module docstring).

    ``Preemption(signals=("SIGTERM", "SIGUSR1"))``; ``signals=None`` reads
    ``RINGWEAVE_PREEMPT_SIGNALS``; ``enabled=False`` makes a scope that catches nothing
    (so callers need not branch). Scopes do not nest: entering a second raises.

    Call order: ``__aenter__ -> [signal | at_step_boundary]* -> __aexit__``. On exit the
    handlers are restored, whatever ends the scope, and the agreement still in flight is
    awaited (the scope ended normally: every rank has one) or cancelled (an error).
    """

    def __init__(self, signals: tuple[str, ...] | None = None, *, enabled: bool = True):
        self.signals = tuple(signal.Signals[s] for s in (rwenv.preempt_signals() if signals is None else signals))
        self.enabled = enabled and bool(self.signals)
        self.received = 0  # the first signal noted, 0 if none
        self._previous: dict[signal.Signals, object] = {}
        self._group = None  # the job-wide group of the agreement, made at the first boundary
        self._flag = np.zeros(1, dtype=np.int32)  # (1,) in place: this rank's signal, then the job's max
        self._pending: asyncio.Future | None = None  # the agreement started at the last boundary

    async def __aenter__(self) -> "Preemption":
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
        _active = self
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        global _active
        if _active is self:
            _active = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if exc_type is None:
            await pending
        else:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)

    def _note(self, signum: int, frame) -> None:
        """The handler: note the signal; default action for a second one, or when the launcher died."""
        if self.received or lifeline.launcher_gone():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    async def agreed(self, group) -> int:
        """The signal the job agreed on at this boundary (0: none), from the all_reduce started
        at the last one; starts the next. ``group``: any group of the job (None: one process)."""
        if group is None or group.runtime.world_size == 1:
            return self.received
        if self._group is None:  # every rank of the job is at its first boundary: all make it alike
            world = group.runtime.world
            self._group = world.new_group(world.ranks)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending
            if self._flag[0]:
                return int(self._flag[0])
        self._flag[0] = self.received
        self._pending = asyncio.ensure_future(_all_reduce_max(self._flag, self._group))
        return 0


async def _all_reduce_max(flag: np.ndarray, group) -> None:
    import collectives  # local, as in trainer.loop: the trainer imports without the collectives package

    await collectives.all_reduce(flag, op="max", group=group)


def active() -> Preemption | None:
    """The entered scope of this process, or None."""
    return _active


async def at_step_boundary(group, save: Callable[[], Awaitable[None]] | None) -> None:
    """The training loop's hook after each optimizer step (every rank of the job calls it at
    every step; ``group`` is the loop's, the agreement spans its whole job).

    Without an entered scope: returns at once, no collective. With one: if the job agreed
    that some rank noted a signal, awaits ``save()`` (None: nothing to save) and raises
    :class:`Preempted` on every rank.

    Raises:
        Preempted: a signal was noted on some rank.
        whatever the all_reduce or ``save`` raise (a lost peer, a checkpoint error).
    """
    scope = _active
    if scope is None:
        return
    signum = await scope.agreed(group)
    if not signum:
        return
    if save is not None:
        await save()
    raise Preempted(signum, rwenv.preempt_exit_code(signum), save is not None)
