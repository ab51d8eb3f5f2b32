"""One rank of the multi-process shared-memory tests (tests/shm/test_shm_processes.py).

    python tests/shm/shm_rank.py MODE      (RANK, WORLD_SIZE, MASTER_* from the launcher or the test)

Modes: ``matrix`` (collectives through the default table, closed forms), ``kill`` (rank 3 is
killed by the test while the others wait in an shm all_reduce; ``kill-small`` and ``kill-barrier``:
in the compiled small all_reduce and barrier), ``timeout`` (rank 3 never
calls), ``leftover`` (rank 1 creates a segment and SIGKILLs itself before it could unlink it).
Lines the test reads: ``READY <rank>``, ``CAUGHT <rank> <exception> <time>``, ``OK <rank>``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import numpy as np

import collectives as C
import runtime
from runtime import env
from runtime.sharedmem import domains, segments


def say(*words) -> None:
    print(*words, flush=True)


async def matrix(g) -> None:
    n, r = g.size, g.rank
    for count in (0, 1, 7, 16_385, 1_000_003):
        for dtype, op in [(np.float32, "sum"), (np.int64, "max"), (np.float64, "avg"), (np.int8, "prod"),
                          (np.float16, "min")]:
            i = np.arange(count)
            if op in ("sum", "avg"):
                x, want = (r + 1 + i % 7).astype(dtype), n * (n + 1) / 2 + n * (i % 7)
                want = want / n if op == "avg" else want
            elif op == "prod":
                x, want = np.full(count, 2 if r % 2 else 1, dtype), np.full(count, 2 ** (n // 2))
            else:
                x, want = ((r + i) % n + i % 7).astype(dtype), i % 7 + (0 if op == "min" else n - 1)
            await C.all_reduce(x, op=op, group=g)
            assert np.array_equal(x, np.asarray(want).astype(dtype)), (count, dtype, op, x[:5])
        out = np.zeros(n * count, np.int32)
        await C.all_gather(out, np.full(count, r, np.int32), group=g)
        assert np.array_equal(out, np.repeat(np.arange(n), count))
        y = np.full(count, r, np.float32)
        await C.broadcast(y, src=n - 1, group=g, algorithm="shm")  # the table takes TCP below 256 KiB at 2-4 ranks
        assert np.all(y == n - 1)
        o = np.zeros(count, np.int64)
        await C.reduce_scatter(o, np.arange(n * count, dtype=np.int64), group=g)
        assert np.array_equal(o, n * np.arange(r * count, (r + 1) * count))
        await C.barrier(group=g)
    stats = domains.statistics(g)
    assert stats and stats["0d0"]["posts"] > 0, stats  # it went through shared memory
    x = np.zeros(1, np.float32)
    for i in range(2000):  # many small calls of two fingerprints (a torn header once showed here)
        await C.barrier(group=g)
        x[0] = r
        await C.all_reduce(x, group=g)
        assert x[0] == n * (n - 1) / 2
    await mixed_sequence(g)
    g.runtime.nodes = ["A", "B"] * (n // 2) + ["A"] * (n % 2)  # pretend: two nodes
    for count in (0, 5, 300_001):
        x = np.full(count, r + 1, np.float64)
        await C.all_reduce(x, group=g)  # the table: hierarchical over 64 KiB, TCP below
        assert np.all(x == n * (n + 1) / 2), (count, x[:4])
    assert set(domains.statistics(g)) == {"0d0", "0d1" if r % 2 == 0 else "0d2"}, domains.statistics(g)
    say("OK", r)


async def mixed_sequence(g, calls: int = 600) -> None:
    """Small and large all_reduces, barriers and broadcasts in one random order (the same on every
    rank), each rank sleeping a random 0-2 ms before some calls (its own draw), so ranks run ahead
    of each other by a call or two: slot reuse, the EXIT-less small calls and the data calls'
    EXIT waits all meet. Every result is checked against its closed form."""
    import random
    n, r = g.size, g.rank
    order = random.Random(1234)
    mine = random.Random(r)
    big = 300_001
    for i in range(calls):
        kind = order.choice(["small", "small", "barrier", "big", "bcast"])
        count = order.randrange(1, 17)
        root = order.randrange(n)
        if mine.random() < 0.3:
            time.sleep(mine.random() * 0.002)  # blocks this rank's loop: a late arrival
        if kind == "small":
            x = np.full(count, r + i, np.int64)
            await C.all_reduce(x, group=g)
            assert np.all(x == n * i + n * (n - 1) // 2), (i, kind, x)
        elif kind == "barrier":
            await C.barrier(group=g)
        elif kind == "big":
            x = np.full(big, float(r + 1), np.float64)
            await C.all_reduce(x, group=g)
            assert np.all(x == n * (n + 1) / 2), (i, kind, x[:4])
        else:
            y = np.full(count * 1000 if i % 2 else count, r * 1000 + i, np.int32)
            await C.broadcast(y, src=root, group=g, algorithm="shm")
            assert np.all(y == root * 1000 + i), (i, kind, root, y[:4])


async def main() -> None:
    mode = sys.argv[1]
    rt = await runtime.init(timeout_s=60)
    g = rt.world
    if mode == "matrix":
        await matrix(g)
        await runtime.shutdown(rt)
        return
    if mode == "leftover":
        if g.rank == 1:
            path = os.path.join(segments.SHM_DIR, segments.job_prefix(env.JOB.get()) + "x-g0d0-r1-ctl")
            segments.Segment.create(path, 4096)
            say("CREATED", path)
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(30)  # the launcher stops us when rank 1 dies
        return
    x = np.ones(100_000, np.float32)
    await C.all_reduce(x, group=g)  # the domain is set up: segments mapped, names gone
    if mode in ("kill-small", "kill-barrier"):  # the compiled small path (collectives/slots/fastpath.py)
        x = np.ones(16, np.float32)
        await C.all_reduce(x, group=g)
        await C.barrier(group=g)
    if g.rank == 3:
        say("READY", g.rank)
        await asyncio.sleep(4 if mode == "timeout" else 60)
        os._exit(0)
    dom = domains.domain(g, list(range(g.size)))
    say("ENTER", g.rank, "compiled" if dom.compiled is not None and dom.compiled.enabled else "python")
    t = time.time()
    try:
        if mode == "kill-barrier":
            await C.barrier(group=g, timeout=60)
        else:
            await C.all_reduce(x, group=g, timeout=1.0 if mode == "timeout" else 60)
        say("NOERROR", g.rank)
    except Exception as exc:  # noqa: BLE001 - the test reads the name
        say("CAUGHT", g.rank, type(exc).__name__, f"{time.time():.3f}", f"{time.time() - t:.3f}", str(exc)[:200])
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main())
