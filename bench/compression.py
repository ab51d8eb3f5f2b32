"""Compressed all_reduce: bytes on the wire and time per call, every codec against uncompressed;
and the codec kernels' throughput (Numba against the NumPy reference).

    python -m runtime.launch -n 4 bench/compression.py                     # 1 MiB and 64 MiB
    python -m runtime.launch -n 4 bench/compression.py --sizes 1M --runs 20
    python bench/compression.py --kernels                                  # codec kernels, one process
    python bench/compression.py --kernels --n 1000000

Collectives: float32 arrays of each size (random normal, a different seed per rank), op sum,
every rank over TCP (``RINGWEAVE_SHM=0`` is set for this process unless ``--shm``:
compression is for networks, and the compressed styles always use the TCP algorithms, see
collectives/compressed.py). Each row: a warm-up call (not timed), then ``--runs`` calls, each
between barriers, timed as the slowest rank's; the median is printed. "wire" is the bytes this
rank's actor sent during one call (payload plus frame headers), the largest over ranks; "ratio"
is that against the uncompressed all_reduce of the same size measured in the same run. "error"
is max |result - exact float64 sum| / max |exact| (powersgd: relative Frobenius error; it
approximates a random matrix, its worst case).

Targets: int8 at most 27% of the fp32 bytes, topk(1%) at most 2.5%, at 4 ranks.

Kernels: ``bench/kernels.py``'s codec section (validated against the reference before timing).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import MiB, fmt_bytes, parse_sizes  # noqa: E402

# (label, compression, algorithm)
VARIANTS = [
    ("none", None, None),
    ("fp16", "fp16", None),
    ("fp16 ring", "fp16", "ring"),
    ("bf16", "bf16", None),
    ("int8", "int8", None),
    ("int8 gather", "int8", "gather"),
    ("topk 1%", "topk", None),
    ("topk 1% gather", "topk", "gather"),
    ("powersgd r4", "powersgd", None),
]


def _shape(n: int, compression) -> tuple:
    if compression != "powersgd":
        return (n,)
    rows = 1 << (int(np.log2(n)) // 2)  # a square-ish matrix: 512 x 512 for 1 MiB
    return (rows, n // rows)


async def bench(args) -> list[dict]:
    import runtime
    import collectives as C
    from collectives.compress import get_codec

    rt = await runtime.init()
    g, rows = rt.world, []
    try:
        for nbytes in args.sizes:
            n = nbytes // 4
            for label, compression, algorithm in VARIANTS:
                if args.only and not any(label.startswith(o) for o in args.only):
                    continue
                shape = _shape(n, compression)
                xs = [np.random.default_rng(r).standard_normal(shape).astype(np.float32) for r in range(g.size)]
                exact = np.sum(xs, axis=0, dtype=np.float64)
                mine = xs[g.rank]
                codec = get_codec(compression) if compression else None  # one object: PowerSGD's warm start
                times, wires, x = [], [], None
                runs = args.runs if nbytes <= 4 * MiB else args.big_runs
                for i in range(runs + 1):
                    x = mine.copy()
                    await C.barrier()
                    before = rt.actor.statistics().bytes_sent
                    t0 = time.perf_counter()
                    await C.all_reduce(x, compression=codec, algorithm=algorithm, key="bench")
                    dt = time.perf_counter() - t0
                    wire = rt.actor.statistics().bytes_sent - before
                    slowest = np.array([dt, wire], np.float64)
                    await C.all_reduce(slowest, op="max")
                    if i:  # the first call warms up (compile, caches, buffers)
                        times.append(slowest[0])
                        wires.append(int(slowest[1]))
                if compression == "powersgd":
                    err = float(np.linalg.norm(x - exact) / np.linalg.norm(exact))
                else:
                    err = float(np.abs(x - exact).max() / np.abs(exact).max())
                rows.append({"size": nbytes, "variant": label, "wire_nbytes": int(np.median(wires)),
                             "median_s": statistics.median(times), "min_s": min(times), "error": err,
                             "runs": runs})
                if g.rank == 0:
                    base = next(r for r in rows if r["size"] == nbytes and r["variant"] == "none")
                    r = rows[-1]
                    print(f"{fmt_bytes(nbytes):>8} {label:<16} wire {fmt_bytes(r['wire_nbytes']):>10} "
                          f"ratio {100 * r['wire_nbytes'] / base['wire_nbytes']:6.2f}%   "
                          f"time {1e3 * r['median_s']:9.2f} ms ({base['median_s'] / r['median_s']:5.2f}x none)   "
                          f"error {r['error']:.2e}", flush=True)
    finally:
        await runtime.shutdown(rt)
    if g.rank == 0:
        for nbytes in args.sizes:
            base = next(r for r in rows if r["size"] == nbytes and r["variant"] == "none")["wire_nbytes"]
            for r in rows:
                if r["size"] == nbytes:
                    r["ratio"] = r["wire_nbytes"] / base
            for label, goal in (("int8", 0.27), ("topk 1%", 0.025)):
                r = next((r for r in rows if r["size"] == nbytes and r["variant"] == label), None)
                if r is not None:
                    print(f"goal {label} <= {100 * goal:.1f}% of fp32 bytes at {fmt_bytes(nbytes)}, "
                          f"{g.size} ranks: {100 * r['ratio']:.2f}% -> {'met' if r['ratio'] <= goal else 'NOT met'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": g.size, "shm": args.shm, "load_avg": os.getloadavg(), "rows": rows}, f, indent=1)
            print(f"wrote {os.path.abspath(args.json)}")
    return rows


def kernels(args) -> None:
    from bench import kernels as kb
    from collectives.kernels import cpu
    cpu.warmup()
    src = np.ones(args.n, np.float32)
    dst = np.ones_like(src)
    t_add = kb.best_of(lambda: np.add(dst, src, out=dst), args.repeat)
    peak = 3 * src.nbytes / t_add / 1e9
    print(f"peak (np.add in place, float32, 3 x nbytes): {peak:.2f} GB/s; load average {os.getloadavg()[0]:.1f}")
    kb.bench_codecs(args.n, args.repeat, peak)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1M,64M"), help="bytes, e.g. 1M,64M")
    p.add_argument("--runs", type=int, default=10, help="timed calls per row up to 4 MiB")
    p.add_argument("--big-runs", type=int, default=3, help="timed calls per row above 4 MiB")
    p.add_argument("--only", nargs="*", default=None, help="variants starting with these labels (none always)")
    p.add_argument("--shm", action="store_true", help="leave RINGWEAVE_SHM as it is (default: 0, TCP only)")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    p.add_argument("--kernels", action="store_true", help="codec kernel throughput instead (one process)")
    p.add_argument("--n", type=int, default=16 << 20, help="--kernels: elements (default 16M)")
    p.add_argument("--repeat", type=int, default=3, help="--kernels: best of")
    args = p.parse_args()
    if args.only is not None:
        args.only = ["none"] + args.only
    if args.kernels:
        kernels(args)
        return
    if not args.shm:
        os.environ["RINGWEAVE_SHM"] = "0"
    import runtime
    runtime.run(bench(args))


if __name__ == "__main__":
    main()
