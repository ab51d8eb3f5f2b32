"""New groups from a parent's ranks, as mpi4py and torch users make them: ``split`` and
``new_subgroups``.

    sub = await split(color=rank % 2, key=rank)      # MPI_Comm_split; None for no group
    mine, every = new_subgroups(group_size=4)        # torch.distributed.new_subgroups
    mine, every = new_subgroups(ranks=[[0, 2], [1, 3]])   # new_subgroups_by_enumeration

Both end in ``new_group(ranks)`` (runtime/rankruntime.py), which every rank of the *world* calls
in the same order, so that every rank numbers every group alike (a group's id is in each of its
frames). So every world rank calls these too, in the same order, a rank outside ``group`` (the
parent, default the world) included: it gets None (and every group). :func:`split` learns the
colors and keys by one all_gather of the world; every rank then makes every color's group, in
ascending color order.

Not here: the groups themselves (runtime/group.py), the collectives on them (api.py).
"""

from __future__ import annotations

import numbers

import numpy as np

from collectives import calls
from runtime.group import ProcessGroup, check_timeout

__all__ = ["split", "new_subgroups"]


def _int_or_none(name: str, value, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"split: {name} must be an int{' or None' if allow_none else ''}, got "
                        f"{type(value).__name__} {value!r}")
    value = int(value)
    if not -2 ** 63 <= value < 2 ** 63:
        raise ValueError(f"split: {name}={value} does not fit in 64 bits")
    return value


async def split(color: int | None, key: int = 0, group=None, timeout: float | None = None) -> ProcessGroup | None:
    """Splits ``group`` (default: the world) as MPI_Comm_split does: the ranks that pass the same
    ``color`` form one new group, ordered by ``(key, rank in group)``; ``color=None`` (MPI's
    UNDEFINED) joins none. Returns this rank's new group, or None. Every rank of the world calls
    it (see the module docstring); a rank outside ``group`` gets None, whatever its color.

    Example (4 ranks)::

        sub = await split(color=rank % 2, key=-rank)
        # Rank 0: sub.ranks = [2, 0]   Rank 1: [3, 1]   Rank 2: [2, 0]   Rank 3: [3, 1]

    Raises:
        TypeError: ``color`` or ``key`` is not an int (a bool among them).
        CollectiveTimeoutError, PeerLostError: as an all_gather of the world would.
    """
    timeout = check_timeout(timeout)
    parent = calls.group_of(group)
    color = _int_or_none("color", color, True)
    key = _int_or_none("key", key, False)
    runtime = parent.runtime
    world = runtime.world
    mine = np.array([color is not None and parent.is_member, color or 0, key], np.int64)
    every = np.empty((world.size, 3), np.int64)
    call, run = calls.open_call(world, "all_gather", mine.nbytes, None, timeout, name="split", dtype=mine.dtype,
                                count=mine.size)  # named split: a rank in another call gets a mismatch
    await world.run(call, run, every.reshape(-1), mine)
    members: dict[int, list[tuple[int, int, int]]] = {}  # color -> (key, parent rank, world rank)
    for world_rank, (has_color, their_color, their_key) in enumerate(every.tolist()):
        if has_color and world_rank in parent.ranks:
            members.setdefault(their_color, []).append((their_key, parent.group_rank(world_rank), world_rank))
    found = None
    for their_color in sorted(members):
        ranks = [world_rank for _, _, world_rank in sorted(members[their_color])]
        made = runtime.new_group(ranks)
        if made.is_member:
            found = made
    return found


def new_subgroups(group_size: int | None = None, *, ranks=None,
                  group=None) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """New groups of ``group_size`` consecutive ranks of ``group`` (default: the world; size:
    the ranks per host, ``local_world_size``), as ``torch.distributed.new_subgroups``; or, with
    ``ranks`` (lists of world ranks, a rank in one list at most), one group per list, as
    ``new_subgroups_by_enumeration``. No messages: every world rank calls it, in the same order.
    Returns (this rank's group or None, every group made).

    Example (4 ranks)::

        mine, every = new_subgroups(2)
        # Rank 0, 1: mine.ranks = [0, 1]   Rank 2, 3: mine.ranks = [2, 3]   every: both

    Raises:
        ValueError: ``group_size`` not positive or not dividing the group's size; both or an
            empty ``ranks``; a rank in two lists or out of range.
        TypeError: ``group_size`` not an int.
    """
    parent = calls.group_of(group)
    runtime = parent.runtime
    if ranks is not None:
        if group_size is not None:
            raise ValueError("new_subgroups: give group_size or ranks, not both")
        lists = [list(r) for r in ranks]
        if not lists:
            raise ValueError("new_subgroups: ranks is empty; give at least one list of ranks")
        seen: dict[int, int] = {}
        for i, members in enumerate(lists):  # all checked before any group is made
            if not members:
                raise ValueError(f"new_subgroups: list {i} of ranks is empty")
            for r in members:
                if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                    raise TypeError(f"new_subgroups: ranks must be ints, got {r!r} ({type(r).__name__}) in list {i}")
                if not 0 <= r < runtime.world_size:
                    raise ValueError(f"new_subgroups: rank {r} (list {i}) is outside 0..{runtime.world_size - 1}")
                if r in seen:
                    raise ValueError(f"new_subgroups: rank {r} is in lists {seen[r]} and {i} of {lists}")
                seen[r] = i
    else:
        size = runtime.local_world_size if group_size is None else group_size
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"new_subgroups: group_size must be an int, got {type(size).__name__} {size!r}")
        if size <= 0 or parent.size % size:
            raise ValueError(f"new_subgroups: group_size={size} must be positive and divide the group's "
                             f"{parent.size} ranks")
        lists = [parent.ranks[i:i + size] for i in range(0, parent.size, size)]
    every = [runtime.new_group(members) for members in lists]
    mine = next((g for g in every if g.is_member), None)
    return mine, every
