"""How one attempt of a job ended, and what the launcher does next: pure decisions over rank exits,
no processes.

:func:`first_failure` picks the rank that failed first from the exits seen (the rank that aborted the
job, else one that did not die of a peer: :func:`died_of_a_peer`); :class:`Outcome` is how
an attempt ended (:class:`Ending`: every rank exited 0, a rank failed, the launcher got a signal,
``--max-time-s`` ran out); :func:`next_step` turns an outcome into a restart or the launcher's exit
code (the table of ``--help``); :func:`stop_plan` says which signal stops the rest of the attempt;
:func:`failure_report` and :func:`restart_message` are what the launcher prints about it.

Not here: watching and stopping processes (launch.py, procs.py), the command line
(launch_config.py).
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field
from typing import Sequence

from runtime.errors import ranks_in_words
from runtime.launch_config import LaunchConfig

EXIT_TIMEOUT = 124  # --max-time-s ran out
EXIT_USAGE = 2  # bad arguments, or a secret was needed and not given
EXIT_LAUNCHER = 1  # the launcher itself failed



def exit_code_of(returncode: int) -> int:
    """A rank's returncode as a shell would report it: a code as is, a
    signal s (asyncio's -s) as 128+s."""
    return returncode if returncode >= 0 else 128 - returncode


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL (exit code 137)"``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    return f"signal {signal_name(-returncode)} (exit code {exit_code_of(returncode)})"


@dataclass(frozen=True)
class RankExit:
    rank: int
    returncode: int
    exited_at: float  # time.monotonic()
    exception: str | None = None  # the exception line of its last traceback, if it wrote one


# A rank that died of one of these failed because another rank did (it was lost, or aborted the job)
VICTIM_ERRORS = ("PeerLostError", "PeerAbortedError")


def died_of_a_peer(exception: str | None) -> bool:
    """Whether an exception line (``runtime.errors.PeerAbortedError: rank 1 aborted ...``) says
    its rank failed because of another rank: a victim, never the job's first failure."""
    if not exception or ":" not in exception:
        return False
    return exception.split(":", 1)[0].strip().rsplit(".", 1)[-1] in VICTIM_ERRORS


def first_failure(exits: Sequence[RankExit], aborted_rank: int | None = None) -> RankExit | None:
    """The rank that failed first, from the exits seen so far, or None (no non-zero exit).

    The rank that aborted the job (``aborted_rank``, from the abort record) when it has failed;
    else the earliest failure (ties: the lowest rank) that did not die of a peer
    (:func:`died_of_a_peer`); else, when only victims have failed, the earliest of them."""
    failed = [e for e in exits if e.returncode != 0]
    if not failed:
        return None
    for e in failed:
        if e.rank == aborted_rank:
            return e
    causes = [e for e in failed if not died_of_a_peer(e.exception)] or failed
    return min(causes, key=lambda e: (e.exited_at, e.rank))


def cause_still_running(failure: RankExit, aborted_rank: int | None, running: Sequence[int]) -> bool:
    """Whether the rank that caused ``failure`` may still be running here, so the launcher waits
    for it (a bounded while) before naming a rank: the rank the abort record names, or, for a
    victim, any rank still running (the one that raised exits after its traceback and its
    interpreter's teardown, often after the peers it aborted)."""
    if aborted_rank is not None and aborted_rank != failure.rank:
        return aborted_rank in running
    return aborted_rank is None and died_of_a_peer(failure.exception) and bool(running)


class Ending(enum.Enum):
    SUCCEEDED = "succeeded"      # every rank exited 0
    FAILED = "failed"            # a rank exited non-zero or by a signal
    INTERRUPTED = "interrupted"  # the launcher got a signal
    TIMED_OUT = "timed out"      # --max-time-s ran out


@dataclass
class Outcome:
    """How one attempt ended."""

    ending: Ending
    failure: RankExit | None = None   # FAILED: the first failing rank
    signum: int | None = None         # INTERRUPTED: the signal the launcher got
    tail: list[str] = field(default_factory=list)  # FAILED: its last lines
    last_exception: str | None = None  # FAILED: the last line of its last traceback
    running: list[int] = field(default_factory=list)  # TIMED_OUT: ranks still running
    usage_error: str | None = None  # FAILED with EXIT_USAGE: the usage error line a rank wrote

    @property
    def is_usage_error(self) -> bool:
        """A rank exited with a usage error (exit code 2, after a ``PROG: error: ...`` line):
        the command line or the configuration is wrong; a restart would fail the same way."""
        return (self.ending is Ending.FAILED and self.failure.returncode == EXIT_USAGE
                and self.usage_error is not None)


class Action(enum.Enum):
    EXIT = "exit"
    RESTART = "restart"


def next_step(outcome: Outcome, restarts_done: int, max_restarts: int) -> tuple[Action, int]:
    """What the launcher does after an attempt: ``(Action.RESTART, 0)`` or
    ``(Action.EXIT, code)`` with the code of ``--help``'s table (launch_config.EPILOG)."""
    if outcome.ending is Ending.SUCCEEDED:
        return Action.EXIT, 0
    if outcome.ending is Ending.INTERRUPTED:
        return Action.EXIT, 128 + int(outcome.signum or signal.SIGTERM)
    if outcome.ending is Ending.TIMED_OUT:
        return Action.EXIT, EXIT_TIMEOUT
    if restarts_done < max_restarts and not outcome.is_usage_error:
        return Action.RESTART, 0
    return Action.EXIT, exit_code_of(outcome.failure.returncode)


def failure_report(cfg: LaunchConfig, failure: RankExit, tail: Sequence[str],
                   aborted: dict | None = None, last_exception: str | None = None) -> list[str]:
    """The lines printed about a failed rank (without the ``[launch]`` prefix). ``aborted``:
    the job's abort record (``{"rank", "type", "message"}``), when a rank aborted it;
    ``last_exception``: the last line of the last traceback the rank wrote.

    A traceback that ends in ``tail`` was printed already, as the rank wrote it: it is named
    by its last line, not printed again."""
    local = failure.rank - cfg.node_rank * cfg.nproc
    where = f" (node {cfg.node_rank}, local rank {local})" if cfg.nnodes > 1 else ""
    lines = [f"rank {failure.rank}{where} failed first: {describe_exit(failure.returncode)}"]
    if aborted is not None:
        cause = f"{aborted.get('type')}: {aborted.get('message')}"
        lines[0] += (f", after aborting the job ({cause})" if aborted.get("rank") == failure.rank
                     else f"; rank {aborted.get('rank')} had aborted the job ({cause})")
    if last_exception is not None and last_exception in tail:
        lines.append(f"its traceback is above, ending: {last_exception}")
    elif tail:
        lines.append(f"last {len(tail)} lines of rank {failure.rank}:")
        lines.extend(f"  | {line}" for line in tail)
    else:
        lines.append(f"rank {failure.rank} wrote no output")
    return lines


def usage_report(job: str, failure: RankExit) -> str:
    """The one line the launcher ends a job with after a rank's usage error (the rank's error
    line is above it, written once)."""
    return f"job {job} stopped by the usage error above; exiting with {exit_code_of(failure.returncode)}"


def stop_plan(cfg: LaunchConfig, outcome: Outcome | None) -> tuple[int, str | None]:
    """How the rest of an attempt is stopped: the signal for every rank's
    group, and what to say first. ``outcome`` is None when the launcher
    itself failed in the middle of the attempt. A SUCCEEDED attempt is
    "stopped" too: that only reaches what the ranks left behind."""
    if outcome is None:
        return signal.SIGTERM, None
    if outcome.is_usage_error:
        return signal.SIGTERM, None  # the error line above says it all: failure_report ends it
    if outcome.ending is Ending.FAILED:
        f = outcome.failure
        return signal.SIGTERM, (f"rank {f.rank} failed with {describe_exit(f.returncode)}; "
                                f"stopping the other ranks")
    if outcome.ending is Ending.INTERRUPTED:
        return outcome.signum, None  # forwarded as is: SIGINT stays SIGINT
    if outcome.ending is Ending.TIMED_OUT:
        return signal.SIGTERM, (f"the job ran past --max-time-s {cfg.max_time_s:g}; stopping "
                                f"{ranks_in_words(outcome.running)}")
    return signal.SIGTERM, None


def restart_message(outcome: Outcome, restarts_done: int, max_restarts: int) -> str:
    f = outcome.failure
    return (f"restarting the job ({restarts_done + 1} of {max_restarts}) after rank {f.rank} "
            f"failed with {describe_exit(f.returncode)}")
