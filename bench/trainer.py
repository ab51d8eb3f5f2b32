"""Trainer benchmark: samples/s and where a step's time goes, per strategy and world size.

    python bench/trainer.py                                  # ddp zero1 zero2 zero3 fsdp at 1, 2, 4 ranks
    python bench/trainer.py --compare torch                  # + torch DDP on Gloo, same model, same run
    python bench/trainer.py --strategies ddp,fsdp --ranks 2,4 --steps 10 --quick
    python bench/trainer.py --strategies zero2 --ranks 4 --compression none,int8 --repeat 3   # rows zero2, zero2+int8

Every configuration is its own job, started as
``python -m runtime.launch -n N bench/trainer.py --worker ...`` (torch DDP the
same way, with its own file:// rendezvous). Each rank holds one BLAS thread
(OPENBLAS_NUM_THREADS=1 and threadpoolctl), so 1 rank uses one core and 2
ranks two: the 2-rank speed-up is then a fair measure of scaling.

Model: a synthetic MLP 1024 -> 1536 x 4 (LayerNorm + GELU) -> 10, about 8.7M
parameters in 5 units, trained with AdamW in float32 on Gaussian clusters;
256 rows per rank by default (global batch 256 x N, as torch DDP counts batches; weak
scaling), or one global batch at every world size with ``--batch B`` (strong scaling). Warm-up steps (not timed), then a
barrier, `--steps` timed steps, a barrier.

Per configuration (rank 0 prints one table row, all ranks' figures go to JSON):

- samples/s = steps x global batch / wall time between the barriers;
- step time split from StepResult.timings, averaged over ranks and steps:
  compute_s (the model and the optimizer), comm_s (time any collective was in
  flight), exposed_comm_s (time the step waited on communication: the part not
  hidden behind compute). overlap = 1 - exposed / comm;
- per-rank peak memory: getrusage maxrss and strategy.memory_bytes()
  (params, grads, optim, gathered_peak after the warm-up);
- bytes sent per step per rank (StepResult.comm_bytes);
- CPU time per step per rank (os.times, all threads): unlike wall time it
  hardly changes when other processes compete for the cores, so it tells a
  slow run on a busy machine from slow code.

Napkin math for 1 rank: 6 x 8.7M x 256 = 13 GFLOP per step; at ~40 GFLOP/s
on one AVX2 core, ~0.33 s per step, ~780 samples/s. DDP at N ranks sends
2 (N-1)/N x 35 MB per step per rank.

Targets, printed as ratios, never asserted: at 2 ranks >= 1.7x
the samples/s of 1 rank; exposed < 30% of comm for ddp and fsdp; at 4 ranks
>= 0.9x torch DDP's samples/s.

Gradient compression: ``--compression none,int8`` runs every configuration with each
TrainConfig.compression (a row per codec, labelled strategy+codec), alternating the
codecs run by run so that a busy machine slows each alike. The compressed collectives
always use the TCP algorithms (collectives/compressed.py), the exact ones may use shared
memory on one host: set RINGWEAVE_SHM=0 to compare both over TCP, as a network would.

Noise: other processes on a 2-core machine only ever slow a run down, so
`--repeat N` runs each configuration N times and reports the fastest (all
N figures go to JSON); every row shows the 1-minute load average before it.

Output: the table on stdout, JSON in trainer.json under --out-dir (default: the current directory), or --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# run as a script, bench/ is sys.path[0] and this file would shadow the `trainer` package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

from trainer.sharding import STRATEGIES  # noqa: E402

MODEL = dict(in_dim=1024, width=1536, depth=4, classes=10)  # ~8.7M parameters


# ---- one rank of one configuration -------------------------------------------


def _cpu_s() -> float:
    """CPU seconds this process has used, all threads (user + system)."""
    t = os.times()
    return t.user + t.system


def _batches(args, rank: int, size: int):
    """A pool of global batches (cycled); this rank's rows of each, as train_step micro-batches."""
    from trainer.data import make_synthetic, split_bounds

    pool = 4
    x, y = make_synthetic(pool * args.batch, args.in_dim, args.classes, seed=0)
    bounds = split_bounds(args.batch, size)
    out = []
    for k in range(pool):
        lo, hi = k * args.batch + bounds[rank], k * args.batch + bounds[rank + 1]
        out.append([(x[lo:hi], y[lo:hi], bounds[rank], args.batch)])
    return out


async def _worker_ringweave(args) -> dict:
    import collectives
    import runtime
    from trainer.nn import mlp
    from trainer.sharding import make_strategy
    from trainer.sharding.base import TrainConfig

    rt = await runtime.init()
    world = rt.world
    try:
        model = mlp(args.in_dim, (args.width,) * args.depth, args.classes, pad_to=world.size)
        config = TrainConfig(strategy=args.strategy, optimizer="adamw", lr=1e-3, warmup_steps=0,
                             total_steps=1, seed=0, compression=args.compression)
        strategy = make_strategy(args.strategy, model, config, world)
        await strategy.setup()
        batches = _batches(args, world.rank, world.size)
        for i in range(args.warmup):
            await strategy.train_step(batches[i % len(batches)])
        if hasattr(strategy, "reset_peak"):
            strategy.reset_peak()
        sums = {"compute_s": 0.0, "comm_s": 0.0, "exposed_comm_s": 0.0, "step_s": 0.0}
        comm_bytes = 0
        losses = []
        await collectives.barrier(group=world)
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        for i in range(args.steps):
            t = time.perf_counter()
            result = await strategy.train_step(batches[i % len(batches)])
            step_s = time.perf_counter() - t
            for key in ("compute_s", "comm_s", "exposed_comm_s"):
                sums[key] += float(result.timings.get(key, 0.0))
            sums["step_s"] += step_s
            comm_bytes += int(result.comm_bytes)
            losses.append(result.loss)
        await collectives.barrier(group=world)
        wall = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        mem = strategy.memory_bytes()
        import resource

        row = np.array([sums["compute_s"], sums["comm_s"], sums["exposed_comm_s"], sums["step_s"], comm_bytes,
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, mem.get("params", 0),
                        mem.get("grads", 0), mem.get("optim", 0), mem.get("gathered_peak", 0), cpu], dtype=np.float64)
        table = np.zeros((world.size, len(row)), dtype=np.float64)
        table[world.rank] = row
        await collectives.all_reduce(table, op="sum", group=world)
        if hasattr(strategy, "close"):
            strategy.close()
        per_rank = [dict(rank=r, compute_s=t[0] / args.steps, comm_s=t[1] / args.steps,
                         exposed_comm_s=t[2] / args.steps, step_s=t[3] / args.steps,
                         comm_bytes_per_step=int(t[4]) // args.steps, maxrss_bytes=int(t[5]),
                         params_bytes=int(t[6]), grads_bytes=int(t[7]), optim_bytes=int(t[8]),
                         gathered_peak_bytes=int(t[9]), cpu_s=t[10] / args.steps)
                    for r, t in enumerate(table)]
        return dict(framework="ringweave", strategy=args.strategy, ranks=world.size, steps=args.steps,
                    batch=args.batch, wall_s=wall, samples_per_s=args.steps * args.batch / wall,
                    numel=model.numel, first_loss=losses[0], last_loss=losses[-1], per_rank=per_rank)
    finally:
        await runtime.shutdown(rt)


def _worker_torch(args) -> dict:
    import resource

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # the launcher's store already sits on MASTER_PORT; torch rendezvous through a file instead
    dist.init_process_group("gloo", init_method=f"file://{args.torch_init_file}", rank=rank, world_size=size)
    try:
        torch.manual_seed(0)
        layers, d = [], args.in_dim
        for _ in range(args.depth):
            layers += [nn.Linear(d, args.width), nn.LayerNorm(args.width), nn.GELU()]
            d = args.width
        layers.append(nn.Linear(d, args.classes))
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        loss_fn = nn.CrossEntropyLoss()
        batches = [(torch.from_numpy(x), torch.from_numpy(y)) for [(x, y, _, _)] in _batches(args, rank, size)]

        def step(i):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()  # DDP all-reduces gradient buckets during backward
            opt.step()
            return float(loss)

        for i in range(args.warmup):
            step(i)
        dist.barrier()
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        step_s = 0.0
        for i in range(args.steps):
            t = time.perf_counter()
            step(i)
            step_s += time.perf_counter() - t
        dist.barrier()
        wall = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        row = torch.zeros(size, 3, dtype=torch.float64)
        row[rank] = torch.tensor([step_s, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, cpu])
        dist.all_reduce(row)
        per_rank = [dict(rank=r, step_s=float(t[0]) / args.steps, maxrss_bytes=int(t[1]),
                         cpu_s=float(t[2]) / args.steps) for r, t in enumerate(row)]
        numel = sum(p.numel() for p in model.parameters())
        return dict(framework="torch", strategy="torch-ddp", ranks=size, steps=args.steps, batch=args.batch,
                    wall_s=wall, samples_per_s=args.steps * args.batch / wall, numel=numel, per_rank=per_rank,
                    torch_version=torch.__version__)
    finally:
        dist.destroy_process_group()


def worker_main(args) -> int:
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        if args.strategy == "torch-ddp":
            result = _worker_torch(args)
        else:
            try:
                import uvloop
                result = uvloop.run(_worker_ringweave(args))
            except ImportError:  # pragma: no cover
                result = asyncio.run(_worker_ringweave(args))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0


# ---- the driver ----------------------------------------------------------------


def run_config(args, strategy: str, ranks: int, compression: str = "none") -> dict:
    """One job through the launcher; returns rank 0's result, or an error record."""
    with tempfile.TemporaryDirectory(prefix="rw-bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "runtime.launch", "-n", str(ranks), "--max-time-s", str(args.timeout_s),
               os.path.abspath(__file__), "--worker", "--strategy", strategy, "--result", result_path,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch", str(args.batch_per_rank * ranks if args.batch_per_rank else args.batch),
               "--in-dim", str(args.in_dim), "--width", str(args.width), "--depth", str(args.depth),
               "--classes", str(args.classes), "--torch-init-file", os.path.join(tmp, "torch-init"),
               "--compression", compression]
        env = dict(os.environ)
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"  # one BLAS thread per rank, at every world size
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True,
                              timeout=args.timeout_s + 30)
        elapsed = time.perf_counter() - started
        if proc.returncode != 0 or not os.path.exists(result_path):
            tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
            return dict(strategy=_label(strategy, compression), ranks=ranks, error=f"exit {proc.returncode}",
                        log=tail)
        with open(result_path) as f:
            result = json.load(f)
        result["job_s"] = elapsed
        result["strategy"], result["compression"] = _label(strategy, compression), compression
        return result


def _label(strategy: str, compression: str) -> str:
    return strategy if compression == "none" else f"{strategy}+{compression}"


def _mean(rows, key):
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['strategy']:>10} {r['ranks']:>5}  FAILED ({r['error']})"
    pr = r["per_rank"]
    comm, exposed = _mean(pr, "comm_s"), _mean(pr, "exposed_comm_s")
    overlap = (1 - exposed / comm) if comm == comm and comm > 1e-6 else float("nan")
    mem = max(p["maxrss_bytes"] for p in pr) / 2**20
    held = (_mean(pr, "params_bytes") + _mean(pr, "grads_bytes") + _mean(pr, "optim_bytes")) / 2**20 \
        if "params_bytes" in pr[0] else float("nan")
    sent = _mean(pr, "comm_bytes_per_step") / 2**20 if "comm_bytes_per_step" in pr[0] else float("nan")
    def f(value, fmt):  # '-' where a figure does not exist (torch's split, overlap at 1 rank)
        return format(value, fmt) if value == value else "-"

    return (f"{r['strategy']:>10} {r['ranks']:>5} {r['samples_per_s']:>9.1f} {1e3 * _mean(pr, 'step_s'):>8.1f} "
            f"{f(1e3 * _mean(pr, 'compute_s'), '.1f'):>9} {f(1e3 * comm, '.1f'):>8} {f(1e3 * exposed, '.1f'):>8} "
            f"{f(overlap, '.0%'):>8} {f(sent, '.1f'):>9} {f(held, '.1f'):>9} {mem:>9.0f} "
            f"{f(1e3 * _mean(pr, 'cpu_s'), '.0f'):>8}")


HEADER = (f"{'strategy':>10} {'ranks':>5} {'samples/s':>9} {'step ms':>8} {'compute':>9} {'comm':>8} "
          f"{'exposed':>8} {'overlap':>8} {'MiB sent':>9} {'MiB held':>9} {'maxrss':>9} {'cpu ms':>8}")


def goals(results: list[dict]) -> list[str]:
    by = {(r["strategy"], r["ranks"]): r for r in results if "error" not in r}
    lines = []
    for s in STRATEGIES:
        one, two = by.get((s, 1)), by.get((s, 2))
        if one and two:
            ratio = two["samples_per_s"] / one["samples_per_s"]
            lines.append(f"{s}: 2 ranks / 1 rank = {ratio:.2f}x (goal >= 1.7x) {'ok' if ratio >= 1.7 else 'MISSED'}")
    for s in ("ddp", "fsdp"):
        for n in (2, 4):
            r = by.get((s, n))
            if r:
                comm, exposed = _mean(r["per_rank"], "comm_s"), _mean(r["per_rank"], "exposed_comm_s")
                if comm > 0:
                    share = exposed / comm
                    lines.append(f"{s} at {n} ranks: exposed / comm = {share:.0%} (goal < 30%) "
                                 f"{'ok' if share < 0.3 else 'MISSED'}")
    torch4 = by.get(("torch-ddp", 4))
    if torch4:
        for s in STRATEGIES:
            r = by.get((s, 4))
            if r:
                ratio = r["samples_per_s"] / torch4["samples_per_s"]
                lines.append(f"{s} at 4 ranks / torch DDP = {ratio:.2f}x (goal >= 0.9x) "
                             f"{'ok' if ratio >= 0.9 else 'MISSED'}")
    return lines


def driver_main(args) -> int:
    strategies = [s for s in args.strategies.split(",") if s]
    ranks = [int(n) for n in args.ranks.split(",") if n]
    for s in strategies:
        if s not in STRATEGIES:
            raise SystemExit(f"unknown strategy {s!r}; expected some of {','.join(STRATEGIES)}")
    if args.compare == "torch":
        try:
            import torch  # noqa: F401
            strategies.append("torch-ddp")
        except ImportError:
            print("--compare torch: torch is not importable, skipping the comparison", file=sys.stderr)
    from trainer.nn import mlp

    numel = mlp(args.in_dim, (args.width,) * args.depth, args.classes).numel  # the units' size tables only
    print(f"# MLP {args.in_dim}-{'-'.join([str(args.width)] * args.depth)}-{args.classes}: {numel / 1e6:.2f}M "
          f"parameters, AdamW float32, "
          f"{f'batch {args.batch_per_rank} per rank' if args.batch_per_rank else f'global batch {args.batch}'}, "
          f"{args.warmup} warm-up + {args.steps} timed "
          f"steps, 1 BLAS thread per rank, {os.cpu_count()} cores")
    print("# per-rank means per step: compute, comm (in flight), exposed (waited on), cpu ms (CPU time of the "
          "process, all threads);\n# MiB held = params + grads + optim; maxrss = max over ranks (MiB)")
    print(HEADER, flush=True)
    results = []
    codecs = [c for c in args.compression.split(",") if c]
    for n in ranks:
        for s in strategies:
            runs = {c: [] for c in (codecs if s != "torch-ddp" else ["none"])}
            for _ in range(args.repeat):  # best of N: other processes on the machine only ever slow a run down
                for c in runs:  # codecs alternate run by run
                    load = os.getloadavg()[0]
                    r = run_config(args, s, n, c)
                    r["loadavg_before"] = load
                    runs[c].append(r)
            for c, tries in runs.items():
                ok = [r for r in tries if "error" not in r]
                r = max(ok, key=lambda r: r["samples_per_s"]) if ok else tries[0]
                r["repeats"] = [x.get("samples_per_s") for x in tries]
                results.append(r)
                print(format_row(r) + f"  (load {r['loadavg_before']:.1f})", flush=True)
                if "error" in r and args.verbose:
                    print(r["log"], file=sys.stderr)
    print()
    for line in goals(results):
        print(line)
    out = args.out or os.path.abspath(os.path.join(args.out_dir or os.getcwd(), "trainer.json"))  # not the source tree
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": dict(in_dim=args.in_dim, width=args.width, depth=args.depth, classes=args.classes,
                                 numel=numel), "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                   "cores": os.cpu_count(), "results": results, "goals": goals(results)}, f, indent=1)
    print(f"\nwrote {out}")
    return 0 if all("error" not in r for r in results) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--compare", choices=("torch",), default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=None,
                   help="a global batch, the same at every world size (strong scaling); default: --batch-per-rank")
    p.add_argument("--batch-per-rank", type=int, default=256,
                   help="rows per rank, global = this x ranks (weak scaling, as torch DDP counts batches; default 256)")
    p.add_argument("--in-dim", type=int, default=MODEL["in_dim"])
    p.add_argument("--width", type=int, default=MODEL["width"])
    p.add_argument("--depth", type=int, default=MODEL["depth"])
    p.add_argument("--classes", type=int, default=MODEL["classes"])
    p.add_argument("--quick", action="store_true", help="a 1M-parameter model and 5 steps (a smoke run)")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration; the fastest is reported")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per configuration")
    p.add_argument("--compression", default="none",
                   help="gradient codecs, comma-separated, each a row: e.g. none,int8 or int8+ef (TrainConfig."
                        "compression; the worker: one codec)")
    p.add_argument("--out-dir", default=None, help="directory for trainer.json (default: the current directory)")
    p.add_argument("--out", default=None, help="JSON path (default: OUT_DIR/trainer.json)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--torch-init-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.batch is not None and not args.worker:
        args.batch_per_rank = None  # an explicit global batch: strong scaling
    elif args.batch is None:
        args.batch = args.batch_per_rank
    if args.quick:
        args.in_dim, args.width, args.depth, args.steps, args.warmup = 256, 512, 3, 5, 2
    if args.worker:
        return worker_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
