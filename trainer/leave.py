"""Leaving an elastic job on purpose: a member that the scheduler signals (SIGTERM on preemption)
hands its state to the others and exits 0, and they go on shrunk at once, without waiting for a
timeout and without reading the disk.

At every step boundary of an elastic job, and after every re-form (trainer/loop.py), the members
run one all_reduce(max) of [a process waits to join, the signal each rank noted
(trainer/preempt.py's scope)] (:func:`agree`), and every member reads the same :func:`plan`:

    nothing         train on
    grow            re-form with the joiners (trainer/elastic.py ``recover``)
    leave R         the ranks of R say so in the store (the launcher counts their exit 0 as a
                    leave, not the job's end), close their runtime and raise ``preempt.Left``; the
                    others re-form without them, telling membership they are gone (no settle wait)
    stop            fewer than MIN would stay (the whole job was signalled): every rank saves the
                    checkpoint, if any, and raises ``preempt.Preempted``, as a fixed job does

The step before the boundary was voted and applied on every member, so nothing is half done. The
hand-over is the re-shard (trainer/sharding/redundancy.py): ddp holds everything everywhere; in
zero1/2/3 and fsdp a leaver's shard is rebuilt from its holder's (rank - 1) buddy copy, which is
the step's own bytes. A holder must stay until the re-form that rebuilds its buddy, so adjacent
leavers go in rounds (:func:`leave_round`: no two neighbours in one round; c neighbours in about
log2(c) + 1 rounds, each one more agreement and re-form): a node's ranks, adjacent, leave too.

What it is not: leaving in the middle of a step (a signal is acted on at the next boundary), a
tensor or pipeline layout (no replica: trainer/cli.py restarts it from the checkpoint).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import numpy as np

from collectives.api import all_reduce
from trainer import preempt
from trainer.preempt import Left

__all__ = ["Change", "Plan", "agree", "plan", "leave_round", "go", "settle"]

GONE_POLL_S = 0.005  # how often a leaver looks whether the others closed their side (a few ms in all)


@dataclass(frozen=True)
class Change:
    """What the members agreed at a boundary."""
    grow: bool = False  # a process waits to join
    signals: dict[int, int] = field(default_factory=dict)  # rank -> the signal it noted, e.g. {2: 15}


@dataclass(frozen=True)
class Plan:
    kind: str  # "none" | "grow" | "leave" | "stop"
    ranks: tuple[int, ...] = ()  # leave: the ranks that go in this round
    signum: int = 0  # leave / stop: the largest signal noted


async def agree(job, signum: int) -> Change:
    """Every member of ``job``'s current generation: one all_reduce(max) of [joiners waiting,
    each rank's noted signal (``signum``: this rank's, 0 for none)]; the same Change on every member."""
    group = job.rt.world
    flags = np.zeros(group.size + 1, dtype=np.int64)
    flags[0] = 1 if await job.rdzv.joiners_waiting() > 0 else 0
    flags[1 + group.rank] = signum
    await all_reduce(flags, op="max", group=group)
    return Change(bool(flags[0]), {r: int(s) for r, s in enumerate(flags[1:]) if s})


def leave_round(leavers, size: int, replicated: bool) -> tuple[int, ...]:
    """The leavers that go in the next re-form: all of them when every rank holds the whole state
    (ddp), else those whose holder (rank - 1 mod size) stays for it, no two neighbours together.
    Pure. E.g. leavers {1, 2, 3} of 5 -> (1, 3), then, renumbered, the old 2."""
    leavers = sorted(leavers)
    if replicated:
        return tuple(leavers)
    chosen: list[int] = []
    for q in leavers:
        if (q - 1) % size not in chosen and (q + 1) % size not in chosen:
            chosen.append(q)
    return tuple(chosen)


def plan(change: Change, size: int, min_size: int, replicated: bool) -> Plan:
    """What the members do after ``change`` (pure; the same on every member)."""
    if change.signals:
        signum = max(change.signals.values())
        if size - len(change.signals) < min_size:
            return Plan("stop", signum=signum)
        return Plan("leave", leave_round(change.signals, size, replicated), signum)
    return Plan("grow") if change.grow else Plan("none")


async def go(job, signum: int, step: int, others) -> None:
    """This member leaves: it says so in the store, waits (bounded by the runtime's timeout) until
    ``others`` (the ranks that stay in this round) have closed their side of the generation, so that
    none is still finishing the agreement with it, closes its runtime and raises Left. The others
    re-form without it (``recover(lost=...)``)."""
    left = Left(signum, step)
    await job.rdzv.leave(str(left))
    rt = job.rt
    deadline = time.monotonic() + rt.timeout_s
    while not set(others) <= set(rt.actor.lost_peers()) and time.monotonic() < deadline:
        await asyncio.sleep(GONE_POLL_S)
    await rt.close()
    raise left


async def settle(run, epoch: int, k: int) -> int:
    """trainer/loop.py's ``_Run`` of an elastic job, between two steps on every member: agrees,
    then acts (see the module docstring) until nothing changes; returns the step in the epoch.

    Raises:
        Left: on the ranks that leave. Preempted: on every rank, when too few would stay.
        whatever a re-form raises (trainer/elastic.py ``recover``).
    """
    job = run.elastic
    while True:
        todo = plan(await agree(job, preempt.noted()), run.size, job.rdzv.bounds.min_size,
                    run.strategy.replicated_state)
        if todo.kind == "none":
            return k
        if todo.kind == "stop":  # the whole job was signalled: as a fixed job (trainer/preempt.py)
            save = (lambda: run.save(epoch, k, replace(run.sums))) if run.options.checkpoint_dir else None
            await preempt.stop(todo.signum, save)
        if todo.kind == "leave" and run.rank in todo.ranks:
            await go(job, preempt.noted(), run.state.step, [r for r in range(run.size) if r not in todo.ranks])
        await run.regroup(epoch, k, None, lost=list(todo.ranks) if todo.kind == "leave" else None)
        k = run.state.step_in_epoch
