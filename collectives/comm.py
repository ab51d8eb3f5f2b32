"""What an algorithm talks through: the :class:`Comm` protocol, :class:`SubComm` (a Comm over some
of a call's ranks), and the Comm's steps of bulk work, :func:`reduce_step` and :func:`copy_step`.

Every algorithm file exports ``async def run(comm, ...)``; ``comm`` is one collective call seen
from one rank: ``runtime.group.Call`` (what collectives/calls.py opens and hands to the algorithm)
or a :class:`SubComm` of one (e.g. the leaders of the hierarchical all_reduce, one per host).
Algorithms use only the members below, so any object that has them can run one.

The event loop is the Comm's business, not the algorithm's: a message that must wait hands the
loop back by itself, and one that has already arrived does not, so a step that waited on nothing
(segments that all arrived at once) ends with :func:`give_turn`, which yields to the loop when it
has gone without a turn for ``runtime.turns.TURN_S``. An algorithm reduces (and copies whole
blocks) through :func:`reduce_step` (:func:`copy_step`), which cut the work into pieces of
``runtime.turns.PIECE_NBYTES`` of memory traffic and give a turn after each; the shared-memory
pieces (collectives/slots/common.py) call :func:`give_turn`. No algorithm asks the loop itself.

Not here: choosing the algorithm (registry.py), opening the call (calls.py), the frames and the
matching behind ``send``/``irecv`` (runtime/group.py ``Call``), the turn check (runtime/turns.py).
"""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

import numpy as np

from collectives.ops import as_bytes, reduce_now
from collectives.tuning import SEGMENT_NBYTES
from runtime import turns

__all__ = ["Comm", "SubComm", "copy_step", "give_turn", "reduce_step", "segments", "send_segments"]


@runtime_checkable
class Comm(Protocol):
    """One collective call, as the algorithm running it on one rank sees it.

    Ranks are this call's ranks, 0..size-1; buffers are bytes-like (memoryviews of arrays),
    received into at their exact length. Messages between one pair of ranks are matched in
    the order they are sent, and each is checked against the receiver's ``fingerprint``.
    """

    rank: int  # this rank, 0..size-1
    size: int  # ranks in the call
    group: object  # the runtime.group.ProcessGroup the call runs on (shared-memory domains are per group)
    seq: int  # the call's sequence number on its group, the same on every rank
    fingerprint: str  # what the call is, e.g. "all_reduce op=sum dtype=float32 count=1000 algo=ring"

    async def send(self, dst: int, buf) -> None:
        """Sends ``buf`` to rank ``dst``; returns when ``buf`` may be reused."""

    def irecv(self, src: int, buf) -> asyncio.Future:
        """Posts a receive from rank ``src`` into ``buf``; returns a future to await."""

    async def recv_into(self, src: int, buf) -> None:
        """``await irecv(src, buf)``."""

    async def sendrecv(self, dst: int | None, sbuf, src: int, rbuf) -> None:
        """Sends ``sbuf`` to ``dst`` (None: nothing) and receives ``src``'s message into ``rbuf``."""


class SubComm:
    """The ranks ``members`` of ``comm`` (a :class:`Comm`), renumbered 0..len-1, so that an existing
    algorithm can run among them (e.g. one leader per host). Its messages are the call's own (same
    tag and fingerprint), so they are matched in order and checked like any other.

    >>> # comm of 4 ranks, members [0, 2]: rank 2 of comm is rank 1 of the SubComm
    """

    __slots__ = ("comm", "members", "rank", "size", "group", "seq", "fingerprint")

    def __init__(self, comm: Comm, members: list[int]):
        self.comm = comm
        self.members = list(members)
        self.rank = self.members.index(comm.rank)
        self.size = len(self.members)
        self.group = comm.group
        self.seq = comm.seq
        self.fingerprint = comm.fingerprint

    async def send(self, dst: int, buf) -> None:
        await self.comm.send(self.members[dst], buf)

    def irecv(self, src: int, buf) -> asyncio.Future:
        return self.comm.irecv(self.members[src], buf)

    async def recv_into(self, src: int, buf) -> None:
        await self.comm.recv_into(self.members[src], buf)

    async def sendrecv(self, dst: int | None, sbuf, src: int, rbuf) -> None:
        await self.comm.sendrecv(None if dst is None else self.members[dst], sbuf, self.members[src], rbuf)


async def reduce_step(dst: np.ndarray, src: np.ndarray, op: str) -> None:
    """``dst = dst <op> src`` (``ops.reduce_now``: a kernel op, 1-D arrays of one dtype and
    length), in pieces of ``runtime.turns.piece_items`` elements with :func:`give_turn` after
    each: every reduction of a received segment into an algorithm's own. Element by element the
    same as one ``reduce_now`` over the whole (the same bits)."""
    step = turns.piece_items(dst.itemsize, 3)  # reads dst and src, writes dst
    if dst.size <= step:  # (the usual segment of a small call: no slicing)
        reduce_now(dst, src, op)
        await give_turn()
        return
    for lo in range(0, dst.size, step):
        reduce_now(dst[lo:lo + step], src[lo:lo + step], op)
        await give_turn()


async def copy_step(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (1-D, one dtype and length), in pieces as :func:`reduce_step`: an
    algorithm's copy of a whole block (its own block into an all_gather's output)."""
    step = turns.piece_items(dst.itemsize, 2)  # reads src, writes dst
    if dst.size <= step:
        np.copyto(dst, src)
        await give_turn()
        return
    for lo in range(0, dst.size, step):
        np.copyto(dst[lo:lo + step], src[lo:lo + step])
        await give_turn()


def segments(a: np.ndarray) -> list[np.ndarray]:
    """``a`` (1-D) cut into messages of at most ``tuning.SEGMENT_NBYTES`` (both ends of a message
    cut the same way; an array of at most one segment is one message). A message that arrives
    before its receive is kept in a buffer of its size that the loop's thread allocates and
    later copies out, so an algorithm that reduces as it receives sends no larger one."""
    step = max(1, SEGMENT_NBYTES // a.itemsize)
    return [a[i:i + step] for i in range(0, a.size, step)] or [a]


async def send_segments(comm: Comm, dst: int, a: np.ndarray) -> None:
    """Sends ``a`` to ``dst`` as :func:`segments`, one after the other."""
    for seg in segments(a):
        await comm.send(dst, as_bytes(seg))


async def give_turn() -> None:
    """Yields to the event loop when a turn is overdue (``runtime.turns.overdue()``: one clock
    read), so the loop's other tasks still run while pieces of work that wait on nothing follow
    each other."""
    if turns.overdue():
        await turns.yield_turn()
