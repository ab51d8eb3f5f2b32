"""Point-to-point: ``send`` and ``recv`` of NumPy arrays between two ranks of a group, async.

    await send(x, dst=1, tag=7)
    src = await recv(x, src=0, tag=7)           # returns the source's group rank
    src = await recv(x, src=None, tag=7)        # from whichever rank sends first (MPI's ANY_SOURCE)

Messages from one rank to another under one tag are received in the order sent; tags are
separate queues. Every message carries the sender's dtype and shape, and ``recv`` checks them
against its buffer before a byte lands in it: a different dtype or shape raises
:class:`MessageMismatchError` (a ValueError) naming both, never bits read as another type.
``src`` and ``dst`` are **group ranks** (``group.group_rank(world_rank)``), as everywhere in
the collectives.

A receive from any source takes the first message under its tag from a rank that has no
receive of its own posted for it (messages kept before it was posted count, the longest kept
first). A lost peer does not end it (another may still send); its timeout does.

Not here: the collectives (api.py), the mailbox matching (runtime/mailbox.py).
"""

from __future__ import annotations

import numpy as np

from collectives import ops
from collectives.calls import group_of
from collectives.tensors import takes_tensors
from runtime.errors import CollectiveTimeoutError, MessageMismatchError, PeerLostError
from runtime.group import check_timeout

__all__ = ["send", "recv"]


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
