"""What catching the scheduler's signals costs a training step (trainer/preempt.py).

    .venv/bin/python bench/preempt.py                 # 4 ranks, 5 pairs of main-job runs
    .venv/bin/python bench/preempt.py -n 2 --pairs 3 --calls 5000

Two measurements, each against its peer in the same run:

1. the hook in a loop of stand-in steps (``--step-ms`` of 256x256 matmuls on a thread, as
   the strategies run the model, then a 256 KiB all_reduce, as DDP's gradients; 0: the hook
   back to back), ``--calls`` iterations on every
   rank of one job, inside an entered ``Preemption`` (the agreement's all_reduce overlaps
   the next step) and outside one (no collective): microseconds per iteration;
2. the main job (``python -m trainer``, digits, defaults, with ``--checkpoint-dir``) run in
   pairs, once armed (the default) and once with ``RINGWEAVE_PREEMPT_SIGNALS=none``, in
   alternating order: training milliseconds per step (history's train_time_s / steps)
   and the armed / unarmed ratio per pair, then the median ratio.

Rank 0 prints a markdown table; record it in bench/results/preempt.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, bench/ is sys.path[0], where bench/trainer.py would shadow the `trainer` package
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (HERE, ROOT)]


async def _hook_rank(calls: int, step_ms: float) -> None:
    import numpy as np

    import runtime
    from trainer import preempt

    import collectives

    rt = await runtime.init()
    world = rt.world
    a = np.random.default_rng(rt.rank).standard_normal((256, 256))
    grads = np.ones(65536, np.float32)  # 256 KiB: the step's gradient all_reduce, as DDP's

    def step(n: int) -> None:  # a stand-in for a step's compute, on a thread as the strategies run it
        for _ in range(n):
            a @ a

    t0 = time.perf_counter()
    step(50)
    per = (time.perf_counter() - t0) / 50
    n = max(1, round(step_ms / 1e3 / per)) if step_ms > 0 else 0
    out = {}
    for armed in (False, True, False, True):  # twice each, alternating: the second of each is kept
        async with preempt.Preemption(enabled=armed):
            for _ in range(20):
                await preempt.at_step_boundary(world, None)
            await collectives.barrier(group=world)
            t0 = time.perf_counter()
            for _ in range(calls):
                if n:
                    await asyncio.to_thread(step, n)
                    await collectives.all_reduce(grads, group=world)
                await preempt.at_step_boundary(world, None)
            out[armed] = (time.perf_counter() - t0) / calls * 1e6
    if rt.rank == 0:
        print(json.dumps({"unarmed_us": out[False], "armed_us": out[True], "matmuls": n}), flush=True)
    await runtime.shutdown()


def _launch(n: int, args: list[str], env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", str(n), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def _main_job_ms_per_step(n: int, armed: bool) -> float:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, RINGWEAVE_PREEMPT_SIGNALS="" if armed else "none")
        _launch(n, ["-m", "trainer", "--quiet", "--checkpoint-dir", os.path.join(d, "ckpt"),
                    "--json", os.path.join(d, "run.json")], env)
        with open(os.path.join(d, "run.json")) as f:
            history = json.load(f)["history"]
    return history["train_time_s"] / history["steps"] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--pairs", type=int, default=5, help="armed/unarmed pairs of main-job runs (default 5)")
    p.add_argument("--calls", type=int, default=500, help="iterations timed per mode (default 500)")
    p.add_argument("--step-ms", type=float, default=5.0, help="stand-in step's compute (default 5 ms; 0: none)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # run as one rank of the hook job
    args = p.parse_args()
    if args.rank:
        import runtime

        runtime.run(_hook_rank(args.calls, args.step_ms))
        return
    hook = json.loads(_launch(args.n, [os.path.abspath(__file__), "--rank", "--calls", str(args.calls),
                                       "--step-ms", str(args.step_ms)]).strip().splitlines()[-1].split("] ", 1)[-1])
    rows = []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        ms = {armed: _main_job_ms_per_step(args.n, armed) for armed in order}
        rows.append((ms[True], ms[False]))
    print(f"hook after a {args.step_ms:g} ms stand-in step ({hook['matmuls']} matmuls), {args.n} ranks, "
          f"{args.calls} iterations: unarmed {hook['unarmed_us']:.1f} us/iteration, armed {hook['armed_us']:.1f} "
          f"us/iteration, armed / unarmed {hook['armed_us'] / hook['unarmed_us']:.3f}")
    if not rows:
        return
    print()
    print("| pair | armed ms/step | unarmed ms/step | armed / unarmed |")
    print("| --- | --- | --- | --- |")
    for i, (a, u) in enumerate(rows):
        print(f"| {i} | {a:.3f} | {u:.3f} | {a / u:.3f} |")
    print(f"| median | {statistics.median(a for a, _ in rows):.3f} | {statistics.median(u for _, u in rows):.3f} | "
          f"{statistics.median(a / u for a, u in rows):.3f} |")


if __name__ == "__main__":
    main()
