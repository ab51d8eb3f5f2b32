"""Every exception ringweave raises on purpose, in one place.

Each message names what was involved: the ranks, the address, the operation,
the key, the limit and the value that broke it. Callers catch the family
(``RingweaveError``) or one member; nothing here carries behaviour.

This module deliberately imports nothing from the rest of the package, so any
layer (runtime, collectives, trainer, tools) can raise these.
"""

from __future__ import annotations


def ranks_in_words(ranks) -> str:
    """Ranks for a message, runs joined: ``"rank 1"``, ``"ranks 0, 2 and 5-7"``, ``"no rank"``.

    >>> ranks_in_words([7, 0, 5, 6, 2])
    'ranks 0, 2 and 5-7'
    """
    ranks = sorted(set(ranks))
    if not ranks:
        return "no rank"
    runs: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs += [str(start)] if start == prev else [str(start), str(prev)] if prev == start + 1 else [f"{start}-{prev}"]
        if r is not None:
            start = prev = r
    words = runs[0] if len(runs) == 1 else f"{', '.join(runs[:-1])} and {runs[-1]}"
    return f"rank {words}" if len(ranks) == 1 else f"ranks {words}"


class RingweaveError(Exception):
    """Base of every error ringweave raises on purpose."""


# -- the network -----------------------------------------------------------


class BadFrameError(RingweaveError):
    """A frame broke the wire format: bad magic or version, a size past its
    limit, a header that is not msgpack or does not follow the schema.

    The connection that carried it is closed; other connections go on.
    """


class AuthenticationError(RingweaveError):
    """A peer or store client could not prove it holds the job's secret."""


class ConnectError(RingweaveError):
    """Could not connect to an address before the deadline."""


class JobFileError(RingweaveError):
    """The directory of the job files (runtime/jobfile.py), or a file in it, is not
    safely ours: another owner, access for group or others, or a symbolic link.
    The message names the path, what was found and what is expected."""


class PrivateDirError(RingweaveError):
    """A directory we write in where the user said (a trace directory, a tool's output;
    runtime/owndir.py) is not safely ours: another owner, writable by group or others, a
    symbolic link, or not a directory. The message names the path, why, and what to do."""


class PeerLostError(RingweaveError):
    """A peer rank died, disconnected or left while we still needed it.

    Attributes:
        rank: the global rank of the peer that was lost.
    """

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class PeerAbortedError(PeerLostError):
    """A peer rank left the job because its program raised: it told every peer
    (``runtime.abort``, a communicator or runtime left by an exception) before
    closing, so the others fail at once instead of waiting for a timeout.

    Attributes:
        rank: the global rank that aborted.
        exc_type: the name of the exception it raised, e.g. ``"ValueError"``.
        reason: that exception's message.
    """

    def __init__(self, message: str, rank: int | None = None, exc_type: str = "", reason: str = ""):
        super().__init__(message, rank)
        self.exc_type = exc_type
        self.reason = reason


class PeerTimeoutError(RingweaveError, TimeoutError):
    """A point-to-point send or receive of an actor did not complete in time.

    Attributes:
        rank: the peer's global rank.
    """

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class MailboxFullError(RingweaveError):
    """Messages that arrived before their receive was posted exceeded the
    mailbox bound (bytes kept for receives that nobody posted)."""


class WouldBlock(RingweaveError):
    """A ``*_nowait`` call could not complete without waiting."""


class ClosedError(RingweaveError):
    """The actor, connection, store or communicator was already closed."""


class RemoteCallError(RingweaveError):
    """A handler called with ``Actor.call`` raised on the remote rank."""


# -- the store ---------------------------------------------------------------


class StoreError(RingweaveError):
    """The rendezvous store refused a request or could not be reached."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store wait ran out of time.

    Attributes:
        keys: the keys still missing when the time ran out.
        waited_s: how long the call waited, in seconds.
    """

    def __init__(self, message: str, keys: list[str] | None = None, waited_s: float = 0.0):
        super().__init__(message)
        self.keys = list(keys or [])
        self.waited_s = waited_s


# -- membership (runtime/membership.py) ----------------------------------------


class MembershipError(RingweaveError):
    """The members could not agree on the next generation, or its record is malformed.

    Attributes:
        generation: the generation being decided, e.g. 3.
    """

    def __init__(self, message: str, generation: int | None = None):
        super().__init__(message)
        self.generation = generation


class TooFewMembersError(MembershipError):
    """Fewer members than the job's minimum remain, and no joiner came in time: the job stops."""


class ExcludedError(MembershipError):
    """The generation was decided without this process (taken for lost, or too slow to
    check in); it may join again as a new member."""


class MembershipTimeoutError(MembershipError, TimeoutError):
    """No generation was decided in time; the message names the generation and what was awaited."""


# -- collectives -------------------------------------------------------------


class CollectiveError(RingweaveError):
    """A collective failed; subclasses say why."""


class CollectiveMismatchError(CollectiveError):
    """Ranks of one group called different collectives at the same point
    (different operation, dtype, length or root). The message names both
    calls and both ranks."""


class MessageMismatchError(CollectiveMismatchError, ValueError):
    """A point-to-point message does not fit the receive that took it: the sender's dtype or
    shape differs from the receive buffer's. Raised by the receive before a byte of the
    message lands in the buffer; the message names both."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not finish in time. The message names the ranks that
    had not delivered what this rank was waiting for.

    Attributes:
        missing: ranks this rank was still waiting on (its algorithm's neighbours).
        absent: ranks that had not reached the call when it timed out (asked then).
    """

    def __init__(self, message: str, missing: list[int] | None = None, absent: list[int] | None = None):
        super().__init__(message)
        self.missing = list(missing or [])
        self.absent = list(absent or [])


# -- settings ----------------------------------------------------------------


class SettingError(RingweaveError, ValueError):
    """A ``RINGWEAVE_*`` environment variable holds a value its parser refuses (runtime/env.py).
    The message names the variable, its value and what it must be."""
