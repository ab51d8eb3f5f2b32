"""How long the first collective stops the event loop, against the tenth, in fresh processes.

    python bench/first_call.py                 # 3 fresh processes, shared memory on and off
    python bench/first_call.py --runs 5 --shm off
    python bench/first_call.py --child         # one measurement, one JSON line (the test's)

Each child process joins a job of two ranks (tasks of one event loop, ``runtime.init`` over a
shared MemoryStore), while a ticker task sleeps 1 ms at a time and records how late it wakes:
the largest gap during ``init`` and during each of ten ``all_reduce`` calls of 1000 float64
(the loop's other tasks wait that long). Right after ``init`` it also records whether the
collectives' modules are imported and the native kernels compiled (runtime/warmup.py,
collectives/warmup.py). The target: the first call's gap at most the tenth's plus 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

# bench/collectives.py is named like the package: with this folder first on sys.path, "import
# collectives" would find it. The repository root instead.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (HERE, ROOT)]

CALLS = 10


async def _ticker(gaps: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    last = loop.time()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = loop.time()
        gaps.append(now - last - 0.001)
        last = now


async def _measure() -> dict:
    import numpy as np

    import collectives as C
    import runtime
    from runtime.init import set_current
    from runtime.store import MemoryStore

    store, n = MemoryStore(30), 2
    gaps: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(_ticker(gaps, stop))
    start = time.perf_counter()
    rts = await asyncio.gather(*(runtime.init(r, n, store=store, timeout_s=60) for r in range(n)))
    result = {"init_s": time.perf_counter() - start, "init_gap_ms": 1e3 * max(gaps, default=0.0)}
    from collectives import warmup  # what init left loaded (imported by now when it worked)
    from collectives.kernels import cpu
    result["modules_missing"] = [m for m in warmup.MODULES if m not in sys.modules]
    result["native_kernels"] = len(cpu.reduce_native.signatures)

    async def one(rt, x):
        set_current(rt)
        await C.all_reduce(x, group=rt.world)

    result["gaps_ms"] = []
    for _ in range(CALLS):
        await asyncio.sleep(0.01)  # the ticker settles
        gaps.clear()
        await asyncio.gather(*(one(rt, np.ones(1000)) for rt in rts))
        await asyncio.sleep(0.003)  # a tick after the call
        result["gaps_ms"].append(1e3 * max(gaps, default=0.0))
    stop.set()
    await ticker
    await asyncio.gather(*(rt.close() for rt in rts))
    return result


def child() -> dict:
    return asyncio.run(_measure())


def run_child(shm: bool, timeout_s: float = 300) -> dict:
    """One measurement in a fresh process (``--child``), its JSON."""
    env = dict(os.environ, RINGWEAVE_SHM="1" if shm else "0")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"child exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help="one measurement in this process, as JSON")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per setting")
    parser.add_argument("--shm", choices=("on", "off", "both"), default="both")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child()))
        return
    print(f"{'shm':>4} {'run':>4} {'init s':>7} {'init gap ms':>12} {'first ms':>9} {'tenth ms':>9} "
          f"{'median 2-10 ms':>15}  loaded after init")
    for shm in (("on", "off") if args.shm == "both" else (args.shm,)):
        for run in range(args.runs):
            r = run_child(shm == "on")
            g = r["gaps_ms"]
            loaded = "yes" if not r["modules_missing"] and r["native_kernels"] >= 6 else "no"
            print(f"{shm:>4} {run:>4} {r['init_s']:7.2f} {r['init_gap_ms']:12.1f} {g[0]:9.1f} {g[-1]:9.1f} "
                  f"{statistics.median(g[1:]):15.1f}  {loaded}")


if __name__ == "__main__":
    main()
