"""Point-to-point: ``send`` and ``recv`` of NumPy arrays between two ranks of a group, async.

    await send(x, dst=1, tag=7)
    src = await recv(x, src=0, tag=7)           # returns the source's group rank
    src = await recv(x, src=None, tag=7)        # from whichever rank sends first (MPI's ANY_SOURCE)
    src = await sendrecv(x, dst, out, src)      # both at once: a ring shift cannot deadlock
    st = await probe(src=None, tag=7)           # waits for a message; st.source/.dtype/.shape
    st = iprobe(src=0, tag=None)                # one waiting now (any tag), or None; takes nothing

Messages from one rank to another under one tag are received in the order sent; tags are
separate queues. Every message carries the sender's dtype and shape, and ``recv`` checks them
against its buffer before a byte lands in it: a different dtype or shape raises
:class:`MessageMismatchError` (a ValueError) naming both, never bits read as another type.
``src`` and ``dst`` are **group ranks** (``group.group_rank(world_rank)``), as everywhere in
the collectives.

A receive from any source takes the first message under its tag from a rank that has no
receive of its own posted for it (messages kept before it was posted count, the longest kept
first). A lost peer does not end it (another may still send); its timeout does.

Not here: the collectives (api.py), the mailbox matching and its kept frames (runtime/mailbox.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from collectives import ops
from collectives.calls import group_of
from collectives.tensors import takes_tensors
from runtime.errors import CollectiveTimeoutError, MessageMismatchError, PeerLostError, ranks_in_words
from runtime.group import check_timeout

__all__ = ["send", "recv", "sendrecv", "probe", "iprobe", "Status"]


def _p2p_tag(group, tag) -> tuple:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag must be an int, got {type(tag).__name__} {tag!r}")
    return ("p2p", group.gid, int(tag))


def _peer(group, name: str, peer) -> int:
    peer = ops.check_root(name, peer, group.size)
    if peer == group.rank:
        raise ValueError(f"{name}={peer} is this rank itself")
    if group.error is not None:
        raise group.error
    return group.ranks[peer]


def _describe(dtype: str, shape) -> str:
    return f"{dtype} {tuple(shape)}"


def _fits(x: np.ndarray, tag: int):
    """The check a receive into ``x`` runs on each message's header before taking it (the actor
    calls it with the header, the payload size and the sender's global rank)."""
    mine = (x.dtype.name, tuple(x.shape))

    def check(header: dict, nbytes: int, peer: int):
        meta = header.get("m")
        if meta is None:  # not from send(): sizes are still checked where the bytes land
            return None
        try:  # [dtype name, shape] (msgpack may hand the arrays back as tuples)
            theirs = (str(meta[0]), tuple(int(d) for d in meta[1]))
        except (TypeError, ValueError, IndexError):
            theirs = ("?", ())
        if theirs != mine:
            return MessageMismatchError(
                f"rank {peer} sent {_describe(*theirs)} ({nbytes} bytes) under tag {tag}; the receive buffer "
                f"is {_describe(*mine)} ({x.nbytes} bytes)")
        return None
    return check


@takes_tensors(reads=("x",))
async def send(x: np.ndarray, dst: int, tag: int = 0, group=None, timeout: float | None = None) -> None:
    """Sends ``x`` to group rank ``dst`` under ``tag``; returns when ``x`` may be reused.

    Example (2 ranks)::

        # Rank 0: await send(np.array([1, 2]), dst=1)
        # Rank 1: x = np.empty(2, np.int64); await recv(x, src=0)   -> x = [1 2]
    """
    timeout = check_timeout(timeout)  # first: a bad one fails here on every rank alike (api.py)
    group = group_of(group)
    ops.check_array("x", x, writeable=False)
    key, peer = _p2p_tag(group, tag), _peer(group, "dst", dst)
    actor, payload = group.runtime.actor, ops.as_bytes(x)
    timeout = group.runtime.timeout_s if timeout is None else timeout
    try:
        await actor.send(peer, key, payload, meta=[x.dtype.name, list(x.shape)], timeout_s=timeout)
    except TimeoutError:
        raise CollectiveTimeoutError(f"rank {group.runtime.rank}: send to rank {peer} (tag {tag}) timed out after "
                                     f"{timeout:.1f} s", missing=[peer]) from None


@takes_tensors(writes=("x",))
async def recv(x: np.ndarray, src: int | None = None, tag: int = 0, group=None, timeout: float | None = None) -> int:
    """Receives into ``x`` what group rank ``src`` (None: any rank) sent under ``tag``; returns
    the source's group rank (as ``torch.distributed.recv`` does).

    Raises:
        MessageMismatchError: the message's dtype or shape differs from ``x``'s (a ValueError).
        PeerLostError: ``src`` went away. CollectiveTimeoutError: nothing came in time.
    """
    timeout = check_timeout(timeout)
    group = group_of(group)
    ops.check_array("x", x)
    key = _p2p_tag(group, tag)
    actor, buf = group.runtime.actor, ops.as_bytes(x)
    timeout = group.runtime.timeout_s if timeout is None else timeout
    if src is None:
        return await _recv_any(group, x, key, tag, timeout)
    peer = _peer(group, "src", src)
    fut = actor.post((peer, key), peer, buf, _fits(x, tag))
    try:
        await actor.wait_posted((peer, key), peer, fut, timeout)
    except TimeoutError:
        kept = {t[2]: v for t, v in actor.kept_from(peer).items()
                if isinstance(t, tuple) and t[:2] == ("p2p", group.gid)}
        hint = ("; waiting unreceived from it: " + ", ".join(  # the usual cause: the sender used another tag
            f"{frames} message(s), {nbytes} bytes, under tag {t}" for t, (frames, nbytes) in sorted(kept.items()))
            if kept else "")
        raise CollectiveTimeoutError(f"rank {group.runtime.rank}: recv from rank {peer} (tag {tag}) timed out after "
                                     f"{timeout:.1f} s{hint}", missing=[peer]) from None
    return src


async def _recv_any(group, x: np.ndarray, key: tuple, tag: int, timeout: float) -> int:
    if group.rank < 0:
        raise ValueError(f"rank {group.runtime.rank} is not a member of group {group.gid} {group.ranks}")
    if group.error is not None:
        raise group.error
    actor = group.runtime.actor
    others = [r for r in group.ranks if r != group.runtime.rank]
    lost = actor.lost_peers()
    if others and all(r in lost for r in others):
        raise PeerLostError(f"rank {group.runtime.rank}: recv from any rank (tag {tag}): every other rank of "
                            f"group {group.gid} is gone", others[0])
    posted = actor.post_any(key, ops.as_bytes(x), _fits(x, tag))
    try:
        await actor.wait_posted((None, key), None, posted.fut, timeout)
    except TimeoutError:
        raise CollectiveTimeoutError(f"rank {group.runtime.rank}: recv from any rank of group {group.gid} "
                                     f"(tag {tag}) timed out after {timeout:.1f} s", missing=others) from None
    return group.ranks.index(posted.src)


@takes_tensors(writes=("out",), reads=("x",))
async def sendrecv(x: np.ndarray, dst: int, out: np.ndarray, src: int | None = None, *, tag: int = 0,
                   recv_tag: int | None = None, group=None, timeout: float | None = None) -> int:
    """Sends ``x`` to group rank ``dst`` under ``tag`` and receives into ``out`` what ``src``
    (None: any rank) sent under ``recv_tag`` (default ``tag``), both at once, as MPI_Sendrecv:
    the receive is posted while the send goes out, so every rank of a ring may call it together.
    Returns the source's group rank. ``dst == src ==`` this rank copies ``x`` into ``out``.

    Example (3 ranks, a shift to the right)::

        x = np.array([rank]); out = np.empty(1, np.int64)
        await sendrecv(x, (rank + 1) % 3, out, (rank - 1) % 3)
        # Rank 0: out = [2]   Rank 1: out = [0]   Rank 2: out = [1]

    Raises:
        as :func:`send` and :func:`recv`; whichever fails first (the other is withdrawn).
        ValueError: ``x`` and ``out`` share memory, or only one of ``dst``, ``src`` is this rank.
    """
    timeout = check_timeout(timeout)
    group = group_of(group)
    ops.check_array("x", x, writeable=False)
    ops.check_array("out", out)
    ops.check_no_overlap("sendrecv", "out", out, "x", x)
    recv_tag = tag if recv_tag is None else recv_tag
    if dst == group.rank and src == group.rank:  # a shift on one rank
        _p2p_tag(group, tag)
        _p2p_tag(group, recv_tag)  # (both checked, as the two halves would)
        if recv_tag != tag or (x.dtype, x.shape) != (out.dtype, out.shape):
            raise MessageMismatchError(f"sendrecv to this rank itself: sends {_describe(x.dtype.name, x.shape)} "
                                       f"under tag {tag}, receives {_describe(out.dtype.name, out.shape)} under "
                                       f"tag {recv_tag}")
        out[...] = x
        return group.rank
    sending = asyncio.ensure_future(send(x, dst, tag, group, timeout))
    receiving = asyncio.ensure_future(recv(out, src, recv_tag, group, timeout))
    await asyncio.wait((sending, receiving), return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in (sending, receiving) if t.done() and t.exception() is not None]
    if failed:
        for t in (sending, receiving):
            t.cancel()
        await asyncio.gather(sending, receiving, return_exceptions=True)
        raise failed[0].exception()
    return receiving.result()


@dataclass(frozen=True)
class Status:
    """A message waiting to be received (:func:`probe`, :func:`iprobe`), as MPI_Status."""
    source: int  # the sender's group rank
    tag: int
    nbytes: int  # payload bytes
    dtype: np.dtype | None  # None: not sent by send() (no dtype or shape travelled with it)
    shape: tuple[int, ...] | None

    @property
    def count(self) -> int | None:
        """Elements of ``dtype`` (MPI_Get_count); None without a dtype."""
        return None if self.dtype is None else self.nbytes // self.dtype.itemsize


_DTYPES = {d.name: d for d in ops.DTYPES}


def iprobe(src: int | None = None, tag: int | None = 0, group=None) -> Status | None:
    """The message :func:`recv` from ``src`` (None: any rank) under ``tag`` (None: any tag) would
    take now, without taking it; None when none has arrived. Never waits.

    Example (2 ranks)::

        # Rank 1: await send(np.zeros((2, 3), np.float32), dst=0, tag=4)
        # Rank 0: st = iprobe(src=1, tag=4)  -> None, or Status(source=1, tag=4, nbytes=24,
        #         dtype=float32, shape=(2, 3)); then x = np.empty(st.shape, st.dtype); await recv(x, 1, 4)
    """
    group = group_of(group)
    found = _peek(group, src, tag)
    return None if found is None else _status(group, *found)


async def probe(src: int | None = None, tag: int | None = 0, group=None, timeout: float | None = None) -> Status:
    """Waits for the message :func:`iprobe` would find and returns its :class:`Status`; the message
    stays for :func:`recv`.

    Raises:
        CollectiveTimeoutError: none arrived within ``timeout`` (default: the runtime's).
        PeerLostError: ``src`` is gone (any source: every other rank of the group is) and
            nothing of it is waiting.
    """
    timeout = check_timeout(timeout)
    group = group_of(group)
    runtime = group.runtime
    timeout = runtime.timeout_s if timeout is None else timeout
    mailbox = runtime.actor.mailbox
    deadline = time.monotonic() + timeout
    while True:
        found = _peek(group, src, tag)
        if found is not None:
            return _status(group, *found)
        _check_alive(group, src, tag)
        try:
            await mailbox.wait_kept(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            who = "any rank" if src is None else f"rank {group.ranks[src]}"
            raise CollectiveTimeoutError(
                f"rank {runtime.rank}: probe for a message from {who} of group {group.gid} "
                f"({'any tag' if tag is None else f'tag {tag}'}) timed out after {timeout:.1f} s",
                missing=[r for r in group.ranks if r != runtime.rank] if src is None else [group.ranks[src]]) from None


def _peek(group, src, tag) -> tuple | None:
    """(peer, tag, header, nbytes) of the first message kept for this group from ``src`` under
    ``tag`` (None: any), or None."""
    if tag is not None:
        _p2p_tag(group, tag)
    peer = None if src is None else _peer(group, "src", src)
    gid = group.gid
    if tag is None:
        def match(t) -> bool:
            return type(t) is tuple and len(t) == 3 and t[0] == "p2p" and t[1] == gid
    else:
        key = _p2p_tag(group, tag)

        def match(t) -> bool:
            return t == key
    return group.runtime.actor.mailbox.peek(peer, match)


def _status(group, peer: int, tag: tuple, header: dict, nbytes: int) -> Status:
    meta = header.get("m")
    dtype = shape = None
    if meta is not None:
        try:  # [dtype name, shape], as send() writes it
            dtype, shape = _DTYPES.get(str(meta[0])), tuple(int(d) for d in meta[1])
        except (TypeError, ValueError, IndexError):
            dtype = shape = None
    return Status(source=group.ranks.index(peer), tag=tag[2], nbytes=nbytes, dtype=dtype,
                  shape=shape if dtype is not None else None)


def _check_alive(group, src, tag) -> None:
    """Raises when nothing can come any more: the group failed, or the source (any source:
    every other member) is gone."""
    if group.error is not None:
        raise group.error
    actor = group.runtime.actor
    lost = actor.lost_peers()
    others = [r for r in group.ranks if r != actor.rank] if src is None else [group.ranks[src]]
    if others and all(r in lost for r in others):
        raise PeerLostError(f"rank {actor.rank}: probe (tag {tag}): {ranks_in_words(others)} of group {group.gid} "
                            f"gone", others[0])
