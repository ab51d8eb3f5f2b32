"""``launch.watch`` (the attempt's executor) and the launcher's signal
handling, over fake ranks: futures stand in for process exits."""

from __future__ import annotations

import asyncio
import io
import signal
import time
from dataclasses import dataclass, field

import pytest

from runtime import launch
from runtime.launch import Console, Stopper
from runtime.launch_outcome import Ending

pytestmark = pytest.mark.timeout(10)


def _done_future() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


@dataclass
class FakeProtocol:
    exited: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    exited_at: float | None = None
    pipes_closed: asyncio.Future = field(default_factory=_done_future)
    last_exception: str | None = None  # the exception line of its last traceback


@dataclass
class FakeRank:
    rank: int
    protocol: FakeProtocol = field(default_factory=FakeProtocol)

    @property
    def returncode(self):
        return self.protocol.exited.result() if self.protocol.exited.done() else None

    def exit(self, returncode: int, exception: str | None = None) -> None:
        self.protocol.last_exception = exception
        self.protocol.exited_at = time.monotonic()
        self.protocol.exited.set_result(returncode)


def console() -> tuple[Console, io.BytesIO]:
    err = io.BytesIO()
    return Console(out=io.BytesIO(), err=err), err


async def test_every_rank_exiting_0_succeeds():
    ranks = [FakeRank(r) for r in range(3)]
    loop = asyncio.get_running_loop()
    for i, r in enumerate(ranks):
        loop.call_later(0.01 * i, r.exit, 0)
    outcome = await launch.watch(ranks, Stopper(console()[0]), deadline=None)
    assert outcome.ending is Ending.SUCCEEDED


async def test_first_failure_ends_the_watch_without_waiting_for_the_others():
    ranks = [FakeRank(r) for r in range(3)]
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, ranks[0].exit, 0)
    loop.call_later(0.02, ranks[2].exit, -signal.SIGKILL)
    outcome = await launch.watch(ranks, Stopper(console()[0]), deadline=None)
    assert outcome.ending is Ending.FAILED
    assert (outcome.failure.rank, outcome.failure.returncode) == (2, -signal.SIGKILL)
    assert ranks[1].returncode is None  # still running: stopping it is run_attempt's job


async def test_two_failures_seen_together_pick_the_earlier():
    ranks = [FakeRank(r) for r in range(3)]
    ranks[2].exit(7)
    ranks[1].exit(4)
    outcome = await launch.watch(ranks, Stopper(console()[0]), deadline=None)
    assert (outcome.failure.rank, outcome.failure.returncode) == (2, 7)


async def test_a_victim_seen_first_waits_for_the_rank_that_raised():
    ranks = [FakeRank(r) for r in range(3)]
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, ranks[0].exit, 1, "runtime.errors.PeerAbortedError: rank 2 aborted the job: ValueError: x")
    loop.call_later(0.05, ranks[2].exit, 1, "ValueError: x")
    outcome = await launch.watch(ranks, Stopper(console()[0]), deadline=None, settle_s=5.0)
    assert (outcome.failure.rank, outcome.failure.exception) == (2, "ValueError: x")


async def test_a_victim_is_named_when_no_cause_exits_within_the_settle_time():
    ranks = [FakeRank(r) for r in range(2)]
    ranks[0].exit(1, "runtime.errors.PeerLostError: rank 1 was lost")
    t0 = time.monotonic()
    outcome = await launch.watch(ranks, Stopper(console()[0]), deadline=None, settle_s=0.2)
    assert outcome.failure.rank == 0 and 0.15 < time.monotonic() - t0 < 2.0
    assert ranks[1].returncode is None


async def test_the_rank_the_abort_record_names_is_waited_for():
    ranks = [FakeRank(r) for r in range(2)]
    ranks[0].exit(1)  # no traceback: only the abort record says rank 1 caused it
    asyncio.get_running_loop().call_later(0.05, ranks[1].exit, 3)
    outcome = await launch.watch(ranks, Stopper(console()[0]), deadline=None, aborted=lambda: {"rank": 1},
                                 settle_s=5.0)
    assert (outcome.failure.rank, outcome.failure.returncode) == (1, 3)


async def test_a_signal_to_the_launcher_interrupts():
    ranks = [FakeRank(0)]
    stopper = Stopper(console()[0])
    asyncio.get_running_loop().call_later(0.01, stopper.on_signal, signal.SIGTERM)
    outcome = await launch.watch(ranks, stopper, deadline=None)
    assert (outcome.ending, outcome.signum) == (Ending.INTERRUPTED, signal.SIGTERM)


async def test_deadline_times_out_and_names_the_running_ranks():
    ranks = [FakeRank(0), FakeRank(1)]
    ranks[0].exit(0)
    outcome = await launch.watch(ranks, Stopper(console()[0]), deadline=time.monotonic() + 0.05)
    assert (outcome.ending, outcome.running) == (Ending.TIMED_OUT, [1])


async def test_second_signal_hurries_the_stop():
    con, err = console()
    stopper = Stopper(con)
    stopper.on_signal(signal.SIGINT)
    assert (stopper.requested.result(), stopper.hurried) == (signal.SIGINT, False)
    stopper.on_signal(signal.SIGINT)
    assert stopper.hurried and stopper.requested.result() == signal.SIGINT
    assert err.getvalue().count(b"[launch] got SIGINT") == 1


def test_console_survives_a_closed_stdout():
    class Closed(io.BytesIO):
        def write(self, data):
            raise BrokenPipeError

    err = io.BytesIO()
    con = Console(out=Closed(), err=err)
    con.write(1, b"lost\n")
    con.write(1, b"lost too\n")
    con.say("still here")
    assert err.getvalue() == b"[launch] still here\n"
