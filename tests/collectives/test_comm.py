"""The Comm protocol (collectives/comm.py) is what every algorithm receives: ``runtime.group.Call``
and ``SubComm`` both satisfy it, a SubComm renumbers its members, and an algorithm runs on a
SubComm as on a call (its messages are the call's own, checked the same way). The Comm's reduce
step reduces and gives the event loop its turns, so an algorithm never asks the loop itself."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from collectives import ops
from collectives.algorithms.tcp import all_reduce_ring
from collectives.comm import Comm, SubComm, reduce_step
from runtime import turns
from runtime.group import Call
from tests.loopturns import counted

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


async def test_call_and_subcomm_are_comms_and_a_subcomm_runs_an_algorithm(ranks):
    """Ranks 1 and 3 of a 4-rank call all_reduce among themselves over a SubComm of it."""
    async def body(g):
        call = g.open_call(ops.fingerprint("all_reduce", op="sum", dtype=np.float64, count=3, algo="ring"), None)
        assert isinstance(call, Call) and isinstance(call, Comm)
        x = np.full(3, float(g.rank))

        async def run(comm):
            if comm.rank in (1, 3):
                sub = SubComm(comm, [1, 3])
                assert isinstance(sub, Comm)
                assert (sub.rank, sub.size, sub.seq, sub.fingerprint, sub.group) == (
                    [1, 3].index(comm.rank), 2, comm.seq, comm.fingerprint, comm.group)
                await all_reduce_ring.run(sub, x, "sum")
        await g.run(call, run)
        return x
    out = await ranks(4, body)
    for r, x in enumerate(out):
        np.testing.assert_array_equal(x, 4.0 if r in (1, 3) else float(r))


def test_a_thing_without_the_members_is_not_a_comm():
    class Half:
        rank, size = 0, 1

        async def send(self, dst, buf):
            pass
    assert not isinstance(Half(), Comm)


def test_no_algorithm_looks_behind_its_comm():
    """Algorithms read what they need from the Comm, never through it (``comm.send.__self__``)."""
    found = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "collectives").rglob("*.py"))
             if "__self__" in p.read_text()]
    assert not found, found


async def test_the_reduce_step_gives_the_loop_its_turns():
    """Reductions that wait on nothing (segments that all arrived at once), back to back for 60 ms:
    the loop's other tasks still run, about once per turns.TURN_S, and every reduction is made."""
    async with counted() as turned:
        steps = 0
        dst, src = np.zeros(1024, np.float32), np.ones(1024, np.float32)
        end = time.perf_counter() + 0.06
        while time.perf_counter() < end:
            await reduce_step(dst, src, "sum")
            steps += 1
        ran = turned.count
    np.testing.assert_array_equal(dst, np.float32(steps))
    assert ran >= 0.06 / (10 * turns.TURN_S), f"the ticker ran {ran} times in 60 ms of reductions"
