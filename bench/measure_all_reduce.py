"""Measures all_reduce per algorithm and size, to set the registry's default table.

    python -m runtime.launch -n 4 bench/measure_all_reduce.py [--runs 20] [--max-mib 64] \
        [--algos ring,halving_doubling,recursive_doubling] [--sizes 4,1024,...]

Rank 0 prints one line per (size, algorithm): the median over ``--runs`` of
the slowest rank's time (a barrier before each run, warm-up not timed) and
the bus bandwidth ``2 (n-1)/n * bytes / time``. float32, sum. This is not the
project benchmark (bench/collectives.py is); it is the measurement behind
collectives/registry.py.
"""

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

import collectives as C  # noqa: E402
import runtime  # noqa: E402


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--max-mib", type=float, default=64)
    p.add_argument("--algos", default="ring,halving_doubling,recursive_doubling")
    p.add_argument("--sizes", default="")
    p.add_argument("--collective", default="all_reduce")
    args = p.parse_args()
    rt = await runtime.init()
    n, world = rt.world_size, rt.world
    from collectives.kernels import cpu
    cpu.warmup()
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes, s = [], 4
        while s <= args.max_mib * 2**20:
            sizes.append(s)
            s *= 4
    if rt.rank == 0:
        print(f"# {args.collective}, {n} ranks, float32 sum, median of {args.runs} (max over ranks)")
        print(f"{'bytes':>10} {'algorithm':>20} {'median_us':>11} {'busbw_GB/s':>10}")
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        for algo in args.algos.split(","):
            x = np.ones(count, np.float32)
            out = np.empty(count * n, np.float32)
            times = []
            runs = args.runs if nbytes < 2**24 else max(5, args.runs // 4)
            for i in range(runs + 3):
                await C.barrier(world)
                t0 = time.perf_counter()
                if args.collective == "all_reduce":
                    await C.all_reduce(x, algorithm=algo)
                elif args.collective == "all_gather":
                    await C.all_gather(out, x, algorithm=algo)
                elif args.collective == "reduce_scatter":
                    await C.reduce_scatter(x, out, algorithm=algo)
                elif args.collective == "broadcast":
                    await C.broadcast(x, 0, algorithm=algo)
                dt = np.array([time.perf_counter() - t0])
                await C.all_reduce(dt, op="max", algorithm="recursive_doubling")
                if i >= 3:
                    times.append(dt[0])
            med = statistics.median(times)
            factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(args.collective, (n - 1) / n)
            if args.collective in ("all_gather", "reduce_scatter"):
                nb = count * 4 * n
            else:
                nb = count * 4
            if rt.rank == 0:
                print(f"{nb:>10} {algo:>20} {med * 1e6:>11.1f} {factor * nb / med / 1e9:>10.3f}", flush=True)
    await runtime.shutdown()


asyncio.run(main())
