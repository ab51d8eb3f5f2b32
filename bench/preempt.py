"""What catching the scheduler's signals costs a training step (trainer/preempt.py).

    .venv/bin/python bench/preempt.py                 # 4 ranks, stand-in steps of 5 ms
    .venv/bin/python bench/preempt.py -n 2 --step-ms 20 --pairs 3

Two measurements, each against its peer in the same run:

0. the hook alone, back to back in one job: microseconds per call when every call checks
   (an all_reduce of two int64) and between checks (a countdown);
1. stand-in steps in one job (``--step-ms`` of 256x256 matmuls on a thread, as the
   strategies run the model, then a 256 KiB and a 16 B all_reduce, as DDP's gradients and
   the loop's loss) followed by the hook: outside a scope ("off"), inside one ("armed":
   an agreement about once a second) and inside one that agrees at every step ("every
   step", check_s=0: what an all_reduce per step would cost), and "off" again
   (its ratio to "off" is the noise floor of the machine at the time); ``--rounds``
   rounds of ``--iters`` steps per mode, the modes interleaved; median microseconds per
   step and the median ratio to "off" of the same round;
2. with ``--pairs N``, the main job (``python -m trainer``, digits, defaults, with
   ``--checkpoint-dir``) in N pairs, armed (the default) and with
   ``RINGWEAVE_PREEMPT_SIGNALS=none``, alternating: training milliseconds per step
   (history's train_time_s / steps); whole runs apart, so only large effects show.

Rank 0 prints a markdown table; record it in bench/results/preempt.md (command, machine, date).
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


# no scope (twice: the second shows the noise floor); a scope (a check about once a second); a check at every step
MODES = ("off", "off again", "armed", "every step")


async def _hook_rank(iters: int, rounds: int, step_ms: float) -> None:
    import numpy as np

    import collectives
    import runtime
    from trainer import preempt

    rt = await runtime.init()
    world = rt.world
    a = np.random.default_rng(rt.rank).standard_normal((256, 256))
    grads = np.ones(65536, np.float32)  # 256 KiB: the step's gradient all_reduce, as DDP's
    loss = np.ones(2, np.float64)  # and a small one, as the loop's agreed loss

    def compute(n: int) -> None:  # a stand-in for a step's compute, on a thread as the strategies run it
        for _ in range(n):
            a @ a

    t0 = time.perf_counter()
    compute(50)
    n = max(1, round(step_ms / 1e3 / ((time.perf_counter() - t0) / 50)))
    per_iter: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:  # interleaved: the machine's drift hits all alike
            with preempt.Preemption(enabled=not mode.startswith("off"), check_s=0.0 if mode == "every step" else 1.0):
                await collectives.barrier(group=world)
                t0 = time.perf_counter()
                for _ in range(iters):
                    await asyncio.to_thread(compute, n)
                    await collectives.all_reduce(grads, group=world)
                    await collectives.all_reduce(loss, group=world)
                    await preempt.at_step_boundary(world, None)
                per_iter[mode].append((time.perf_counter() - t0) / iters * 1e6)
    back_to_back = {}  # the hook alone, called back to back: a check each time, and between checks
    for name, every in (("check", 0.0), ("between checks", 1e9)):
        with preempt.Preemption(check_s=every):
            await preempt.at_step_boundary(world, None)  # the first call checks whatever the interval
            await collectives.barrier(group=world)
            t0 = time.perf_counter()
            for _ in range(iters * 10):
                await preempt.at_step_boundary(world, None)
            back_to_back[name] = (time.perf_counter() - t0) / (iters * 10) * 1e6
    if rt.rank == 0:
        print(json.dumps({"matmuls": n, "back_to_back_us": back_to_back,
                          "us": {m: statistics.median(v) for m, v in per_iter.items()},
                          "ratio": {m: statistics.median(x / y for x, y in zip(v, per_iter["off"]))
                                    for m, v in per_iter.items()}}), flush=True)
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
    p.add_argument("--pairs", type=int, default=0, help="armed/unarmed pairs of main-job runs (default 0)")
    p.add_argument("--iters", type=int, default=100, help="stand-in steps per mode and round (default 100)")
    p.add_argument("--rounds", type=int, default=10, help="rounds of every mode (default 10)")
    p.add_argument("--step-ms", type=float, default=5.0, help="stand-in step's compute (default 5 ms)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # run as one rank of the hook job
    args = p.parse_args()
    if args.rank:
        import runtime

        runtime.run(_hook_rank(args.iters, args.rounds, args.step_ms))
        return
    hook = json.loads(_launch(args.n, [os.path.abspath(__file__), "--rank", "--iters", str(args.iters), "--rounds",
                                       str(args.rounds), "--step-ms", str(args.step_ms)])
                      .strip().splitlines()[-1].split("] ", 1)[-1])
    b2b = hook["back_to_back_us"]
    print(f"the hook back to back, {args.n} ranks, {args.iters * 10} calls: {b2b['check']:.1f} us per check "
          f"(one all_reduce of 2 int64), {b2b['between checks']:.2f} us between checks")
    print()
    print(f"stand-in steps: {args.step_ms:g} ms of compute ({hook['matmuls']} matmuls) + 256 KiB and 16 B "
          f"all_reduce, {args.n} ranks, {args.rounds} rounds x {args.iters} steps per mode")
    print()
    print("| mode | us/step (median) | / off (median of rounds) |")
    print("| --- | --- | --- |")
    for mode in MODES:
        print(f"| {mode} | {hook['us'][mode]:.0f} | {hook['ratio'][mode]:.3f} |")
    rows = []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        ms = {armed: _main_job_ms_per_step(args.n, armed) for armed in order}
        rows.append((ms[True], ms[False]))
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
