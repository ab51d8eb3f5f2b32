"""The commit vote: before any rank applies a step, the members agree whether every collective of
the step completed on every one of them (torchft's ``should_commit``, ULFM's ``MPI_Comm_agree``),
and every member that gets an answer gets the same one.

    if await should_commit(group, store, step, ok=step_went_well, timeout=5.0):
        apply the update
    else:
        discard the step: the next generation runs it again

Two phases:

1. vote: one ``all_reduce(min)`` of this rank's flag (1: my step completed, 0: it did not) over the
   group, under ``timeout``. A rank whose step raised votes 0; a vote that fails (a peer lost, the
   group already failed) or does not complete in time counts as 0 for this rank. A vote that
   completes with every flag 1 proves every member held every byte of the step.
2. decide: ``compare_set(f"commit/{step}", None, b"1" or b"0")`` on the store, this rank's view of
   the vote. The first write is the decision; every rank returns what the key holds.

Why the store: the all_reduce alone is not agreement. When a peer dies during it, some ranks may
already hold the result (all 1) while others fail; each would answer differently. The store's
compare_set is the one place where one answer is fixed, as membership's generations are
(runtime/membership.py). It costs one store request per rank per step.

``store`` is the generation's store (one namespace per generation: a step run again by the next
generation votes afresh). Group rank 0 deletes ``commit/{step - 1}`` (beside its decision) once every
member voted 1 on ``step``: every one had read it by then (see docs/design.md, "Elastic training").
It lives here, not in trainer/: it is a collective over a group, for any loop, not only ours.
"""

from __future__ import annotations

import asyncio

import numpy as np

from collectives.api import all_reduce
from runtime.errors import RingweaveError

__all__ = ["should_commit", "decide", "COMMIT", "DISCARD"]

COMMIT, DISCARD = b"1", b"0"


def commit_key(step: int) -> str:
    return f"commit/{step}"


async def decide(store, step: int, all_yes: bool) -> bool:
    """Phase 2: records this rank's view of the vote unless a decision is there already; returns
    the decision. Raises StoreError when the store cannot be reached (no answer is guessed)."""
    held = await store.compare_set(commit_key(step), None, COMMIT if all_yes else DISCARD)
    if held not in (COMMIT, DISCARD):
        raise RingweaveError(f"the commit decision of step {step} holds {held[:40]!r}, not {COMMIT!r} or {DISCARD!r}")
    return held == COMMIT


async def should_commit(group, store, step: int, *, ok: bool, timeout: float) -> bool:
    """Whether to apply step ``step``: the same answer on every member of ``group`` that returns.

    Args:
        group: the generation's process group (every member calls this, once per step).
        store: the generation's store (see the module docstring).
        step: the step being voted on (a number not voted on before in this generation).
        ok: this rank's own verdict: False when anything of its step raised or is missing.
        timeout: the vote's deadline in seconds; the decision adds one store request.
    Returns:
        True: every member completed the step, apply it. False: discard it on every member.
    Raises:
        StoreError: the store cannot be reached (then no rank can know the answer: the job stops).
    """
    flag = np.array([1 if ok else 0], dtype=np.int32)
    try:
        await all_reduce(flag, op="min", group=group, timeout=timeout)
        all_yes = bool(flag[0] == 1)
    except (RingweaveError, TimeoutError, OSError):  # a lost peer, a failed group, the deadline: "no"
        all_yes = False
    if not (all_yes and step > 0 and group.rank == 0):
        return await decide(store, step, all_yes)
    # every member voted 1 on this step, so every one had read step - 1's decision: the delete
    # travels beside the decision instead of after it (one store round trip on rank 0, not two)
    decided, deleted = await asyncio.gather(decide(store, step, all_yes), store.delete_key(commit_key(step - 1)),
                                            return_exceptions=True)
    for outcome in (decided, deleted):
        if isinstance(outcome, BaseException):
            raise outcome
    return decided
