"""Offload benchmark: the resident memory a training step needs with and without the optimizer state
(and the float32 master weights) in memory-mapped files, against the formula, and the step time it costs.

    python bench/offload.py                          # the GPT below, fsdp on 1 rank, 3 repeats
    python bench/offload.py --n-layer 8 --steps 3 --repeat 1 --dir /scratch

Configurations, each its own process (one rank, world size 1), alternating run by run:

    none       float32 parameters, everything in memory
    optimizer  float32 parameters, AdamW's exp_avg and exp_avg_sq in the file
    none-bf16  bfloat16 compute copy beside the float32 master, everything in memory
    params     bfloat16 compute copy in memory; the float32 master and AdamW's state in the file

Measured per run: the peak resident set size over the timed steps (VmHWM after a reset through
/proc/self/clear_refs, once setup and the warm-up are done and malloc_trim has handed back what
setup freed: what a step needs, not what building the model once did), and the mean step time.
The formula: the resident set falls by the offloaded bytes O (8 bytes per parameter for AdamW's
two float32 states, 4 more for the master) less the window the update keeps in memory at once:
the unit stepping, the unit read ahead and the unit being written back, at most 3 units' share
of O (plus unit 0's, read ahead during the backward).
So the expected drop lies in [O - 4 U, O] with U the largest unit's offloaded bytes.

Output: the table on stdout and JSON (offload.json under --out-dir). Peers in the same run: the
same model and step without offload (none, none-bf16); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]  # bench/ would shadow trainer
sys.path.insert(0, _ROOT)

CONFIGS = {"none": (None, "float32"), "optimizer": ("optimizer", "float32"), "none-bf16": (None, "bfloat16"),
           "params": ("params", "bfloat16")}
BASELINE = {"optimizer": "none", "params": "none-bf16"}


def _rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: the peak resident set size restarts from the current one


async def _worker(args) -> dict:
    import numpy as np

    import runtime
    from trainer.nn import GPT, GPTConfig
    from trainer.parallel.offload import make_offload_strategy, return_freed_memory
    from trainer.sharding import TrainConfig, make_strategy
    from trainer.text import load_text_split

    offload, param_dtype = CONFIGS[args.config]
    rt = await runtime.init()
    try:
        model = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                              block_size=args.block_size))
        config = TrainConfig(lr=1e-3, seed=0, param_dtype=param_dtype, offload=offload, offload_dir=args.dir)
        make = make_offload_strategy if offload else make_strategy
        s = make(args.strategy, model, config, rt.world)
        await s.setup()
        x, y = load_text_split(args.block_size).train.get(np.arange(args.batch), epoch=0)
        batch = [(x, y, 0, args.batch)]
        for _ in range(args.warmup):
            await s.train_step(batch)
        return_freed_memory()  # what setup built once and freed (the full initialisation), in every configuration
        _reset_peak()
        t0 = time.perf_counter()
        losses = [(await s.train_step(batch)).loss for _ in range(args.steps)]
        step_s = (time.perf_counter() - t0) / args.steps
        peak = _rss_peak_bytes()
        mem = s.memory_bytes()
        units = [sum(b.nbytes for b in st.buffers.values()) for st in s.states]
        if offload == "params":
            units = [u + m.nbytes for u, m in zip(units, s.master)]
        s.close()
        return dict(config=args.config, numel=model.numel, step_s=step_s, rss_peak=peak, losses=losses,
                    offloaded=mem.get("offloaded", 0), largest_unit=max(units), optim=mem["optim"],
                    params=mem["params"])
    finally:
        await runtime.shutdown(rt)


def run_one(args, name: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="rw-offload-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--result", out,
               "--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
               "--block-size", str(args.block_size), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--strategy", args.strategy, "--dir", args.dir or tmp]
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        if proc.returncode != 0:
            return dict(config=name, error=proc.stderr[-2000:])
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="windows per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the offload files go (default: a temporary directory)")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--worker", default=None, choices=tuple(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import asyncio

        from threadpoolctl import threadpool_limits

        args.config = args.worker
        with threadpool_limits(limits=1, user_api="blas"):
            result = asyncio.run(_worker(args))
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0
    runs = {name: [] for name in CONFIGS}
    for _ in range(args.repeat):
        for name in CONFIGS:  # alternating: a busy machine slows each alike
            runs[name].append(run_one(args, name))
    results = {}
    for name, tries in runs.items():
        ok = [r for r in tries if "error" not in r]
        if not ok:
            print(f"{name}: FAILED\n{tries[0]['error']}", file=sys.stderr)
            return 1
        results[name] = dict(ok[0], step_s=min(r["step_s"] for r in ok),
                             rss_peak=statistics.median(r["rss_peak"] for r in ok),
                             step_s_runs=[r["step_s"] for r in ok], rss_runs=[r["rss_peak"] for r in ok])
        assert all(r["losses"] == ok[0]["losses"] for r in ok)
    for name, base in BASELINE.items():  # the same bits with and without offload
        assert results[name]["losses"] == results[base]["losses"], (name, base)
    MiB = 2**20
    print(f"# GPT {args.n_layer} layers x {args.n_embd} wide, {results['none']['numel'] / 1e6:.1f}M parameters, "
          f"{args.strategy} on 1 rank, batch {args.batch} x {args.block_size} tokens, {args.steps} timed steps, "
          f"median RSS peak / best step time of {args.repeat} runs, load {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores")
    print(f"{'config':>10} {'RSS peak MiB':>13} {'offloaded':>10} {'drop MiB':>9} {'formula [O-4U, O]':>19} "
          f"{'step s':>7} {'x time':>7}")
    for name, r in results.items():
        base = results.get(BASELINE.get(name, ""), None)
        if base is None:
            print(f"{name:>10} {r['rss_peak'] / MiB:13.1f} {'-':>10} {'-':>9} {'-':>19} {r['step_s']:7.3f} {'-':>7}")
            continue
        moved, unit = r["offloaded"], r["largest_unit"]  # O and U of the formula
        drop = base["rss_peak"] - r["rss_peak"]
        print(f"{name:>10} {r['rss_peak'] / MiB:13.1f} {moved / MiB:10.1f} {drop / MiB:9.1f} "
              f"{f'[{(moved - 4 * unit) / MiB:.1f}, {moved / MiB:.1f}]':>19} {r['step_s']:7.3f} "
              f"{r['step_s'] / base['step_s']:7.2f}")
    out = os.path.abspath(os.path.join(args.out_dir or os.getcwd(), "offload.json"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
