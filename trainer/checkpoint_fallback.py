"""An elastic job's fallback to its checkpoint: when a lost member's state has no copy left in
memory, the members restart from the newest checkpoint on disk, saying so in one line.

Two cases have no copy to re-shard from (trainer/leave.py and trainer/elastic.py cover the rest):

- a tensor- or pipeline-parallel layout (``--tp``/``--pp`` under ``--elastic``): each rank holds
  the only copy of its slice of the model, so any lost rank is lost state;
- a data-parallel job that lost a rank and the neighbour that held its buddy copy at once
  (``ShardLostError`` from the re-shard, raised alike on every member).

Then every member that is left prints nothing but the lowest of them, which prints one line (what
was lost, the checkpoint's step, how many optimizer steps repeat), and they exit
``FALLBACK_EXIT``; ``python -m runtime.launch --elastic`` restarts the attempt at its full size
(runtime/launch_elastic.py), and a restarted attempt continues its run from the newest valid
checkpoint (trainer/rundir.py), so the result equals an undisturbed run's.

    try:
        history = await fit(...)
    except Exception as exc:
        lost = lost_without_copy(exc, layout="tp 2")
        if lost is None:
            raise
        print(line(lost, exc, "tp 2", checkpoint_dir, strategy.step)); return FALLBACK_EXIT

What it is not: restarting in place (the processes start again: a tp/pp mesh cannot shrink), a
fallback without a checkpoint directory (the error propagates: no run is silently repeated).
"""

from __future__ import annotations

from runtime.errors import CollectiveTimeoutError, PeerLostError, ranks_in_words
from runtime.launch_elastic import FALLBACK_EXIT
from trainer import checkpoint
from trainer.sharding.base import ShardLostError, StepAbortedError

__all__ = ["FALLBACK_EXIT", "lost_without_copy", "line", "speaks"]


def lost_without_copy(exc: BaseException, *, layout: str | None) -> list[int] | None:
    """The ranks whose state ``exc`` says is gone with no copy in memory ([] when it does not say
    which), or None: not such a loss. ``layout``: the job's model-parallel layout ("tp 2"), None
    for a plain data-parallel one (whose losses re-shard, unless ShardLostError says otherwise)."""
    if isinstance(exc, BaseExceptionGroup):  # a task group's failures: any of them may be the loss
        found = [f for f in (lost_without_copy(e, layout=layout) for e in exc.exceptions) if f is not None]
        return sorted({r for f in found for r in f}) if found else None
    if isinstance(exc, ShardLostError):
        return list(exc.ranks)
    if layout is None:
        return None
    if isinstance(exc, StepAbortedError) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, PeerLostError):
        return [exc.rank] if exc.rank is not None else []
    if isinstance(exc, CollectiveTimeoutError):
        return sorted(set(exc.missing) | set(exc.absent))
    return None


def speaks(rank: int, lost: list[int]) -> bool:
    """Whether ``rank`` is the lowest rank not lost: the one that prints the line."""
    return rank == next(r for r in range(rank + 1) if r not in lost)


def line(lost: list[int], exc: BaseException, layout: str | None, checkpoint_dir: str, step: int) -> str:
    """The one line: what was lost, the newest checkpoint, the optimizer steps that repeat."""
    newest = checkpoint.latest(checkpoint_dir)
    saved = int(newest.name.rsplit("-", 1)[1]) if newest is not None else 0
    if isinstance(exc, ShardLostError):
        what = f"the shards of {ranks_in_words(lost)} and their buddy copies were lost together (ShardLostError)"
    else:
        what = (f"{ranks_in_words(lost) if lost else 'a rank'} lost ({type(exc).__name__}), and {layout} keeps no copy "
                f"of a rank's state")
    where = (f"checkpoint {newest.name} (optimizer step {saved})" if newest is not None
             else f"the start (no checkpoint in {checkpoint_dir} yet)")
    return (f"trainer: {what}: every member restarts from {where}; "
            f"{max(0, step - saved)} optimizer step(s) run again")
