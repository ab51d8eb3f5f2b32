"""Whether the event loop's thread has run too long without giving its loop a turn.

Collective code runs on the event loop's thread, and a coroutine that never waits on anything
unfinished never hands the loop back: a stream of calls that each complete at once (small
shared-memory calls, frames read straight off the socket), a ring whose segments have all
arrived, a large copy, reduction, socket read or write. Meanwhile every other task of the loop
stands still (a heartbeat, a data loader, the Watchdog's timer). The rule (docs/design.md, "The
loop's turns"): bulk work goes in pieces of at most :data:`PIECE_NBYTES` of memory traffic
(:func:`piece_items`), and after each piece the code asks :func:`overdue` and, when it says so,
awaits :func:`yield_turn`, which comes back once what the loop woke meanwhile has run::

    for lo in range(0, n, step):
        work(lo, lo + step)
        if turns.overdue():
            await turns.yield_turn()

A check is one clock read; at most every ``TURN_S / 2`` it arms a callback (``call_soon``) that
runs at the loop's next iteration and records that turn, whoever caused it (this code yielding,
or any wait on an unfinished future). :func:`overdue` says yes once no turn has been recorded for
:data:`TURN_S`, so the loop turns at least every TURN_S plus a piece (per callback of that
iteration); a wait that blocks its thread sleeps at most :func:`left`. Between whole calls
runtime/group.py asks the looser :meth:`LoopTurns.due` (up to 1.5 x its interval, never a yield
right after a wait that turned the loop unseen; :data:`CALL_TURN_S`, or :data:`SHARED_TURN_S`
where ranks share cores).

Not here: where the checks are made (runtime/group.py after each call, the Comm's steps
(collectives/comm.py), the shared-memory pieces (collectives/slots/common.py), the TCP
connection's reads and writes (runtime/transport.py, frame_protocol.py), the shared-memory waits
(runtime/sharedmem/waits.py), the compiled paths' slices).
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref

# The longest the loop's thread runs collective work without a turn, when it can cut the work:
# pieces of work are themselves bounded (PIECE_NBYTES, one wait slice), so the loop's other tasks
# wait at most this plus one piece (docs/design.md, "The loop's turns": 1 ms, not 2).
TURN_S = 0.001

# Between whole calls that each waited on nothing (small calls back to back), where the node's
# cores are at least its ranks: a turn costs such a call's latency, so this stays at 2 ms.
CALL_TURN_S = 0.002

# The memory one piece of bulk work on the loop's thread reads and writes at most: a copy of 2 MiB,
# a reduction of about 1 MiB, a socket read or write of 2 MiB (the kernel copies it once). 0.1-1 ms
# of work on a loaded 2-core machine (bench/results/dataplane.md#the-loops-turns); a yield between
# pieces costs microseconds.
PIECE_NBYTES = 4 << 20

# Between whole calls where the node's ranks share cores: there a turn of the loop is a point at
# which the kernel hands the core to another rank, so turns are rarer
# (bench/results/dataplane.md#a-turn-after-every-call-where-ranks-share-cores).
SHARED_TURN_S = 0.025

_clock = time.perf_counter


def call_turn_s(local_ranks: int) -> float:
    """The turn interval between whole calls: CALL_TURN_S when this process's cores are at least
    the node's ranks, else SHARED_TURN_S."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return CALL_TURN_S if cores >= max(1, local_ranks) else SHARED_TURN_S


def piece_items(itemsize: int, arrays: int = 2) -> int:
    """Elements in one piece of bulk work that reads or writes ``arrays`` arrays of ``itemsize``
    bytes once per element (a copy: 2; ``dst <op>= src``: 3): :data:`PIECE_NBYTES` of traffic, in
    whole pages (4 KiB) where a piece holds several (the pieces of a page-aligned array stay aligned)."""
    items = PIECE_NBYTES // max(1, arrays * itemsize)
    page = 4096 // itemsize if 0 < itemsize <= 4096 else 1
    if items > page:
        items -= items % page
    return max(1, items)


class LoopTurns:
    """The turn check of one event loop (:meth:`for_loop` gives each loop its own)."""

    __slots__ = ("_loop", "_due", "_armed", "_quiet_until", "_turn_at", "yields", "hops", "yielding")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # (the table below is keyed weakly by the loop)
        self._due = float("inf")  # when the loop, untouched since we armed, has waited too long
        self._armed = False
        self._quiet_until = 0.0  # the loop turned just before this: no need to arm yet
        self._turn_at = 0.0  # the last turn recorded (0: none yet, so the first overdue() yields)
        self.yields = 0  # times a check said "due" or "overdue" (statistics)
        # loop iterations a yield_turn waits: uvloop runs its timers before the ready queue, so what
        # a timer or a socket woke is queued behind the first yield and runs before the second;
        # asyncio's own loop runs due timers as ready callbacks, a hop later
        self.hops = 2 if type(loop).__module__.startswith("uvloop") else 3
        self.yielding = 0  # tasks inside yield_turn now: every other check says overdue meanwhile

    def due(self, turn_s: float = CALL_TURN_S) -> bool:
        """True when the loop has had no turn for ``turn_s`` since this was armed (the caller then
        awaits :func:`yield_turn`)."""
        now = _clock()
        if not self._armed:
            if now < self._quiet_until:
                return False
            self._arm(now, turn_s)
            return False
        if now >= self._due:
            self.yields += 1
            return True
        return False

    def left(self) -> float:
        """Seconds until a turn is overdue: :data:`TURN_S` after the last turn recorded (<= 0: it
        is overdue now). Arms the record of the next turn."""
        now = _clock()
        if not self._armed and now >= self._quiet_until:
            self._arm(now, TURN_S)
        return TURN_S - (now - self._turn_at)

    def overdue(self) -> bool:
        """True when no turn has been recorded for :data:`TURN_S` (the caller, between pieces of
        bulk work, then awaits :func:`yield_turn`). Right after a wait that turned the loop
        unseen it may say yes once too often: a yield costs microseconds."""
        if self.left() <= 0.0 or self.yielding:
            self.yields += 1
            return True
        return False

    def _arm(self, now: float, turn_s: float) -> None:
        loop = self._loop()
        if loop is None:  # pragma: no cover - the loop is gone
            return
        self._armed = True
        self._due = now + turn_s
        loop.call_soon(self._turned)

    def _turned(self) -> None:
        now = _clock()
        self._armed = False
        self._due = float("inf")
        self._turn_at = now
        self._quiet_until = now + TURN_S / 2

    @staticmethod
    def for_loop(loop: asyncio.AbstractEventLoop) -> "LoopTurns":
        """The check of ``loop`` (made on first use, kept as long as the loop lives)."""
        turns = _by_loop.get(loop)
        if turns is None:
            turns = _by_loop[loop] = LoopTurns(loop)
        return turns


_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopTurns]" = weakref.WeakKeyDictionary()


_last: LoopTurns | None = None  # the check asked last (one loop per process, nearly always)


def _running() -> LoopTurns:
    global _last
    loop = asyncio.get_running_loop()
    turns = _last
    if turns is None or turns._loop() is not loop:
        turns = _last = LoopTurns.for_loop(loop)
    return turns


async def yield_turn() -> None:
    """A turn of the running loop that lets every task it woke meanwhile (a timer, a socket, a
    ``call_soon``) run before the caller goes on. One ``asyncio.sleep(0)`` queues the caller ahead
    of what the next iteration's timers and sockets wake, so those tasks would wait through one more
    stretch of the caller's work (two TURN_S in a row); the caller yields again behind them. Until
    it is back, :func:`overdue` says yes to every check, so a second task of ours (a send beside a
    reduction) does one piece and yields too instead of running its own TURN_S first."""
    turns = _running()
    turns.yielding += 1  # our other tasks queued ahead of the woken ones stop after a piece too
    try:
        for _ in range(turns.hops):
            await asyncio.sleep(0)
    finally:
        turns.yielding -= 1


def due() -> bool:
    """:meth:`LoopTurns.due` of the running loop (for code that holds no loop; it costs a
    ``get_running_loop``, so it is asked between pieces of real work, not per message)."""
    return _running().due()


def overdue() -> bool:
    """:meth:`LoopTurns.overdue` of the running loop (between pieces of bulk work)."""
    return _running().overdue()


def left() -> float:
    """:meth:`LoopTurns.left` of the running loop (how long a wait that blocks the thread may sleep)."""
    return _running().left()
