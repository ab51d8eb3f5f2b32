"""Whether the event loop's thread has run too long without giving its loop a turn.

Collective code runs on the event loop's thread, and a coroutine that never waits on anything
unfinished never hands the loop back: a stream of calls that each complete at once (small
shared-memory calls, frames read straight off the socket), a ring whose segments have all
arrived, a large copy or reduction. Meanwhile every other task of the loop stands still (a
heartbeat, a data loader, the Watchdog's timer). The rule (docs/design.md, "Control plane on the
loop"): between bounded pieces of work, such code asks :meth:`LoopTurns.due` and, when it says
so, awaits ``asyncio.sleep(0)``, which runs one iteration of the loop (every ready callback and
every expired timer) before coming back::

    if turns.due():
        await asyncio.sleep(0)

``due()`` is one clock read. It arms a callback (``call_soon``) when it is asked at least
``TURN_S / 2`` after the loop's last turn; that callback runs at the loop's next iteration, which
is exactly the "the loop had a turn" event, whoever caused it (this code yielding, or any wait on
an unfinished future). So a check costs a clock read, a callback at most every millisecond (calls
of a few microseconds that each let the loop turn would otherwise pay one each), and forces a
yield only when the loop really has not turned for :data:`TURN_S` since it was armed: no other
task waits longer than 1.5 x TURN_S plus one piece of work (between whole calls where the node's
ranks share cores: :data:`SHARED_TURN_S`).

Not here: where the checks are made (runtime/group.py after each call, the Comm's reduce step
(collectives/comm.py), runtime/sharedmem/waits.py between sleeps, the compiled paths' slices).
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref

# The longest the loop's thread runs collective work without a turn, when it can cut the work:
# pieces of work are themselves bounded (a segment's reduction or copy, one wait slice), so the
# loop's other tasks wait at most this plus one piece.
TURN_S = 0.002

# Between whole calls where the node's ranks share cores: there a turn of the loop is a point at
# which the kernel hands the core to another rank, so turns are rarer
# (bench/results/dataplane.md#a-turn-after-every-call-where-ranks-share-cores).
SHARED_TURN_S = 0.025

_clock = time.perf_counter


def call_turn_s(local_ranks: int) -> float:
    """The turn interval between whole calls: TURN_S when this process's cores are at least the
    node's ranks, else SHARED_TURN_S."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return TURN_S if cores >= max(1, local_ranks) else SHARED_TURN_S


class LoopTurns:
    """The turn check of one event loop (:meth:`for_loop` gives each loop its own)."""

    __slots__ = ("_loop", "_due", "_armed", "_quiet_until", "yields")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # (the table below is keyed weakly by the loop)
        self._due = float("inf")  # when the loop, untouched since we armed, has waited too long
        self._armed = False
        self._quiet_until = 0.0  # the loop turned just before this: no need to arm yet
        self.yields = 0  # times a check said "due" (statistics)

    def due(self, turn_s: float = TURN_S) -> bool:
        """True when the loop has had no turn for ``turn_s`` since this was armed (the caller then
        awaits ``asyncio.sleep(0)``)."""
        now = _clock()
        if not self._armed:
            if now < self._quiet_until:
                return False
            self._armed = True
            self._due = now + turn_s
            self._loop().call_soon(self._turned)
            return False
        if now >= self._due:
            self.yields += 1
            return True
        return False

    def _turned(self) -> None:
        self._armed = False
        self._due = float("inf")
        self._quiet_until = _clock() + TURN_S / 2

    @staticmethod
    def for_loop(loop: asyncio.AbstractEventLoop) -> "LoopTurns":
        """The check of ``loop`` (made on first use, kept as long as the loop lives)."""
        turns = _by_loop.get(loop)
        if turns is None:
            turns = _by_loop[loop] = LoopTurns(loop)
        return turns


_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopTurns]" = weakref.WeakKeyDictionary()


_last: LoopTurns | None = None  # the check asked last (one loop per process, nearly always)


def due() -> bool:
    """:meth:`LoopTurns.due` of the running loop (for code that holds no loop; it costs a
    ``get_running_loop``, so it is asked between pieces of real work, not per message)."""
    global _last
    loop = asyncio.get_running_loop()
    turns = _last
    if turns is None or turns._loop() is not loop:
        turns = _last = LoopTurns.for_loop(loop)
    return turns.due()
