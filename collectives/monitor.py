"""``monitored_barrier``: a barrier that names the ranks that did not arrive, as torch's does.

    await monitored_barrier(timeout=30)                     # raises naming the first rank missing
    await monitored_barrier(timeout=30, wait_all_ranks=True)  # ... naming every rank missing

Group rank 0 waits for a message from every other rank, all under one deadline, then answers
each rank that arrived: "go" or the ranks that did not. Rank 0 and every rank that arrived raise
:class:`CollectiveTimeoutError` naming the missing ranks (world ranks, in ``missing``); a rank that
hears nothing from rank 0 in twice the timeout (rank 0 may arrive up to a timeout later, then
wait a timeout) names rank 0. Unlike a collective, a timeout here does not fail
the group: it is a check, meant to find the rank a job waits on (torch's debugging use). Its
messages are point-to-point, under a tag of their own counted per group (the n-th monitored
barrier of a rank meets the n-th of the others), so a rank that arrives late does not pass a
later barrier.

Not here: the plain barrier (api.py, algorithms/), the point-to-point calls (p2p.py).
"""

from __future__ import annotations

import asyncio
import weakref

from collectives import calls
from runtime.errors import CollectiveTimeoutError, PeerLostError, PeerTimeoutError, ranks_in_words
from runtime.group import ProcessGroup, check_timeout

__all__ = ["monitored_barrier"]

_calls: "weakref.WeakKeyDictionary[ProcessGroup, int]" = weakref.WeakKeyDictionary()  # group -> barriers so far


async def monitored_barrier(group=None, timeout: float | None = None, wait_all_ranks: bool = False) -> None:
    """Returns once every rank of the group has entered it; else raises naming who did not.

    Args:
        timeout: seconds rank 0 waits for all the others (default: the runtime's).
        wait_all_ranks: name every rank missing, not only the first (lowest).

    Example (3 ranks, rank 2 never calls it)::

        await monitored_barrier(timeout=2)
        # Rank 0, 1: CollectiveTimeoutError: monitored_barrier (group 0): rank 2 did not arrive in 2.0 s

    Raises:
        CollectiveTimeoutError: ranks did not arrive in time (``missing`` names them, world ranks).
        ValueError: this rank is not a member of the group.
    """
    timeout = check_timeout(timeout)
    group = calls.member_group_of(group)
    if group.error is not None:
        raise group.error
    runtime = group.runtime
    timeout = runtime.timeout_s if timeout is None else timeout
    count = _calls.get(group, 0) + 1
    _calls[group] = count
    arrive, answer = ("mbar", group.gid, count), ("mbar-answer", group.gid, count)
    if group.size == 1:
        return
    actor = runtime.actor
    root = group.ranks[0]
    what = f"monitored_barrier (group {group.gid})"
    if group.rank != 0:
        try:
            await actor.send(root, arrive, b"", timeout_s=timeout)
            reply = await actor.recv(root, answer, timeout_s=2 * timeout)  # its wait starts when it arrives
        except (PeerTimeoutError, PeerLostError) as exc:
            raise CollectiveTimeoutError(f"rank {runtime.rank}: {what}: rank {root} (group rank 0) did not answer "
                                         f"in {2 * timeout:.1f} s ({exc})", missing=[root]) from None
        if reply:
            raise CollectiveTimeoutError(f"rank {runtime.rank}: {what}: {ranks_in_words(reply)} did not arrive in "
                                         f"{timeout:.1f} s (rank {root} waited for them)", missing=reply)
        return
    others = group.ranks[1:]
    posted = {peer: actor.post((peer, arrive), peer, None) for peer in others}
    await asyncio.wait(posted.values(), timeout=timeout)
    missing = []
    for peer, fut in posted.items():
        if not fut.done():
            actor.unpost((peer, arrive), fut)
            fut.cancel()
        elif fut.exception() is None:
            continue
        missing.append(peer)
    named = missing if wait_all_ranks else missing[:1]
    arrived = [peer for peer in others if peer not in missing]
    await asyncio.gather(*(actor.send(peer, answer, named, timeout_s=timeout) for peer in arrived),
                         return_exceptions=True)  # a rank gone since it arrived learns nothing more
    if missing:
        raise CollectiveTimeoutError(f"rank {runtime.rank}: {what}: {ranks_in_words(named)} did not arrive in "
                                     f"{timeout:.1f} s", missing=named)
