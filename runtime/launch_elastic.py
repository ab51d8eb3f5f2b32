"""``python -m runtime.launch --elastic MIN:MAX -n MAX``: one attempt of an elastic job.

The launcher records generation 0 (the MAX ranks' member ids, in rank order: runtime/membership.py
``record``) in its store, then spawns the ranks. A rank that exits non-zero while at least MIN
others still run is not the job's failure: the survivors re-form without it (runtime/elastic.py,
trainer/elastic.py), and the launcher starts a new process in its slot ``--rejoin-delay-s`` later
with RINGWEAVE_ELASTIC_JOIN=1 and a new member id, which the job grows back to. A rank that left
on purpose (exit 0 after writing ``left/<member>`` in the store: a graceful leave on the
scheduler's signal, trainer/leave.py) is neither a failure nor the job's end, and its slot stays
empty: the signal said its resources go elsewhere. The attempt ends:

    SUCCEEDED   every running rank exited 0 (no slot is restarted once one has; a joiner still
                running ``--grace-s`` after the others finished came too late, and is stopped);
    FAILED      a rank exited non-zero and fewer than MIN ranks run, a rank said TooFewMembersError
                or ShardLostError, or exited 2 (a refusal of its arguments) or 128 + a preemption
                signal (the job was preempted as a whole), a slot failed more than ``MAX_JOINS`` times,
                or no process of the latest generation is left (joiners alone cannot be let in): the
                failure names that rank. A rank's ``FALLBACK_EXIT`` (its state has no copy left in
                memory: trainer/checkpoint_fallback.py) fails the attempt to be restarted from the
                checkpoint, at most ``MAX_FALLBACKS`` times (``restarts_allowed``);
    INTERRUPTED / TIMED_OUT as a fixed job's attempt (launch.py).

Not here: the fixed job's attempt (launch.py ``run_attempt``), deciding generations (the ranks do).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from typing import Callable

from runtime import env, membership, procs
from runtime.launch_config import LaunchConfig, elastic_prefix, member_id, parse_bounds, rank_argv
from runtime.launch_outcome import Ending, Outcome, RankExit, describe_exit, stop_plan
from runtime.store import PrefixStore
from runtime.store_tcp import TCPStore

USAGE_EXIT = 2  # a rank refused its arguments (the same on every rank): the attempt fails at once
MAX_JOINS = 3  # a slot whose processes failed this many times more is the job's failure
FALLBACK_EXIT = 75  # a rank whose state has no copy left (EX_TEMPFAIL): restart the attempt from the checkpoint
MAX_FALLBACKS = 3  # restarts from the checkpoint per job
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
                              fold: Callable[[int], Callable[[], str | None]], restart: int,
                              left: Callable[[str], str | None] = lambda member: None,
                              latest: Callable[[], set[str] | None] = lambda: None) -> Outcome:
    """Spawns the ranks, restarts lost ones as joiners while MIN run, and always stops and reaps
    every process before returning (see the module docstring). ``left(member)``: why that member
    left the job on purpose (its ``left/<member>`` record), or None; ``latest()``: the members of
    the latest generation decided (None: unknown)."""
    bounds = parse_bounds(cfg.elastic)
    argv = rank_argv(cfg)
    spawned: list[procs.RankProcess] = []
    running: dict[asyncio.Future, procs.RankProcess] = {}
    members: dict[int, str] = {}  # id(process) -> its member id
    joins = [0] * len(envs)
    outcome: Outcome | None = None
    finished = False  # a rank exited 0: the job is ending, no slot is started again
    late: set[int] = set()  # slots whose process now is a joiner
    joiners_until = None  # the job finished and only joiners run: stop them then (time.monotonic())
    preempted = preempted_codes(envs[0]) if envs else set()

    usage_errors: set[str] = set()  # written once, whichever ranks wrote them (procs.UsageFolder)

    async def start(slot: int, environ: dict[str, str]) -> None:
        r = await procs.spawn(slot, argv, environ, console.write, cfg.tail_lines, fold=fold(slot),
                              usage_errors=usage_errors)
        spawned.append(r)
        running[r.protocol.exited] = r
        members[id(r)] = env.MEMBER.get(environ) or ""

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
                live = len(running) + len(pending_joins)
                why_left = left(members[id(r)]) if r.returncode == 0 else None
                if why_left is not None:  # a graceful leave: the others went on without it
                    console.say(f"rank {r.rank} left the job ({why_left}); {live} ranks go on (--elastic "
                                f"{cfg.elastic}); its slot stays empty")
                    continue
                if r.returncode == 0:
                    finished = True
                    if joiners_until is None and all(p.rank in late for p in running.values()):
                        joiners_until = time.monotonic() + cfg.grace_s  # a joiner let in ends with the others
                    continue
                if r.returncode and not r.protocol.pipes_closed.done():
                    await asyncio.wait([r.protocol.pipes_closed], timeout=0.3)
                exit_ = RankExit(r.rank, r.returncode, r.protocol.exited_at, r.protocol.last_exception)
                too_few = any(name in (exit_.exception or "") for name in JOB_ENDING_ERRORS)
                if r.returncode == USAGE_EXIT and running:  # every rank refuses alike; rank 0 says why:
                    others = [p.protocol.pipes_closed for p in running.values()]  # let its line arrive
                    await asyncio.wait(others, timeout=cfg.grace_s)
                held = latest()  # a joiner is let in by members that hold the state: is one left?
                holders = held is None or any(members[id(p)] in held for p in running.values())
                why = fatal(r.returncode, too_few, finished, live, bounds.min_size, joins[r.rank], preempted, holders)
                if why is not None:
                    console.say(f"rank {r.rank} exited with {describe_exit(r.returncode)}: "
                                + (why if why != "below" else f"{live} ranks left, fewer than the minimum "
                                   f"{bounds.min_size} of --elastic {cfg.elastic}"))
                    outcome = Outcome(Ending.FAILED, failure=exit_)
                    break
                joins[r.rank] += 1
                console.say(f"rank {r.rank} exited with {describe_exit(r.returncode)}; {live} ranks go on "
                            f"(--elastic {cfg.elastic}); starting a joiner in its place in {cfg.rejoin_delay_s:g} s")
                pending_joins[asyncio.ensure_future(asyncio.sleep(cfg.rejoin_delay_s))] = r.rank
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


def fatal(code: int, too_few: bool, finished: bool, live: int, min_size: int, joins: int,
          preempted: set[int], holders: bool = True) -> str | None:
    """Why a rank's non-zero exit ends the attempt ("below": fewer than MIN live), or None: the
    others go on and a joiner takes its slot. ``holders``: whether a process of the latest
    generation still runs (else only joiners are left, and nobody can let them in). Pure."""
    if code == FALLBACK_EXIT:
        return "its state has no copy left: the job restarts from its checkpoint"
    if code in preempted:
        return "the job was preempted"
    if code == USAGE_EXIT:
        return "it refused its arguments"
    if live < min_size:
        return "below"
    if too_few or finished or joins >= MAX_JOINS:
        return "it cannot be replaced"
    if not holders:
        return "no member of the job's latest generation is left to let a joiner in"
    return None


def preempted_codes(environ) -> set[int]:
    """The exit codes of a rank that the whole job's preemption stopped (trainer/preempt.py: 128 +
    each of RINGWEAVE_PREEMPT_SIGNALS, or RINGWEAVE_PREEMPT_EXIT_CODE), as the ranks' ``environ`` sets them."""
    given = env.PREEMPT_EXIT_CODE.get(environ)
    return {given} if given is not None else {128 + int(signal.Signals[s]) for s in env.PREEMPT_SIGNALS.get(environ)}


def restarts_allowed(outcome: Outcome) -> int:
    """The attempts an elastic job may restart after ``outcome``: ``MAX_FALLBACKS`` when a rank fell
    back to the checkpoint (``FALLBACK_EXIT``), else none (a lost rank is a shrink, not a restart)."""
    fell_back = outcome.ending is Ending.FAILED and outcome.failure.returncode == FALLBACK_EXIT
    return MAX_FALLBACKS if fell_back else 0


def fold_for(aborted, echo) -> Callable[[int], Callable[[], str | None]]:
    """``fold`` per slot for :func:`run_elastic_attempt` (launch.py's ``_echo_of_abort``)."""
    return lambda slot: functools.partial(echo, aborted, slot)
