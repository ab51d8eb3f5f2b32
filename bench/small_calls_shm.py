"""Small shared-memory calls beside Open MPI, in the same processes: ringweave's ``await
all_reduce(x)`` (4 B, 1 KiB float32 sum) and ``await barrier()``, the same calls through the
blocking Communicator, and MPI's Allreduce / Barrier (vader).

    python bench/small_calls_shm.py                    # 2 ranks, 3 runs of 2000 calls per row
    python bench/small_calls_shm.py -n 2 --iters 5000 --runs 5 --json out.json

Launch: without OMPI_COMM_WORLD_RANK in the environment the script re-launches itself under mpirun
(bench/collectives.py's ``mpirun_command``: one host, vader, MASTER_ADDR / MASTER_PORT exported);
each rank then makes a ``Communicator`` (its runtime on a loop thread) and uses mpi4py's COMM_WORLD.

Method, per run and row: ``--warmup`` untimed calls, then ``--iters`` timed ones, the libraries
interleaved call by call; each timed call is ``barrier; t0; call; t1`` with that library's own
barrier (OSU style, as bench/collectives.py); a call's time is the slowest rank's t1 - t0, a run's
figure the median over its calls, and the row shows the median over runs (each run listed).
``async`` runs on the Communicator's loop (a coroutine given to ``submit``, MPI's calls made from
it in between: nothing of ringweave is in flight then); ``blocking`` calls the Communicator from the
main thread. Also printed: the same calls back to back (the loop's time / calls, no barriers).
Rank 0 prints the table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (HERE, ROOT)]

ROWS = [("all_reduce 4 B", 1), ("all_reduce 1 KiB", 256), ("barrier", 0)]


def _bench_collectives():
    """bench/collectives.py under another name (it is named like the package it measures)."""
    spec = importlib.util.spec_from_file_location("bench_collectives", os.path.join(HERE, "collectives.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def relaunch(args) -> int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        print("mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)", file=sys.stderr)
        return 2
    cmd = _bench_collectives().mpirun_command(mpirun, args.n, "sm", sys.argv[1:])
    cmd[cmd.index(os.path.join(HERE, "collectives.py"))] = os.path.abspath(__file__)
    cmd = cmd[:-2]  # --launched-by: not an argument of this script
    import subprocess  # lazy: only the launching process starts one
    return subprocess.call(cmd, cwd=os.getcwd())


def _mpi_once(mpi, x, count: int) -> float:
    """MPI's barrier, then one timed call of the row (OSU style)."""
    from mpi4py import MPI
    mpi.Barrier()
    t = time.perf_counter()
    if count:
        mpi.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)
    else:
        mpi.Barrier()
    return time.perf_counter() - t


def _then_mpi(keep: bool, ours_s: float, mpi, x, count: int, ours: list, theirs: list) -> None:
    """After one of ours was timed: MPI's call of the row, the input reset, both kept past the warm-up."""
    theirs_s = _mpi_once(mpi, x, count)
    _reset(x)
    if keep:
        ours.append(ours_s)
        theirs.append(theirs_s)


def _reset(x) -> None:
    if x is not None:
        x[:] = 1  # the sums stay small


async def _async_rows(api, mpi, xs: dict, iters: int, warmup: int) -> dict:
    """On the loop: each row's calls, ringweave's async and MPI's interleaved (OSU style)."""
    out = {}
    for name, count in ROWS:
        x = xs[count]
        ours, theirs = [], []
        for i in range(warmup + iters):
            await api.barrier()
            t0 = time.perf_counter()
            if count:
                await api.all_reduce(x)
            else:
                await api.barrier()
            _then_mpi(i >= warmup, time.perf_counter() - t0, mpi, x, count, ours, theirs)
        t = time.perf_counter()
        for _ in range(iters):  # back to back
            await (api.all_reduce(x) if count else api.barrier())
        _reset(x)
        out[name] = {"async": ours, "mpi": theirs, "async_loop": (time.perf_counter() - t) / iters}
    return out


def _blocking_rows(comm, mpi, xs: dict, iters: int, warmup: int, out: dict) -> None:
    from mpi4py import MPI
    for name, count in ROWS:
        x = xs[count]
        ours, theirs = [], []
        for i in range(warmup + iters):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(x) if count else comm.barrier()
            _then_mpi(i >= warmup, time.perf_counter() - t0, mpi, x, count, ours, theirs)
        t = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x) if count else comm.barrier()
        _reset(x)
        blocking_loop = (time.perf_counter() - t) / iters
        t = time.perf_counter()
        for _ in range(iters):
            mpi.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM) if count else mpi.Barrier()
        _reset(x)
        out[name].update(blocking=ours, mpi_b=theirs, blocking_loop=blocking_loop,
                         mpi_loop=(time.perf_counter() - t) / iters)


def _slowest(mpi, times: list[float]) -> float:
    """The median over calls of the slowest rank's time of each call."""
    from mpi4py import MPI
    a = np.array(times, np.float64)
    mpi.Allreduce(MPI.IN_PLACE, [a, MPI.DOUBLE], MPI.MAX)
    return float(np.median(a))


def run(args) -> None:
    from mpi4py import MPI  # MPI_Init before ringweave's runtime: mpirun's ranks are ours too
    mpi = MPI.COMM_WORLD
    import collectives as C
    from collectives import api
    xs = {1: np.ones(1, np.float32), 256: np.ones(256, np.float32), 0: None}
    runs = []
    with C.Communicator.from_env() as comm:
        for _ in range(args.runs):
            out = comm.submit(_async_rows, api, mpi, xs, args.iters, args.warmup).wait()
            _blocking_rows(comm, mpi, xs, args.iters, args.warmup, out)
            runs.append({name: {"async": _slowest(mpi, r["async"]), "blocking": _slowest(mpi, r["blocking"]),
                                "mpi": _slowest(mpi, r["mpi"] + r["mpi_b"]),
                                "async_loop": r["async_loop"], "blocking_loop": r["blocking_loop"],
                                "mpi_loop": r["mpi_loop"]} for name, r in out.items()})
        rank = comm.rank
    if rank != 0:
        return
    us = lambda s: f"{s * 1e6:7.2f}"  # noqa: E731
    print(f"# {args.n} ranks, {args.runs} runs x {args.iters} calls, {MPI.Get_library_version().splitlines()[0]}")
    print("# OSU style (barrier; t0; call; t1), slowest rank, median; the row: median of runs (each run)")
    print(f"# {'row':18s} {'async us':>9s} {'blocking us':>12s} {'mpi us':>8s} {'mpi/async':>10s} "
          f"{'mpi/blocking':>13s}")
    table = {}
    for name, _ in ROWS:
        med = {k: statistics.median(r[name][k] for r in runs) for k in runs[0][name]}
        table[name] = {"median": med, "runs": [r[name] for r in runs]}
        each = " ".join(f"{r[name]['async'] * 1e6:.2f}/{r[name]['blocking'] * 1e6:.2f}/{r[name]['mpi'] * 1e6:.2f}"
                        for r in runs)
        print(f"  {name:18s} {us(med['async']):>9s} {us(med['blocking']):>12s} {us(med['mpi']):>8s} "
              f"{med['mpi'] / med['async']:10.2f} {med['mpi'] / med['blocking']:13.2f}   runs: {each}")
    print("# back to back, per call: async / blocking / mpi")
    for name, _ in ROWS:
        med = table[name]["median"]
        print(f"  {name:18s} {us(med['async_loop'])} {us(med['blocking_loop'])} {us(med['mpi_loop'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.n, "iters": args.iters, "runs": args.runs, "rows": table}, f, indent=1)
        print(f"# json: {args.json}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=2, help="ranks (one host)")
    p.add_argument("--iters", type=int, default=2000, help="timed calls per row and run")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls before them")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default="", help="rank 0 writes the figures here")
    args = p.parse_args()
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        return relaunch(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
