"""``python -m runtime.launch --elastic MIN:MAX -n MAX``: one attempt of an elastic job.

The launcher records generation 0 (the MAX ranks' member ids, in rank order: runtime/membership.py
``record``) in its store, then spawns the ranks. A rank that exits non-zero while at least MIN
others still run is not the job's failure: the survivors re-form without it (runtime/elastic.py,
trainer/elastic.py), and the launcher starts a new process in its slot after ``JOIN_BACKOFF_S``
with RINGWEAVE_ELASTIC_JOIN=1 and a new member id, which the job grows back to. The attempt ends:

    SUCCEEDED   every running rank exited 0 (no slot is restarted once one has; a joiner still
                running ``--grace-s`` after the others finished came too late, and is stopped);
    FAILED      a rank exited non-zero and fewer than MIN ranks run, a rank said TooFewMembersError
                or ShardLostError, or exited 2 (a refusal of its arguments), or a slot failed more
                than ``MAX_JOINS`` times: the failure names that rank;
    INTERRUPTED / TIMED_OUT as a fixed job's attempt (launch.py).

Not here: the fixed job's attempt (launch.py ``run_attempt``), deciding generations (the ranks do).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Callable

from runtime import membership, procs
from runtime.launch_config import LaunchConfig, elastic_prefix, member_id, parse_bounds, rank_argv
from runtime.launch_outcome import Ending, Outcome, RankExit, describe_exit, stop_plan
from runtime.store import PrefixStore
from runtime.store_tcp import TCPStore

USAGE_EXIT = 2  # a rank refused its arguments (the same on every rank): the attempt fails at once
JOIN_BACKOFF_S = 0.5  # a lost rank's slot is started again this long after its exit
MAX_JOINS = 3  # a slot whose processes failed this many times more is the job's failure
RECORD_TIMEOUT_S = 10.0
# a rank that exits with one of these ends the attempt: too few members, or a shard with no copy left
# (no joiner could bring it back; the state must come from a checkpoint)
JOB_ENDING_ERRORS = ("TooFewMembersError", "ShardLostError")


async def record_first_generation(cfg: LaunchConfig, port: int, secret: str | None, job: str, restart: int) -> None:
    """Writes generation 0 (rank r is member_id(job, r, restart)) into the job's store."""
    store = await TCPStore.connect(cfg.advertised_addr, port, secret=secret.encode() if secret else None, job=job,
                                   timeout_s=RECORD_TIMEOUT_S, who={"rank": "launcher"})
    try:
        members = tuple(member_id(job, r, restart) for r in range(cfg.world_size))
        await membership.record(PrefixStore(elastic_prefix(restart), store), membership.Generation(0, members),
                                f"{job}/launcher")
    finally:
        await store.close()


async def run_elastic_attempt(cfg: LaunchConfig, envs: list[dict[str, str]], console, stopper, deadline,
                              fold: Callable[[int], Callable[[], str | None]], restart: int) -> Outcome:
    """Spawns the ranks, restarts lost ones as joiners while MIN run, and always stops and reaps
    every process before returning (see the module docstring)."""
    bounds = parse_bounds(cfg.elastic)
    argv = rank_argv(cfg)
    spawned: list[procs.RankProcess] = []
    running: dict[asyncio.Future, procs.RankProcess] = {}
    joins = [0] * len(envs)
    outcome: Outcome | None = None
    finished = False  # a rank exited 0: the job is ending, no slot is started again
    late: set[int] = set()  # slots whose process now is a joiner
    joiners_until = None  # the job finished and only joiners run: stop them then (time.monotonic())

    usage_errors: set[str] = set()  # written once, whichever ranks wrote them (procs.UsageFolder)

    async def start(slot: int, environ: dict[str, str]) -> None:
        r = await procs.spawn(slot, argv, environ, console.write, cfg.tail_lines, fold=fold(slot),
                              usage_errors=usage_errors)
        spawned.append(r)
        running[r.protocol.exited] = r

    try:
        for slot, environ in enumerate(envs):
            await start(slot, environ)
        pending_joins: dict[asyncio.Task, int] = {}
        while outcome is None:
            waits = set(running) | set(pending_joins) | {stopper.requested}
            ends = [t for t in (deadline, joiners_until) if t is not None]
            timeout = None if not ends else max(0.0, min(ends) - time.monotonic())
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if stopper.requested.done():
                outcome = Outcome(Ending.INTERRUPTED, signum=stopper.requested.result())
                break
            if not done and joiners_until is not None and time.monotonic() >= joiners_until:
                console.say(f"the job finished; joiners that came too late are stopped: ranks "
                            f"{sorted(r.rank for r in running.values())}")
                outcome = Outcome(Ending.SUCCEEDED)
                break
            if not done:
                outcome = Outcome(Ending.TIMED_OUT, running=sorted(r.rank for r in running.values()))
                break
            for fut in done:
                if fut in pending_joins:  # a backoff ended: start the joiner
                    slot = pending_joins.pop(fut)
                    if not finished:
                        joiner = dict(envs[slot], RINGWEAVE_ELASTIC_JOIN="1",
                                      RINGWEAVE_MEMBER=member_id(envs[slot]["RINGWEAVE_JOB"], slot, restart,
                                                                 joins[slot]))
                        await start(slot, joiner)
                        late.add(slot)
                    continue
                r = running.pop(fut)
                if r.returncode == 0:
                    finished = True
                    if joiners_until is None and all(p.rank in late for p in running.values()):
                        joiners_until = time.monotonic() + cfg.grace_s  # a joiner let in ends with the others
                    continue
                if r.returncode and not r.protocol.pipes_closed.done():
                    await asyncio.wait([r.protocol.pipes_closed], timeout=0.3)
                exit_ = RankExit(r.rank, r.returncode, r.protocol.exited_at, r.protocol.last_exception)
                live = len(running) + len(pending_joins)
                too_few = any(name in (exit_.exception or "") for name in JOB_ENDING_ERRORS)
                if r.returncode == USAGE_EXIT and running:  # every rank refuses alike; rank 0 says why:
                    others = [p.protocol.pipes_closed for p in running.values()]  # let its line arrive
                    await asyncio.wait(others, timeout=cfg.grace_s)
                if too_few or r.returncode == USAGE_EXIT or finished or live < bounds.min_size or joins[r.rank] >= MAX_JOINS:
                    why = (f"{live} ranks left, fewer than the minimum {bounds.min_size} of --elastic {cfg.elastic}"
                           if live < bounds.min_size else "it refused its arguments" if r.returncode == USAGE_EXIT
                           else "it cannot be replaced")
                    console.say(f"rank {r.rank} exited with {describe_exit(r.returncode)}: {why}")
                    outcome = Outcome(Ending.FAILED, failure=exit_)
                    break
                joins[r.rank] += 1
                console.say(f"rank {r.rank} exited with {describe_exit(r.returncode)}; {live} ranks go on "
                            f"(--elastic {cfg.elastic}); starting a joiner in its place in {JOIN_BACKOFF_S:g} s")
                pending_joins[asyncio.ensure_future(asyncio.sleep(JOIN_BACKOFF_S))] = r.rank
            if outcome is None and not running and not pending_joins:
                outcome = Outcome(Ending.SUCCEEDED)
        for task in pending_joins:
            task.cancel()
    finally:
        sig, notice = stop_plan(cfg, outcome)
        if notice:
            console.say(notice)
        await procs.stop_all(spawned, sig, cfg.grace_s, hurry=lambda: stopper.hurried)
        await procs.drain(spawned, timeout_s=1.0)
        for r in spawned:
            r.close()
    if outcome.ending is Ending.FAILED:
        failed = next(r for r in reversed(spawned) if r.rank == outcome.failure.rank)
        outcome.tail = list(failed.protocol.tail)
        outcome.last_exception = failed.protocol.last_exception
        if usage_errors:  # as launch.run_attempt: the error line once, never the rank's tail again
            outcome.usage_error = failed.protocol.usage_error or next(iter(usage_errors))
    return outcome


def fold_for(aborted, echo) -> Callable[[int], Callable[[], str | None]]:
    """``fold`` per slot for :func:`run_elastic_attempt` (launch.py's ``_echo_of_abort``)."""
    return lambda slot: functools.partial(echo, aborted, slot)
