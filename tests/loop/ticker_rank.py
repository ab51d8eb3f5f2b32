"""One rank of tests/loop/test_ticker.py: a 1 ms ticker task beside collectives in the same loop.

    python -m runtime.launch -n 2 tests/loop/ticker_rank.py [PHASE ...]

Each phase runs collectives for a while (closed-form results checked) while the ticker records
the largest gap between two of its turns; then the same ticker runs with nothing else (the idle
floor). Lines the test reads: ``GAP <rank> <phase> <busy ms> <idle ms> <calls>``, ``OK <rank>``.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

import collectives as C
import runtime

PHASES = {  # phase -> (shared memory on, elements of float32, seconds of back-to-back calls, or a count)
    "shm-small": (True, 256, 1.2, None),  # longer than the bound: a loop that never turns fails it
    "shm-large": (True, 4 << 20, None, 3),
    "tcp-small": (False, 256, 1.2, None),
    "tcp-large": (False, 4 << 20, None, 3),
}


class Ticker:
    def __init__(self):
        self.gap = 0.0
        self.last = time.perf_counter()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.gap = max(self.gap, now - self.last)
            self.last = now

    def reset(self) -> None:
        self.gap, self.last = 0.0, time.perf_counter()

    def take(self) -> float:
        now = time.perf_counter()
        gap = max(self.gap, now - self.last)  # a gap still open counts whole
        self.reset()
        return gap


async def phase(g, name: str, ticker: Ticker) -> None:
    shm_on, count, seconds, calls = PHASES[name]
    g.shm_enabled = shm_on
    n, r = g.size, g.rank
    x = np.empty(count, np.float32)
    x[:] = r + 1
    await C.all_reduce(x, group=g)  # set up (segments, connections) outside the measurement
    await C.barrier(group=g)
    ticker.reset()
    done = 0
    stop = time.perf_counter() + (seconds or 0.0)
    flag = np.zeros(1, np.int32)
    while True:
        x[:] = r + 1
        await C.all_reduce(x, group=g)
        assert x[0] == x[-1] == n * (n + 1) / 2, (name, x[:3])
        done += 1
        if calls is not None:
            if done >= calls:
                break
        else:  # every rank stops at the same call: rank 0's clock decides
            flag[0] = time.perf_counter() >= stop
            await C.broadcast(flag, src=0, group=g)
            if flag[0]:
                break
    busy = ticker.take()
    await C.barrier(group=g)
    ticker.reset()
    await asyncio.sleep(0.1)
    idle = ticker.take()
    print("GAP", r, name, f"{busy * 1e3:.1f}", f"{idle * 1e3:.1f}", done, flush=True)


async def main() -> None:
    rt = await runtime.init(timeout_s=60)
    g = rt.world
    ticker = Ticker()
    task = asyncio.get_running_loop().create_task(ticker.run())
    for name in sys.argv[1:] or list(PHASES):
        await phase(g, name, ticker)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    print("OK", g.rank, flush=True)
    await runtime.shutdown(rt)


if __name__ == "__main__":
    asyncio.run(main())
