"""Whose turn comes first when bulk work hands the loop back (runtime/turns.py ``yield_turn``), and
the roots of gather and scatter: what a root does first, and their answers against NumPy.

A task that waits on a timer or a socket is woken by the loop's next iteration, behind the task
that yielded; one ``asyncio.sleep(0)`` let the yielder run a whole stretch of work again before
the woken task (two TURN_S in a row). These tests count pieces of work between two turns of a task
woken by a timer (TURN_S = 0: a turn after every piece), under asyncio's loop and under uvloop; no
clock is read. The direct gather's root posts every receive before it copies its own block (a
block that arrives before its receive is kept and copied once more): a recording Comm sees the
order. The answers: gather, scatter and their v-variants over loopback TCP on 2, 3 and 4 ranks,
blocks of odd lengths past the one-read path (1 MiB), several dtypes.
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import collectives as C
from collectives import comm
from collectives.algorithms.tcp import gather_direct, gather_v_direct
from runtime import turns
from runtime.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


def loops():
    """(id, loop factory) for asyncio's own loop and uvloop where installed."""
    out = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return out
    return out + [pytest.param(uvloop.new_event_loop, id="uvloop")]


def run_on(factory, coro_fn):
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro_fn())


class TimerTicker:
    """A task woken by the loop's timers (``call_later(0)``), like a heartbeat or a loader's
    ``asyncio.sleep``: ``between`` is the most pieces of work recorded between two of its turns."""

    def __init__(self):
        self.pieces = 0
        self.between = 0
        self.turns = 0

    def piece(self) -> None:
        self.pieces += 1
        self.between = max(self.between, self.pieces)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            woken = loop.create_future()
            loop.call_later(0, woken.set_result, None)
            await woken
            self.turns += 1
            self.pieces = 0


@pytest.fixture
def every_piece(monkeypatch):
    monkeypatch.setattr(turns, "TURN_S", 0.0)  # a turn after every piece
    monkeypatch.setattr(turns, "PIECE_NBYTES", 3 * 4 * 1024)  # 1024 float32 elements per reduction piece


@pytest.mark.parametrize("factory", loops())
def test_a_yield_lets_what_the_loop_woke_run_first(factory):
    """A task woken by a timer and one woken by a socket run before the yielder goes on."""
    async def main():
        loop = asyncio.get_running_loop()
        order = []
        timer, sock = loop.create_future(), loop.create_future()

        async def waiter(name, fut):
            await fut
            order.append(name)
        tasks = [asyncio.ensure_future(waiter("timer", timer)), asyncio.ensure_future(waiter("socket", sock))]
        await asyncio.sleep(0)  # both wait now
        a, b = socket.socketpair()
        try:
            b.setblocking(False)
            loop.add_reader(b.fileno(), lambda: (b.recv(1), sock.done() or sock.set_result(None)))
            loop.call_later(0, timer.set_result, None)
            a.send(b"x")  # the socket is readable and the timer due before we yield
            await turns.yield_turn()
            order.append("yielder")
            loop.remove_reader(b.fileno())
        finally:
            a.close()
            b.close()
        await asyncio.gather(*tasks)
        return order
    order = run_on(factory, main)
    assert order.index("yielder") == 2, f"the yielder went on before a task the loop had woken: {order}"


@pytest.mark.parametrize("factory", loops())
def test_a_reduction_does_one_piece_between_turns_of_a_timer_woken_task(factory, every_piece):
    rng = np.random.default_rng(7)
    dst0 = rng.standard_normal(10_007).astype(np.float32)
    src = rng.standard_normal(10_007).astype(np.float32)
    step = turns.piece_items(4, 3)

    async def main():
        ticker = TimerTicker()
        task = asyncio.ensure_future(ticker.run())
        await asyncio.sleep(0)
        dst = dst0.copy()
        original = comm.reduce_now

        def counted(d, s, op):
            original(d, s, op)
            ticker.piece()
        comm.reduce_now = counted
        try:
            await comm.reduce_step(dst, src, "sum")
        finally:
            comm.reduce_now = original
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return dst, ticker
    dst, ticker = run_on(factory, main)
    np.testing.assert_array_equal(dst, dst0 + src)
    pieces = -(-dst.size // step)
    assert ticker.turns >= pieces - 1, f"{ticker.turns} turns of the ticker for {pieces} pieces"
    assert ticker.between <= 1, f"{ticker.between} pieces ran between two turns of a timer-woken task"


@pytest.mark.parametrize("factory", loops())
def test_two_tasks_of_one_call_each_stop_after_a_piece(factory, monkeypatch):
    """A send beside a reduction (halving-doubling): while one task yields, the other's next
    check says overdue, so the timer-woken task waits for at most a piece of each. On a clock
    moved by hand: each piece of ``a`` takes a whole TURN_S, those of ``b`` none, so without
    that rule ``b`` would run all its pieces in the turn ``a`` gives."""
    now = [1000.0]
    monkeypatch.setattr(turns, "_clock", lambda: now[0])
    monkeypatch.setattr(turns, "PIECE_NBYTES", 3 * 8 * 1024)  # 1024 float64 elements per piece
    a0, b0 = np.arange(9001, dtype=np.float64), np.arange(9001, dtype=np.float64)[::-1].copy()

    async def main():
        ticker = TimerTicker()
        task = asyncio.ensure_future(ticker.run())
        await asyncio.sleep(0)
        a, b = a0.copy(), a0.copy()
        original = comm.reduce_now

        def counted(d, s, op):
            original(d, s, op)
            ticker.piece()
            if d.base is a:
                now[0] += turns.TURN_S
        comm.reduce_now = counted
        try:
            await asyncio.gather(comm.reduce_step(a, b0, "max"), comm.reduce_step(b, b0, "min"))
        finally:
            comm.reduce_now = original
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return a, b, ticker
    a, b, ticker = run_on(factory, main)
    np.testing.assert_array_equal(a, np.maximum(a0, b0))
    np.testing.assert_array_equal(b, np.minimum(a0, b0))
    assert ticker.between <= 2, f"{ticker.between} pieces ran between two turns of a timer-woken task"


class RecordingComm:
    """A Comm of ``size`` ranks seen from ``rank``: a receive from rank j fills its buffer with
    j's block at once, and records whether the root's own block was already in ``out`` then."""

    def __init__(self, rank, size, blocks, own):
        self.rank, self.size, self.blocks, self.own = rank, size, blocks, own
        self.own_written_at_irecv = []

    def irecv(self, src, buf):
        self.own_written_at_irecv.append(bool(np.any(self.own())))
        np.frombuffer(buf, np.uint8)[:] = self.blocks[src].view(np.uint8)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


@pytest.mark.parametrize("algo", ["direct", "direct_v"])
async def test_the_direct_gather_root_posts_its_receives_before_copying_its_own_block(algo):
    n, root, count = 3, 1, (1 << 18) + 5  # blocks past the one-read path (1 MiB of float32)
    blocks = [np.full(count, j + 1, np.float32) for j in range(n)]
    out = np.zeros(n * count, np.float32)
    fake = RecordingComm(root, n, blocks, lambda: out[root * count:(root + 1) * count])
    if algo == "direct":
        await gather_direct.run(fake, out, blocks[root], root)
    else:
        await gather_v_direct.run(fake, out, blocks[root], [j * count for j in range(n + 1)], root)
    np.testing.assert_array_equal(out, np.concatenate(blocks))
    assert fake.own_written_at_irecv == [False] * (n - 1), "the root copied its own block before a receive was posted"


DTYPES = [np.float32, np.int32, np.float64]


def block(r: int, count: int, dtype) -> np.ndarray:
    return ((np.arange(count) * 7 + 1000 * r) % 251).astype(dtype)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", ["gather", "scatter"])
async def test_gather_and_scatter_over_tcp_against_numpy(n, op):
    count = (1 << 18) + 3  # odd, each block just past 1 MiB in float32
    root = n - 1

    async def body(g):
        r = g.rank
        for algo in ("direct", "tree"):
            for dtype in DTYPES:
                every = np.concatenate([block(j, count, dtype) for j in range(n)])
                if op == "gather":
                    out = np.zeros(n * count, dtype) if r == root else None
                    await C.gather(out, block(r, count, dtype), dst=root, algorithm=algo)
                    if r == root:
                        np.testing.assert_array_equal(out, every, err_msg=f"{algo} {dtype.__name__}")
                else:
                    out = np.zeros(count, dtype)
                    await C.scatter(out, every if r == root else None, src=root, algorithm=algo)
                    np.testing.assert_array_equal(out, block(r, count, dtype), err_msg=f"{algo} {dtype.__name__}")
    await run_ranks(n, body, transport="tcp")


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_gather_v_and_scatter_v_over_tcp_against_numpy(n):
    counts = [(1 << 18) + 3 + 11 * j if j % 2 == 0 else 0 for j in range(n)]  # odd, and empty blocks
    counts[-1] = 5
    root = 1
    offsets = np.concatenate([[0], np.cumsum(counts)])

    async def body(g):
        r = g.rank
        for dtype in DTYPES:
            every = np.concatenate([block(j, c, dtype) for j, c in enumerate(counts)])
            out = np.zeros(offsets[-1], dtype) if r == root else None
            await C.gather_v(out, block(r, counts[r], dtype), counts, dst=root)
            if r == root:
                np.testing.assert_array_equal(out, every, err_msg=dtype.__name__)
            got = np.zeros(counts[r], dtype)
            await C.scatter_v(got, every if r == root else None, counts, src=root)
            np.testing.assert_array_equal(got, block(r, counts[r], dtype), err_msg=dtype.__name__)
    await run_ranks(n, body, transport="tcp")
