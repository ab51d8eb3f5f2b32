"""The compiled small shared-memory path (collectives/slots/fastpath.py), per call: how long a
small all_reduce and a barrier take inline (collectives/slots/inline.py: from the public call
straight to the compiled kernel), through calls.py to the compiled path, and through the Python
reference, and how much of the inline call's time is Python rather than the compiled function.

    python -m runtime.launch -n 2 bench/shm_fastpath.py [--calls 5000] [--reps 5] [--counts 1,256,16384]

Per repetition and case: ``calls`` calls back to back, inline, then compiled (``inline.all_reduce``
and ``inline.barrier`` declining), then Python (``fastpath.usable`` and ``fastpath.SUPPORTED``
switched off too), each rank timing its whole loop and, inline, the time spent inside the compiled
function (``perf_counter`` around each call, which adds ~0.1 us). Python per call = (loop - inside)
/ calls. Printed by rank 0: medians over repetitions of the slowest rank, in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))  # bench/collectives.py is named like the package
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (HERE, ROOT)]

import runtime  # noqa: E402
from collectives import api  # noqa: E402
from collectives.slots import fastpath, inline  # noqa: E402
from runtime.sharedmem import domains  # noqa: E402


class Inside:
    """Wraps a compiled function and sums the time spent in it."""

    def __init__(self, fn):
        self.fn, self.s = fn, 0.0

    def __call__(self, *args):
        t = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.s += time.perf_counter() - t


async def loop(g, what: str, x, calls: int) -> float:
    await api.barrier(group=g, algorithm="shm")
    t = time.perf_counter()
    if what == "barrier":
        for _ in range(calls):
            await api.barrier(group=g, algorithm="shm")
    else:
        for _ in range(calls):
            await api.all_reduce(x, group=g, algorithm="shm")
    return time.perf_counter() - t


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--counts", default="1,256,16384", help="float32 elements of the all_reduces")
    a = p.parse_args()
    rt = await runtime.init()
    g = rt.world
    inline_all_reduce, inline_barrier = inline.all_reduce, inline.barrier
    cases = [("barrier", None)] + [(f"all_reduce {int(c) * 4} B", np.ones(int(c), np.float32))
                                   for c in a.counts.split(",")]
    rows = {name: {"inline": [], "compiled": [], "python": [], "python_per_call": []} for name, _ in cases}
    usable, supported = fastpath.usable, fastpath.SUPPORTED
    for name, x in cases:  # warm-up: compile, set up the domain
        await loop(g, name, x, 100)
    fastpath._compiled(domains.domain(g, list(range(g.size)))).enabled = True  # whatever RINGWEAVE_SHM_COMPILED says

    def off(*args, **kw) -> None:  # the inline path declines: the calls go through calls.py
        return None

    for _ in range(a.reps):
        for name, x in cases:
            inside_ar, inside_b = Inside(inline._inline_all_reduce), Inside(inline._inline_barrier)
            inline._inline_all_reduce, inline._inline_barrier = inside_ar, inside_b
            try:
                inlined = await loop(g, name, x, a.calls)
            finally:
                inline._inline_all_reduce, inline._inline_barrier = inside_ar.fn, inside_b.fn
            inline.all_reduce, inline.barrier = off, off
            try:
                compiled = await loop(g, name, x, a.calls)
                fastpath.usable, fastpath.SUPPORTED = (lambda x: False), False
                python = await loop(g, name, x, a.calls)
            finally:
                fastpath.usable, fastpath.SUPPORTED = usable, supported
                inline.all_reduce, inline.barrier = inline_all_reduce, inline_barrier
            own = np.array([inlined, compiled, python, inlined - inside_ar.s - inside_b.s]) / a.calls * 1e6
            await api.all_reduce(own, op="max", group=g, algorithm="shm")
            for k, v in zip(("inline", "compiled", "python", "python_per_call"), own):
                rows[name][k].append(float(v))
    if g.rank == 0:
        print(f"# {g.size} ranks, {a.calls} calls x {a.reps} repetitions; us per call, medians of the slowest rank")
        print(f"{'case':>22} {'inline':>8} {'compiled':>9} {'python':>9} {'python/inline':>14} "
              f"{'python work in inline':>22}")
        for name, _ in cases:
            r = {k: statistics.median(v) for k, v in rows[name].items()}
            print(f"{name:>22} {r['inline']:8.2f} {r['compiled']:9.2f} {r['python']:9.2f} "
                  f"{r['python'] / r['inline']:14.2f} {r['python_per_call']:22.2f}")
    await runtime.shutdown(rt)


if __name__ == "__main__":
    asyncio.run(main())
