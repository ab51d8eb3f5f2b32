"""The launcher names the rank that failed first, never one that died of it.

A rank that raises exits after its traceback and its interpreter's teardown, often after the
peers it aborted (each dies of a PeerAbortedError or PeerLostError within milliseconds). The
launcher names the rank the abort record names, else the first rank that did not die of a
peer (launch_outcome.first_failure), and waits a bounded while for it when only victims have
exited (launch.watch). Checked as a pure decision, then with real rank processes that exit in
the victims-first order, ten times in a row.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.launch_outcome import RankExit, cause_still_running, died_of_a_peer, first_failure

ROOT = str(Path(__file__).resolve().parents[2])
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


def _launch(script: str, nproc: int) -> subprocess.CompletedProcess:
    """The real launcher, in a process of its own: it reaps and kills the orphans of whatever
    process runs it, so it must not run inside the test's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "runtime.launch", "-n", str(nproc), "--grace-s", "5", script],
                          env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(60)
def test_ten_jobs_whose_victims_exit_first_name_the_raiser(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(FAKE_RANK.replace("{LINES}", repr([ABORTED, RAISED, LOST])))
    for _ in range(10):
        done = _launch(str(script), 3)
        assert done.returncode == 1, done.stderr
        assert "rank 1 failed with exit code 1" in done.stderr, done.stderr
        assert "rank 0 failed" not in done.stderr and "rank 2 failed" not in done.stderr, done.stderr
