"""The launcher names the rank that failed first, never one that died of it.

A rank that raises exits after its traceback and its interpreter's teardown, often after the
peers it aborted (each dies of a PeerAbortedError or PeerLostError within milliseconds). The
launcher names the rank the abort record names, else the first rank that did not die of a
peer (launch_outcome.first_failure), and waits a bounded while for it when only victims have
exited (launch.watch). Checked as a pure decision, then with real rank processes that exit in
the victims-first order, ten times in a row.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import os

import pytest

from runtime import launch
from runtime.launch_config import LaunchConfig
from runtime.launch_outcome import Ending, RankExit, cause_still_running, died_of_a_peer, first_failure

RAISED = "ValueError: boom in rank 1"
ABORTED = "runtime.errors.PeerAbortedError: rank 1 aborted the job: ValueError: boom in rank 1"
LOST = "runtime.errors.PeerLostError: rank 1 was lost (group 0): connection closed by the peer"


def test_an_exception_line_says_whether_its_rank_died_of_a_peer():
    assert died_of_a_peer(ABORTED) and died_of_a_peer(LOST) and died_of_a_peer("PeerLostError: x")
    assert not died_of_a_peer(RAISED) and not died_of_a_peer(None) and not died_of_a_peer("")
    assert not died_of_a_peer("runtime.errors.CollectiveTimeoutError: rank 0: all_reduce timed out")
    assert not died_of_a_peer("a line that names PeerLostError but is no exception line")


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_the_raiser_is_named_in_whatever_order_the_ranks_exit(order):
    """Every order of exits (victims first in most of them), with and without the abort record."""
    line = {0: ABORTED, 1: RAISED, 2: LOST, 3: ABORTED}
    exits = [RankExit(rank, 1, float(t), line[rank]) for t, rank in enumerate(order)]
    assert first_failure(exits).rank == 1
    assert first_failure(exits, aborted_rank=1).rank == 1
    seen_first = exits[:order.index(1)]  # before the raiser exits: a victim, and the cause is still running
    if seen_first:
        victim = first_failure(seen_first)
        assert died_of_a_peer(victim.exception)
        assert cause_still_running(victim, None, [1])
        assert cause_still_running(victim, 1, [1])
        assert not cause_still_running(victim, 1, [])  # the raiser exited 0 or runs elsewhere


def test_without_a_victim_the_earliest_failure_wins_and_a_recorded_abort_comes_first():
    exits = [RankExit(0, 0, 1.0), RankExit(3, 1, 2.0), RankExit(2, -9, 1.5), RankExit(1, 4, 1.5)]
    assert first_failure(exits) == RankExit(1, 4, 1.5)
    assert first_failure(exits, aborted_rank=3) == RankExit(3, 1, 2.0)
    assert first_failure(exits, aborted_rank=0) == RankExit(1, 4, 1.5)  # rank 0 aborted but exited 0
    assert not cause_still_running(RankExit(1, 4, 1.5), None, [5])
    assert first_failure([RankExit(0, 0, 1.0)]) is None and first_failure([]) is None


# A rank of the fake job: the victims print their PeerAbortedError traceback and exit at once;
# rank 1, the raiser, exits after them (as a rank tearing its interpreter down does).
FAKE_RANK = r'''
import os, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(0.4)
line = {LINES}[rank]
print("Traceback (most recent call last):", file=sys.stderr)
print('  File "job.py", line 1, in <module>', file=sys.stderr)
print(line, file=sys.stderr, flush=True)
sys.exit(1)
'''


async def _attempt(script: str, nproc: int, aborted=lambda: None):
    cfg = LaunchConfig(nproc=nproc, target=script, grace_s=5.0)
    out, err = io.BytesIO(), io.BytesIO()
    console = launch.Console(out, err)
    envs = [dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc)) for r in range(nproc)]
    stopper = launch.Stopper(console)
    outcome = await launch.run_attempt(cfg, envs, console, stopper, None, aborted)
    return outcome, err.getvalue().decode()


@pytest.mark.timeout(60)
def test_ten_jobs_whose_victims_exit_first_name_the_raiser(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(FAKE_RANK.replace("{LINES}", repr([ABORTED, RAISED, LOST])))

    async def ten():
        return [await _attempt(str(script), 3) for _ in range(10)]

    for outcome, err in asyncio.run(ten()):
        assert outcome.ending is Ending.FAILED, err
        assert outcome.failure.rank == 1, err
        assert outcome.failure.exception == RAISED, err
        assert "rank 1 failed with exit code 1" in err, err
