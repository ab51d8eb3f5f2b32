"""What every collective does before its algorithm runs: resolve the group, choose the algorithm,
open the call.

    group = group_of(group)                      # None: the world of the calling task's runtime
    call, run = open_call(group, "all_reduce", x.nbytes, algorithm, timeout,
                          op="sum", dtype=x.dtype, count=x.size)
    await group.run(call, run, flat, "sum")      # run(call, ...): the algorithm; call is its Comm

The public calls (api.py, uneven.py, p2p.py) and the collectives built from other collectives
(compressed.py, device.py) all come through here, so every call is chosen and fingerprinted the
one way.

Not here: argument checks (ops.py), the table (registry.py), the call itself (runtime/group.py).
"""

from __future__ import annotations

from typing import Callable

from collectives import ops, registry
from runtime.group import Call, ProcessGroup
from runtime.init import current as current_runtime

__all__ = ["group_of", "member_group_of", "open_call"]


def group_of(group) -> ProcessGroup:
    """``group``, or the world of the calling task's runtime (``runtime.current()``) when None."""
    return group if group is not None else current_runtime().world


def member_group_of(group) -> ProcessGroup:
    """:func:`group_of`, of which this rank must be a member.

    Raises:
        ValueError: this rank is not a member of the group.
    """
    group = group if group is not None else current_runtime().world
    if group.rank < 0:
        raise ValueError(f"rank {group.runtime.rank} is not a member of group {group.gid} {group.ranks}")
    return group


def open_call(group: ProcessGroup, collective: str, nbytes: int, algorithm: str | None, timeout: float | None, *,
              subcall: bool = False, counts: str = "", **fp) -> tuple[Call, Callable]:
    """Chooses the algorithm (``registry.choose``) and opens the call: takes the group's next
    sequence number, with a fingerprint naming the algorithm that will run. No waiting.

    Args:
        nbytes: one rank's input, as the table reads it (registry.py).
        algorithm: an override (``algorithm=`` of the call), or None.
        subcall: a call that another collective opens (see ``registry.choose``).
        counts: the v-variants' checksum of their counts (hex), added to the fingerprint.
        fp: the fingerprint's fields (``ops.fingerprint``: op, dtype, count, root).

    Returns:
        (call, run): ``run(call, *args)`` runs the algorithm, ``call`` being the Comm it talks
        through (``runtime.group.Call``).
    """
    name, run = registry.choose(collective, nbytes, group.size, algorithm, group, subcall=subcall)
    fingerprint = ops.fingerprint(collective, algo=name, **fp)
    call = group.open_call(f"{fingerprint} counts={counts}" if counts else fingerprint, timeout)
    call.algorithm = name  # shown by runtime tracing
    return call, run
