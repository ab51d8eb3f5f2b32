"""One rank of the process tests of tests/shm/test_shm_fastpath_inline.py.

    python tests/shm/fastpath_inline_rank.py MODE      (RANK, WORLD_SIZE, MASTER_* from the test)

Modes: ``kill`` and ``stop``: both ranks run small calls until the inline path serves them, then
rank 1 says READY and sleeps (the test SIGKILLs or SIGSTOPs it) while rank 0 is in an inline
all_reduce; ``blocking``: the Communicator's small calls, checked against closed forms, a peer late
now and then. Lines the test reads: ``READY <rank>``, ``ENTER <rank> <inline calls>``, ``REST <rank>``
(the call entered inline and a peer was late), ``CAUGHT <rank> <exception> <seconds> <message>``,
``OK <rank> <inline calls>``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np

import collectives as C
import runtime
from collectives.slots import inline
from runtime.sharedmem import domains


def say(*words) -> None:
    print(*words, flush=True)


def inline_calls(g) -> int:
    return domains.statistics(g)["0d0"]["inline"]


async def small_calls(g, calls: int) -> None:
    n, r = g.size, g.rank
    x = np.zeros(3, np.float32)
    for i in range(calls):
        x[:] = r + i
        await C.all_reduce(x, group=g)
        assert np.all(x == n * i + n * (n - 1) / 2), (i, x)
        await C.barrier(group=g)


async def faults(mode: str) -> None:
    rt = await runtime.init(timeout_s=60)
    g = rt.world
    await small_calls(g, 200)
    if g.rank == 1:
        say("READY", g.rank)
        await asyncio.sleep(60)
        os._exit(0)
    rest = inline._rest

    def announced(*args, **kw):
        say("REST", g.rank)
        return rest(*args, **kw)

    inline._rest = announced
    say("ENTER", g.rank, inline_calls(g))
    t = time.monotonic()
    try:
        await C.all_reduce(np.ones(4, np.float32), group=g, timeout=1.0 if mode == "stop" else 30.0)
        say("NOERROR", g.rank)
    except Exception as exc:  # noqa: BLE001 - the test reads the name
        say("CAUGHT", g.rank, type(exc).__name__, f"{time.monotonic() - t:.3f}", str(exc)[:300])
    os._exit(0)


def blocking() -> None:
    with C.Communicator.from_env(timeout=60) as comm:
        n, r = comm.world_size, comm.rank
        calls = 0
        for i in range(300):
            for dtype, op in ((np.float32, "sum"), (np.int64, "max"), (np.float64, "avg"), (np.int32, "min")):
                if r == 1 and i % 50 == 7:
                    time.sleep(0.02)  # late: the peer's call goes on through the loop
                x = np.full(5 if i % 2 else 256, r + i, dtype)
                comm.all_reduce(x, op=op)
                calls += 1
                want = {"sum": n * i + n * (n - 1) / 2, "max": i + n - 1, "min": i,
                        "avg": (n * i + n * (n - 1) / 2) / n}[op]
                assert np.all(x == np.asarray(want, dtype)), (i, dtype, op, x[:4], want)
            comm.barrier()
        say("OK", r, inline_calls(comm.world), calls)


if __name__ == "__main__":
    if sys.argv[1] == "blocking":
        blocking()
    else:
        asyncio.run(faults(sys.argv[1]))
