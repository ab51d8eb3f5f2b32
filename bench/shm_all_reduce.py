"""all_reduce over shared memory vs the TCP path, 4 ranks, as a fraction of memory bandwidth.

    python -m runtime.launch -n 4 bench/shm_all_reduce.py [--sizes 4,1048576,...] [--reps 7]
        [--algos shm,tcp] [--spins 0,5,20,100]

Per size and path: warm-up (not timed), then ``reps`` repetitions of (shm barrier; ``iters``
calls back to back), the paths interleaved within each repetition (the machine is shared and
noisy); a repetition's time is the slowest rank's (an all_reduce max), the figure is the median
repetition, wall clock and CPU time of the process per call. busbw = algbw * 2(n-1)/n (the nccl-tests convention). The memory
reference is a one-core NumPy copy of 64 MiB (bytes copied / s), measured by rank 0 in the
same run while the other ranks sleep in a barrier. Rank 0 prints one line per size and path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import numpy as np

# bench/collectives.py is named like the package: with this folder first on sys.path, "import
# collectives" would import it. Put the repository root there instead.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (HERE, ROOT)]

import runtime  # noqa: E402
from collectives import api, registry  # noqa: E402
from collectives.algorithms.shared_memory import all_reduce_shm  # noqa: E402
from collectives.slots import common  # noqa: E402
from runtime import env  # noqa: E402
from runtime.sharedmem import domains  # noqa: E402


def copy_gbs() -> float:
    a = np.ones(64 << 17)  # 64 MiB of float64
    b = np.zeros_like(a)
    times = []
    for _ in range(9):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return a.nbytes / statistics.median(times) / 1e9


async def timed_block(g, x, algorithm, iters: int) -> tuple[float, float]:
    """(wall, cpu) seconds per call of the slowest rank over ``iters`` calls back to back."""
    await api.barrier(group=g, algorithm="shm")
    t, c = time.perf_counter(), time.process_time()
    for _ in range(iters):
        await api.all_reduce(x, group=g, algorithm=algorithm)
    both = np.array([(time.perf_counter() - t) / iters, (time.process_time() - c) / iters])
    await api.all_reduce(both, op="max", group=g, algorithm="shm")
    return float(both[0]), float(both[1])


def tcp_choice(nbytes: int, n: int) -> str:
    """The table's algorithm without shared memory, on one host (what a compressed sub-call runs)."""
    return registry.choose("all_reduce", nbytes, n, subcall=True)[0]


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4,1048576,16777216,67108864")
    p.add_argument("--algos", default="shm,tcp", help="shm, tcp (the TCP table), or an algorithm name")
    p.add_argument("--spins", default="", help="comma list of RINGWEAVE_SHM_SPIN values to compare")
    p.add_argument("--offloads", default="", help="comma list of collectives.slots.common.OFFLOAD_ALONE_MIN_NBYTES "
                   "values to compare (bytes of work from which copies/reductions go to a thread)")
    p.add_argument("--one-phase", default="", help="comma list of all_reduce_shm.ONE_PHASE_MAX_NBYTES values")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    rt = await runtime.init()
    g = rt.world
    n = g.size
    await api.barrier(group=g, algorithm="shm")
    bw = copy_gbs() if g.rank == 0 else 0.0
    await api.barrier(group=g, algorithm="shm")
    if g.rank == 0:
        print(f"ranks {n}; one-core numpy copy of 64 MiB: {bw:.2f} GB/s; os.cpu_count() {os.cpu_count()}")
    spins = [int(v) for v in a.spins.split(",")] if a.spins else [None]
    offloads = [int(float(v)) for v in a.offloads.split(",")] if a.offloads else [None]
    if a.one_phase:  # compared in place of --offloads
        offloads = [-int(float(v)) for v in a.one_phase.split(",")]
    variants = [(algo, (spin, off)) for algo in a.algos.split(",")
                for spin in (spins if algo == "shm" else [None]) for off in (offloads if algo == "shm" else [None])]
    for nbytes in [int(s) for s in a.sizes.split(",")]:
        x = np.ones(max(1, nbytes // 4), np.float32)
        iters = max(1, min(300, int(2e7 // max(nbytes, 1))))
        times = {v: [] for v in variants}
        for v in variants:  # warm-up: segments grown, kernels loaded
            for _ in range(3):
                await api.all_reduce(x, group=g, algorithm=tcp_choice(nbytes, n) if v[0] == "tcp" else v[0])
        for _ in range(a.reps):  # variants interleaved, so a noisy moment hits all of them
            for algo, (spin, off) in variants:
                if spin is not None:
                    os.environ[env.SHM_SPIN.name] = str(spin)
                if off is not None and off < 0:
                    all_reduce_shm.ONE_PHASE_MAX_NBYTES = -off
                elif off is not None:
                    common.OFFLOAD_ALONE_MIN_NBYTES = off
                name = tcp_choice(nbytes, n) if algo == "tcp" else algo
                times[(algo, (spin, off))].append(await timed_block(g, x, name, iters))
        if g.rank == 0:
            for (algo, (spin, off)), ts in times.items():
                wall = statistics.median(t for t, _ in ts)
                cpu = statistics.median(c for _, c in ts)
                algbw = nbytes / wall / 1e9
                busbw = algbw * 2 * (n - 1) / n
                name = f"tcp/{tcp_choice(nbytes, n)}" if algo == "tcp" else algo
                name += "" if spin is None else f"/spin{spin}"
                name += "" if off is None else f"/off{off:.0e}" if off >= 0 else f"/1phase<={-off:.0e}"
                print(f"all_reduce {nbytes:>10d} B  {name:>12s}  {wall * 1e6:10.1f} us (cpu {cpu * 1e6:8.1f} us)  "
                      f"busbw {busbw:6.3f} GB/s  busbw/copy {busbw / bw:6.1%}", flush=True)
    if g.rank == 0:
        print("shm statistics of rank 0:", domains.statistics(g))
    await runtime.shutdown(rt)


if __name__ == "__main__":
    asyncio.run(main())
