"""``python -m collectives.tune -n N``: measure this machine, then write the rules the runtime loads.

    python -m collectives.tune -n 4            # this host, 4 ranks: the bench grid, 4 B .. 64 MiB
    python -m collectives.tune -n 2 --quick    # a few small sizes, seconds (a smoke test)
    python -m collectives.tune -n 4 --all      # time every algorithm, not only the model's close ones

It launches N ranks on this host (``python -m runtime.launch``), which:

1. **probe** the terms of the cost model (collectives/costmodel.py), every pair of ranks at once so
   that contention is in the figures: a ping-pong at a few sizes (``alpha``, ``beta`` of loopback
   TCP), a burst of small messages (``o``), the reduction kernel (``gamma``), a copy (``copy``), the
   shared-memory barrier (``alpha`` of shared memory, whose ``beta`` is the copy's);
2. **time** the algorithms at every size of the grid: those the model puts within CLOSE of its best,
   the built-in table's choice, and all of them with ``--all``; the slowest rank's time, the median
   of the iterations; the clock, not the model, picks;
3. rank 0 **writes** the rules file (collectives/tunefile.py: where it lives, its key, how it is
   checked, RINGWEAVE_TUNE=0 to turn it off) and prints where.

A size between two measured sizes takes the winner of the nearer one (geometric midpoint); sizes
above the grid the winner of the largest (``--quick``: the built-in table). Where the table's choice
is within TIE of the fastest, the table's choice stays. Rules are written for shared memory on
(every algorithm) and off (TCP ones only) from the same measurements.

Not here: the formulas (costmodel.py), loading the file (tunefile.py), choosing (registry.py).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import time

import numpy as np

import runtime
from collectives import api, costmodel, p2p, registry, tunefile
from collectives.comm import reduce_step
from runtime import args as types
from runtime.sharedmem.segments import shm_usable

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
       "barrier")
BLOCKED = {"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"}  # the size is n blocks
GRID = tuple(4 << (2 * k) for k in range(13))  # 4 B .. 64 MiB in x4 steps: bench/collectives.py's default grid
QUICK_GRID = (4, 64 << 10)
CLOSE = 3.0  # time the algorithms the model puts within this factor of its fastest
TIE = 0.05  # the table's choice stays unless another is this much faster
ITEMSIZE = 4  # float32, as the bench grid
SHM_ONLY = tunefile.SHM_ONLY


def registry_nbytes(collective: str, size: int, p: int) -> int:
    """The bytes registry.choose sees for the bench's ``size`` (nccl-tests': the whole array, the
    gathered output, the scattered input), float32, as bench/collectives.py builds its cases."""
    if collective == "barrier":
        return 0
    if collective in BLOCKED:
        block = max(1, size // ITEMSIZE // p)
        return block * ITEMSIZE * (p if collective in ("reduce_scatter", "all_to_all") else 1)
    return max(1, size // ITEMSIZE) * ITEMSIZE


def caller(collective: str, nbytes: int, p: int, rank: int):
    """A function that starts one call of ``collective`` on ``nbytes`` with a given algorithm."""
    count = nbytes // ITEMSIZE
    x = np.zeros(count, np.float32)  # zeros: sums stay finite however often they run
    wide = np.zeros(count * p, np.float32)
    small = np.zeros(count // p if collective in ("reduce_scatter",) else count, np.float32)
    calls = {
        "all_reduce": lambda a: api.all_reduce(x, algorithm=a),
        "all_gather": lambda a: api.all_gather(wide, x, algorithm=a),
        "reduce_scatter": lambda a: api.reduce_scatter(small, x, algorithm=a),
        "broadcast": lambda a: api.broadcast(x, src=0, algorithm=a),
        "reduce": lambda a: api.reduce(x, dst=0, algorithm=a),
        "gather": lambda a: api.gather(wide if rank == 0 else None, x, dst=0, algorithm=a),
        "scatter": lambda a: api.scatter(x, wide if rank == 0 else None, src=0, algorithm=a),
        "all_to_all": lambda a: api.all_to_all(small, x, algorithm=a),
        "barrier": lambda a: api.barrier(algorithm=a),
    }
    return calls[collective]


async def agreed_max(values) -> np.ndarray:
    """Every rank's ``values``, the largest of each over the ranks (the same array on every rank)."""
    a = np.array(values, np.float64).ravel()
    await api.all_reduce(a, op="max")
    return a


async def _clock(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        await fn()
    return (time.perf_counter() - t0) / reps


async def probe(rt, quick: bool) -> costmodel.Machine:
    """The model's terms on this machine, the same on every rank (the largest any rank saw)."""
    p, r = rt.world_size, rt.rank
    partner = r ^ 1 if (r ^ 1) < p else None
    sizes = (8, 1 << 20) if quick else (8, 64 << 10, 1 << 20, 4 << 20)
    burst = 16
    measured = []  # half round trips per size, then the burst, gamma, copy, shm alpha

    for nbytes in sizes:
        buf, reps = np.zeros(nbytes, np.uint8), (10 if quick else 30) if nbytes <= 64 << 10 else (3 if quick else 8)

        async def pingpong(buf=buf):
            if partner is None:
                return
            if r % 2 == 0:
                await p2p.send(buf, partner, tag=7)
                await p2p.recv(buf, partner, tag=7)
            else:
                await p2p.recv(buf, partner, tag=7)
                await p2p.send(buf, partner, tag=7)
        await _clock(pingpong, 2)
        await api.barrier()
        measured.append(await _clock(pingpong, reps) / 2 if partner is not None else 0.0)
    tiny = np.zeros(8, np.uint8)

    async def bursts():
        if partner is None:
            return
        for _ in range(burst):
            await (p2p.send(tiny, partner, tag=8) if r % 2 == 0 else p2p.recv(tiny, partner, tag=8))
        await (p2p.recv(tiny, partner, tag=9) if r % 2 == 0 else p2p.send(tiny, partner, tag=9))
    await api.barrier()
    measured.append(await _clock(bursts, 3 if quick else 10))
    a, b = np.zeros(1 << 20, np.float32), np.zeros(1 << 20, np.float32)
    await reduce_step(a, b, "sum")  # compiles the kernel first
    measured.append(await _clock(lambda: reduce_step(a, b, "sum"), 5 if quick else 20) / a.nbytes)

    async def copy():
        np.copyto(a, b)
    measured.append(await _clock(copy, 5 if quick else 20) / a.nbytes)
    shm = rt.world.shm_enabled and shm_usable()
    if shm:
        await api.barrier(algorithm="shm")
    measured.append(await _clock(lambda: api.barrier(algorithm="shm"), 20 if quick else 100) if shm else 0.0)

    m = await agreed_max(measured)
    halves, (t_burst, gamma, copy_s, shm_alpha) = m[:len(sizes)], m[len(sizes):]
    alpha = float(halves[0])
    xs = np.array(sizes[1:], np.float64)
    beta = float(max(1e-13, np.dot(xs, halves[1:] - alpha) / np.dot(xs, xs)))
    o = float(min(alpha, max(0.0, (t_burst - 2 * alpha) / (burst - 1))))
    loopback = costmodel.Link(alpha, o, beta)
    shared = costmodel.Link(float(shm_alpha) or alpha, float(shm_alpha) or alpha, float(copy_s))
    return costmodel.Machine(loopback, shared, float(gamma), float(copy_s))


def candidates(machine: costmodel.Machine, collective: str, p: int, nbytes: int, shm: bool, every: bool) -> list[str]:
    """The algorithms to time: the model's close ones (among all, and among the TCP ones), the
    table's choices (shared memory on and off), or every one that can run here."""
    runnable = [a for a in registry.ALGORITHMS[collective] if registry.NEEDS.get(a, lambda s, lay: True)(shm, "one")]
    if every:
        return sorted(runnable)
    chosen = {registry._chosen(collective, nbytes, p, state, "one", 1)[0] for state in {shm, False}}
    for allowed in (runnable, [a for a in runnable if a not in SHM_ONLY]):
        ranked = costmodel.ranking(machine, collective, p, nbytes, 1, allowed)
        chosen |= {a for t, a in ranked if t <= CLOSE * ranked[0][0] or a == ranked[0][1]}
    return sorted(chosen)


async def time_algorithms(rt, collective: str, nbytes: int, names: list[str], quick: bool) -> dict[str, float]:
    """The slowest rank's median seconds of each algorithm, interleaved iteration by iteration."""
    start = caller(collective, nbytes, rt.world_size, rt.rank)
    first = []
    for name in names:  # warm-up, and an estimate of how many iterations fit the budget
        await api.barrier()
        t0 = time.perf_counter()
        await start(name)
        first.append(time.perf_counter() - t0)
    slowest = float((await agreed_max(first)).max())
    budget, lo, hi = (0.02, 2, 3) if quick else (0.4, 3, 15)
    iters = int(min(hi, max(lo, budget / max(slowest * len(names), 1e-6))))
    times = np.zeros((iters, len(names)))
    for i in range(iters):
        for j, name in enumerate(names):
            await api.barrier()
            t0 = time.perf_counter()
            await start(name)
            times[i, j] = time.perf_counter() - t0
    worst = (await agreed_max(times)).reshape(times.shape)
    return {name: float(np.median(worst[:, j])) for j, name in enumerate(names)}


def pick(times: dict[str, float], allowed, table: str | None) -> str | None:
    """The fastest of ``allowed`` measured; the table's choice where it is within TIE of it."""
    mine = {a: t for a, t in times.items() if a in allowed}
    if not mine:
        return table
    best = min(mine, key=lambda a: (mine[a], a))
    return table if table in mine and mine[table] <= mine[best] * (1 + TIE) else best


def thresholds(winners: list[tuple[int, str | None]], extrapolate: bool) -> list[list]:
    """``[upto, algorithm]`` entries from (size, winner) in rising size: the boundary between two
    sizes with different winners at their geometric midpoint; after the last size, its winner
    (``extrapolate``) or None (the table)."""
    out = []
    for (size, name), (nxt, _) in zip(winners, winners[1:] + [(None, None)]):
        upto = None if nxt is None else int(math.sqrt(max(size, 1) * nxt))
        if out and out[-1][1] == name:
            out[-1][0] = upto
        else:
            out.append([upto, name])
    if not extrapolate and out[-1][0] is None and out[-1][1] is not None:
        out[-1][0] = winners[-1][0]
        out.append([None, None])
    return out


async def rank_main(args) -> None:
    rt = await runtime.init()
    p, r = rt.world_size, rt.rank
    say = print if r == 0 else (lambda *a, **k: None)
    try:
        if rt.world.topology.hosts != 1:
            raise SystemExit("collectives.tune measures one host; its ranks are on several")
        machine = await probe(rt, args.quick)
        lb, sh = machine.loopback, machine.shm
        say(f"# model: loopback alpha {lb.alpha * 1e6:.1f} us, o {lb.o * 1e6:.1f} us, {1e-9 / lb.beta:.2f} GB/s; "
            f"shared memory alpha {sh.alpha * 1e6:.1f} us; reduce {1e-9 / machine.gamma:.2f} GB/s, copy "
            f"{1e-9 / machine.copy:.2f} GB/s", flush=True)
        shm = rt.world.shm_enabled
        grid = QUICK_GRID if args.quick else GRID
        rules: dict = {"shm": {}, "tcp": {}} if shm else {"tcp": {}}
        measured: dict = {}
        for collective in args.ops:
            sizes = sorted({registry_nbytes(collective, s, p) for s in (grid if collective != "barrier" else (0,))})
            winners: dict = {state: [] for state in rules}
            for nbytes in sizes:
                names = candidates(machine, collective, p, nbytes, shm, args.all)
                times = await time_algorithms(rt, collective, nbytes, names, args.quick) if len(names) > 1 else {}
                measured.setdefault(collective, {})[str(nbytes)] = times
                for state in rules:
                    on = state == "shm"
                    allowed = [a for a in names if on or a not in SHM_ONLY]
                    table = registry._chosen(collective, nbytes, p, on, "one", 1)[0]
                    winners[state].append((nbytes, pick(times, allowed, table)))
                if times:
                    say(f"{collective:>14} {nbytes:>10} B  " + "  ".join(
                        f"{a}{'*' if a == winners[next(iter(rules))][-1][1] else ''} {t * 1e6:.0f}us"
                        for a, t in sorted(times.items(), key=lambda kv: kv[1])), flush=True)
            for state in rules:
                rules[state][collective] = thresholds(winners[state], extrapolate=not args.quick)
        if r == 0:
            key = tunefile.machine_key(p, 1, p)
            doc = {"format": tunefile.FORMAT, "key": key, "model": machine.to_json(), "rules": rules,
                   "times": measured, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "command": f"python -m collectives.tune -n {p}" + (" --quick" if args.quick else "")
                   + (" --all" if args.all else "")}
            path = tunefile.save(doc, registry.ALGORITHMS, args.out)
            print(f"# rules written to {path} (RINGWEAVE_TUNE=0 ignores them)", flush=True)
    finally:
        await runtime.shutdown()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m collectives.tune", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--nproc", type=types.positive_int, default=2, help="ranks on this host, as the jobs to tune run (default 2)")
    p.add_argument("--quick", action="store_true", help="a few small sizes and iterations (seconds)")
    p.add_argument("--all", action="store_true", help="time every algorithm, not only the model's close ones")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list from {OPS} (default all)")
    p.add_argument("--out", default=None, help="the file to write (default: the cache's, keyed to this machine)")
    p.add_argument("--timeout-s", type=types.positive_seconds, default=900.0, help="stop the ranks after this long (default 900)")
    p.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad or args.nproc < 2:
        p.error(f"--ops: unknown {bad}; choose from {OPS}" if bad else "-n must be 2 or more")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.launched:
        asyncio.run(rank_main(args))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([root] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    cmd = [sys.executable, "-m", "runtime.launch", "-n", str(args.nproc), "--max-time-s", str(args.timeout_s),
           "-m", "collectives.tune", *argv, "--launched"]
    return subprocess.call(cmd, env=dict(os.environ, PYTHONPATH=path))


if __name__ == "__main__":
    sys.exit(main())
