"""Trainer benchmark: samples/s (tokens/s) and where a step's time goes, per strategy and world size.

    python bench/trainer.py                                  # ddp zero1 zero2 zero3 fsdp at 1, 2, 4 ranks
    python bench/trainer.py --compare torch                  # + torch DDP on Gloo, same model, same run
    python bench/trainer.py --model gpt --compare torch      # the default GPT; + torch DDP and FSDP on Gloo
    python bench/trainer.py --model gpt --profile            # one process: where the step's compute goes
    python bench/trainer.py --model gpt --interleave --repeat 10   # one process: ours and torch, turn by turn
    python bench/trainer.py --model gpt --page-faults        # what glibc's malloc defaults cost a step
    python bench/trainer.py --strategies ddp,fsdp --ranks 2,4 --steps 10 --quick
    python bench/trainer.py --strategies zero2 --ranks 4 --compression none,int8 --repeat 3   # rows zero2, zero2+int8
    python bench/trainer.py --model gpt --meshes dp4,tp2xdp2,pp2xdp2,tp2xpp2 --compare torch --repeat 3

Every configuration is its own job, started as
``python -m runtime.launch -n N bench/trainer.py --worker ...`` (torch DDP the
same way, with its own file:// rendezvous). Each rank holds one BLAS thread
(OPENBLAS_NUM_THREADS=1 and threadpoolctl), so 1 rank uses one core and 2
ranks two: the 2-rank speed-up is then a fair measure of scaling.

Model (--model mlp): a synthetic MLP 1024 -> 1536 x 4 (LayerNorm + GELU) -> 10, about 8.7M
parameters in 5 units, trained with AdamW in float32 on Gaussian clusters;
256 rows per rank by default (global batch 256 x N, as torch DDP counts batches; weak
scaling), or one global batch at every world size with ``--batch B`` (strong scaling).

Model (--model gpt): the default GPT of `python -m trainer --model gpt` (4 blocks, 4 heads,
width 128, block size 64, GELU tanh, tied head; --n-layer, --n-head, --n-embd, --block-size
resize it), AdamW float32, on random windows of the pydoc text; one global batch of 64
windows at every world size by default (the training job's), --batch to change it. torch's
model is the same architecture written as nanoGPT writes it (explicit causal softmax, GELU
tanh, the head tied to the embedding), run by torch DDP and by torch FSDP2 (`fully_shard`
per block and on the root, the ZeRO-3 of torch) on Gloo, one thread per rank.

Warm-up steps (not timed), then a barrier, `--steps` timed steps, a barrier. Every worker,
ours and torch's, first calls trainer.allocator.retain_freed_memory() (as `python -m
trainer` does): without it glibc returns a step's freed activations to the kernel and the
next step page-faults them back, which cost ringweave ~50 ms and torch ~12 ms of system
time per GPT step.

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

Targets, printed as ratios, never asserted: MLP: at 2 ranks >= 1.7x the samples/s of
1 rank; exposed < 30% of comm for ddp and fsdp; at 4 ranks >= 0.9x torch DDP's
samples/s. GPT: at 1 rank >= 0.8x torch's tokens/s; at 4 ranks fsdp >= 1.0x torch FSDP
and torch DDP.

--profile (one process, no launcher): the GPT's (or MLP's) forward, backward and
AdamW step under cProfile on the calling thread, the time grouped by what it is
(the Linear layers' matmuls, attention's batched matmuls and head copies, the
softmax, LayerNorm, GELU, cross-entropy, embeddings, the optimizer, the rest).
Communication is not in it: the multi-rank rows' comm and exposed columns are.

Gradient compression: ``--compression none,int8`` runs every configuration with each
TrainConfig.compression (a row per codec, labelled strategy+codec), alternating the
codecs run by run so that a busy machine slows each alike. The compressed collectives
always use the TCP algorithms (collectives/compressed.py), the exact ones may use shared
memory on one host: set RINGWEAVE_SHM=0 to compare both over TCP, as a network would.

Meshes (--meshes, --model gpt only): each label is a dp x tp x pp mesh of trainer.parallel,
e.g. tp2xpp2 (sizes not named are 1; the ranks are their product), run with --strategies on
the dp dimension and --micro-batches (default 8 where pp > 1, else 1) under --schedule. Its
row adds the pipeline's bubble (time blocked on stage-to-stage receives) beside the formula
(p-1)/(m+p-1) and the bytes each rank sent per step on dp, tp and pp. --compare torch adds torch
DDP and FSDP at the same world size (torch has no tensor or pipeline parallelism on CPU).

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
GPT_MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)  # the default of python -m trainer --model gpt
GPT_BATCH = 64  # windows per global batch: the training job's
TORCH_STRATEGIES = ("torch-ddp", "torch-fsdp")


# ---- one rank of one configuration -------------------------------------------


def _cpu_s() -> float:
    """CPU seconds this process has used, all threads (user + system)."""
    t = os.times()
    return t.user + t.system


def _gpt_config(args):
    from trainer.nn import GPTConfig

    return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)


def parse_mesh(label: str) -> dict:
    """'tp2xpp2' -> {"dp": 1, "tp": 2, "pp": 2}; 'dp4' -> {"dp": 4, "tp": 1, "pp": 1}."""
    sizes = {"dp": 1, "tp": 1, "pp": 1}
    for part in label.split("x"):
        dim, n = part[:2], part[2:]
        if dim not in sizes or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"bad mesh {label!r}: parts like dp4, tp2, pp2 joined by x")
        sizes[dim] = int(n)
    return sizes


def _mesh_ranks(label: str) -> int:
    s = parse_mesh(label)
    return s["dp"] * s["tp"] * s["pp"]


def _batches(args, rank: int, size: int):
    """A pool of global batches (cycled); this rank's rows of each, as train_step micro-batches."""
    from trainer.data import make_synthetic, split_bounds

    pool = 4
    bounds = split_bounds(args.batch, size)
    if args.model == "gpt":
        from trainer.text import load_text_split

        windows = load_text_split(args.block_size).train
        x, y = windows.get(np.arange(pool * args.batch), epoch=0)
    else:
        x, y = make_synthetic(pool * args.batch, args.in_dim, args.classes, seed=0)
    out = []
    for k in range(pool):
        lo, hi = k * args.batch + bounds[rank], k * args.batch + bounds[rank + 1]
        out.append([(x[lo:hi], y[lo:hi], bounds[rank], args.batch)])
    return out


def _ringweave_model(args, pad_to: int = 1):
    from trainer.nn import GPT, mlp

    if args.model == "gpt":
        return GPT(_gpt_config(args))
    return mlp(args.in_dim, (args.width,) * args.depth, args.classes, pad_to=pad_to)


async def _worker_ringweave(args) -> dict:
    import collectives
    import runtime
    from trainer.sharding import make_strategy
    from trainer.sharding.base import TrainConfig

    rt = await runtime.init()
    world = rt.world
    try:
        model = _ringweave_model(args, world.size)
        config = TrainConfig(strategy=args.strategy, optimizer="adamw", lr=1e-3, warmup_steps=0,
                             total_steps=1, seed=0, compression=args.compression,
                             activation_checkpointing=args.activation_checkpointing)
        if args.mesh:
            from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy

            mesh = Mesh(world, **parse_mesh(args.mesh))
            m = args.micro_batches or (8 if mesh.shape["pp"] > 1 else 1)
            strategy = make_parallel_strategy(args.strategy, _gpt_config(args), config, mesh,
                                              parallel=ParallelConfig(schedule=args.schedule, micro_batches=m))
            batches = _batches(args, mesh.coords["dp"], mesh.shape["dp"])  # every rank of a dp slice: its rows
        else:
            strategy = make_strategy(args.strategy, model, config, world)
            batches = _batches(args, world.rank, world.size)
        await strategy.setup()
        for i in range(args.warmup):
            await strategy.train_step(batches[i % len(batches)])
        if hasattr(strategy, "reset_peak"):
            strategy.reset_peak()
        sums = {"compute_s": 0.0, "comm_s": 0.0, "exposed_comm_s": 0.0, "step_s": 0.0, "bubble_s": 0.0,
                "pipeline_s": 0.0}
        comm_bytes = 0
        by_dim = {"dp": 0, "tp": 0, "pp": 0}
        losses = []
        await collectives.barrier(group=world)
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        for i in range(args.steps):
            t = time.perf_counter()
            result = await strategy.train_step(batches[i % len(batches)])
            step_s = time.perf_counter() - t
            for key in ("compute_s", "comm_s", "exposed_comm_s", "bubble_s", "pipeline_s"):
                sums[key] += float(result.timings.get(key, 0.0))
            sums["step_s"] += step_s
            comm_bytes += int(result.comm_bytes)
            for dim in by_dim:
                by_dim[dim] += int(result.comm_bytes_by_dim.get(dim, 0))
            losses.append(result.loss)
        await collectives.barrier(group=world)
        wall = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        mem = strategy.memory_bytes()
        import resource

        row = np.array([sums["compute_s"], sums["comm_s"], sums["exposed_comm_s"], sums["step_s"], comm_bytes,
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, mem.get("params", 0),
                        mem.get("grads", 0), mem.get("optim", 0), mem.get("gathered_peak", 0), cpu,
                        mem.get("activations_peak", 0), sums["bubble_s"], sums["pipeline_s"], by_dim["dp"],
                        by_dim["tp"], by_dim["pp"],
                        strategy.pipeline_report()["bubble_formula"] if args.mesh else 0.0], dtype=np.float64)
        table = np.zeros((world.size, len(row)), dtype=np.float64)
        table[world.rank] = row
        await collectives.all_reduce(table, op="sum", group=world)
        if hasattr(strategy, "close"):
            strategy.close()
        per_rank = [dict(rank=r, compute_s=t[0] / args.steps, comm_s=t[1] / args.steps,
                         exposed_comm_s=t[2] / args.steps, step_s=t[3] / args.steps,
                         comm_bytes_per_step=int(t[4]) // args.steps, maxrss_bytes=int(t[5]),
                         params_bytes=int(t[6]), grads_bytes=int(t[7]), optim_bytes=int(t[8]),
                         gathered_peak_bytes=int(t[9]), cpu_s=t[10] / args.steps, activations_peak_bytes=int(t[11]),
                         bubble_s=t[12] / args.steps, pipeline_s=t[13] / args.steps,
                         sent_per_step={d: int(t[14 + k]) // args.steps for k, d in enumerate(("dp", "tp", "pp"))},
                         bubble_formula=t[17])
                    for r, t in enumerate(table)]
        return dict(framework="ringweave", strategy=args.strategy, ranks=world.size, steps=args.steps,
                    mesh=args.mesh,
                    batch=args.batch, wall_s=wall, samples_per_s=args.steps * args.batch / wall,
                    tokens_per_sample=args.block_size if args.model == "gpt" else 1,
                    numel=model.numel, first_loss=losses[0], last_loss=losses[-1], per_rank=per_rank)
    finally:
        await runtime.shutdown(rt)


def _torch_model(args):
    """The benchmark's model in torch: the MLP, or the GPT as nanoGPT writes it (tied head, GELU tanh)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    if args.model != "gpt":
        layers, d = [], args.in_dim
        for _ in range(args.depth):
            layers += [nn.Linear(d, args.width), nn.LayerNorm(args.width), nn.GELU()]
            d = args.width
        layers.append(nn.Linear(d, args.classes))
        return nn.Sequential(*layers), nn.CrossEntropyLoss()

    C, H, T = args.n_embd, args.n_head, args.block_size
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, t, _ = x.shape
            q, k, v = (z.view(B, t, H, C // H).transpose(1, 2) for z in self.qkv(self.ln_1(x)).split(C, dim=2))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
            y = F.softmax(att.masked_fill(mask[:t, :t], float("-inf")), dim=-1) @ v
            x = x + self.proj(y.transpose(1, 2).reshape(B, t, C))
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(256, C), nn.Embedding(T, C)
            self.blocks = nn.ModuleList(Block() for _ in range(args.n_layer))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx):
            h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                h = block(h)
            return self.ln_f(h) @ self.wte.weight.T  # the tied head

    def lm_loss(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return GPT(), lm_loss


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
        module, loss_fn = _torch_model(args)
        if args.strategy == "torch-fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (size,))
            units = module.blocks if args.model == "gpt" else [m for m in module if isinstance(m, nn.Linear)]
            for unit in units:
                fully_shard(unit, mesh=mesh)  # one unit per block (per Linear for the MLP), as ringweave's
            model = fully_shard(module, mesh=mesh)
        else:
            model = nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        batches = [(torch.from_numpy(x), torch.from_numpy(y)) for [(x, y, _, _)] in _batches(args, rank, size)]

        def step(i):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()  # DDP all-reduces gradient buckets during backward; FSDP reduce-scatters
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
        numel = sum(p.numel() for p in module.parameters()) * (size if args.strategy == "torch-fsdp" else 1)
        return dict(framework="torch", strategy=args.strategy, ranks=size, steps=args.steps, batch=args.batch,
                    wall_s=wall, samples_per_s=args.steps * args.batch / wall, numel=numel, per_rank=per_rank,
                    tokens_per_sample=args.block_size if args.model == "gpt" else 1,
                    torch_version=torch.__version__)
    finally:
        dist.destroy_process_group()


def worker_main(args) -> int:
    from threadpoolctl import threadpool_limits

    from trainer.allocator import retain_freed_memory

    retain_freed_memory()  # as python -m trainer does; torch's workers too (their page faults fall as well)

    with threadpool_limits(limits=1, user_api="blas"):
        if args.strategy in TORCH_STRATEGIES:
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
    if args.strategy in TORCH_STRATEGIES:
        # Gloo's worker threads can abort the interpreter's finalization ("terminate called without an
        # active exception", exit 134, pytorch/pytorch#179291) after the process group is destroyed and
        # the measurement is written; seen in 2 of 6 torch runs of one bench/machine.py sitting.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


# ---- --interleave: ringweave and torch in one process, round by round -----------


def interleave_main(args) -> int:
    """One process, one BLAS thread: ringweave's ddp (the strategy at world size 1, its compute thread
    included) and torch's plain model take turns, `--steps` steps each per round, for `--repeat` rounds;
    each round's ratio is taken between two runs seconds apart, so a busy machine slows both alike."""
    import statistics

    import torch
    from threadpoolctl import threadpool_limits

    from runtime.testing import run_ranks
    from trainer.sharding import make_strategy
    from trainer.sharding.base import TrainConfig

    from trainer.allocator import retain_freed_memory

    retain_freed_memory()  # for both: the process's malloc, as python -m trainer sets it
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module, loss_fn = _torch_model(args)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    [(x, y, offset, size)] = _batches(args, 0, 1)[0]
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    per_sample = args.block_size if args.model == "gpt" else 1

    def torch_step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(module(tx), ty)
        loss.backward()
        opt.step()

    async def body(group):
        strategy = make_strategy("ddp", _ringweave_model(args), TrainConfig(lr=1e-3, total_steps=1), group)
        await strategy.setup()
        try:
            for _ in range(args.warmup):
                await strategy.train_step([(x, y, offset, size)])
                torch_step()
            rows = []
            for _ in range(args.repeat):
                cpu0, t0 = _cpu_s(), time.perf_counter()
                for _ in range(args.steps):
                    await strategy.train_step([(x, y, offset, size)])
                ours, ours_cpu = time.perf_counter() - t0, _cpu_s() - cpu0
                cpu0, t0 = _cpu_s(), time.perf_counter()
                for _ in range(args.steps):
                    torch_step()
                theirs, theirs_cpu = time.perf_counter() - t0, _cpu_s() - cpu0
                rows.append((ours, theirs, ours_cpu, theirs_cpu, os.getloadavg()[0]))
            return rows
        finally:
            strategy.close()

    with threadpool_limits(limits=1, user_api="blas"):
        [rows] = asyncio.run(run_ranks(1, body, timeout_s=3600))
    tokens = args.steps * args.batch * per_sample
    print(f"# {args.model}, 1 rank, batch {args.batch}, {args.steps} steps per turn, {args.repeat} rounds, 1 thread: "
          f"ringweave ddp (the strategy, compute thread included) and torch (plain module + AdamW) alternate")
    print(f"{'round':>5} {'ours tok/s':>11} {'torch tok/s':>12} {'ratio':>6} {'ours cpu ms':>12} {'torch cpu ms':>13} "
          f"{'load':>5}")
    for k, (ours, theirs, oc, tc, load) in enumerate(rows):
        print(f"{k:>5} {tokens / ours:11.0f} {tokens / theirs:12.0f} {theirs / ours:6.2f} "
              f"{1e3 * oc / args.steps:12.1f} {1e3 * tc / args.steps:13.1f} {load:5.1f}")
    ratios = [theirs / ours for ours, theirs, *_ in rows]
    cpu = [tc / oc for _, _, oc, tc, _ in rows]
    print(f"median ratio of tokens/s (ours / torch) {statistics.median(ratios):.2f}x (goal >= 0.8x), "
          f"of CPU time per step (torch / ours) {statistics.median(cpu):.2f}x")
    if args.out:  # --out: the rounds as JSON too (bench/machine.py reads the median)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "steps": args.steps, "batch": args.batch, "ratios": ratios,
                       "median_ratio": statistics.median(ratios), "median_cpu_ratio": statistics.median(cpu)}, f,
                      indent=1)
    return 0


# ---- --page-faults: what glibc's defaults cost a step --------------------------


def page_faults_worker(args) -> int:
    """One process: `--steps` steps of ours (the strategy at world size 1) or torch's, with or without
    retain_freed_memory(); prints user and system ms and minor faults per step as JSON."""
    import resource

    from threadpoolctl import threadpool_limits

    framework, retain = args.page_faults_worker.split(":")
    if retain == "1":
        from trainer.allocator import retain_freed_memory

        retain_freed_memory()
    [(x, y, offset, size)] = _batches(args, 0, 1)[0]
    if framework == "torch":
        import torch

        torch.set_num_threads(1)
        module, loss_fn = _torch_model(args)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)

        async def steps(n):
            for _ in range(n):
                opt.zero_grad(set_to_none=True)
                loss_fn(module(tx), ty).backward()
                opt.step()
    else:
        from runtime.testing import run_ranks
        from trainer.sharding import make_strategy
        from trainer.sharding.base import TrainConfig

        state = {}

        async def steps(n):
            async def body(group):
                if "strategy" not in state:
                    state["strategy"] = make_strategy("ddp", _ringweave_model(args), TrainConfig(total_steps=1), group)
                    await state["strategy"].setup()
                for _ in range(n):
                    await state["strategy"].train_step([(x, y, offset, size)])
            await run_ranks(1, body)

    with threadpool_limits(limits=1, user_api="blas"):
        asyncio.run(steps(args.warmup))
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        asyncio.run(steps(args.steps))
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    n = args.steps
    print(json.dumps(dict(user_ms=1e3 * (r1.ru_utime - r0.ru_utime) / n, sys_ms=1e3 * (r1.ru_stime - r0.ru_stime) / n,
                          minflt=(r1.ru_minflt - r0.ru_minflt) / n)))
    return 0


def page_faults_main(args) -> int:
    """Ours and torch's, each with glibc's defaults and with retain_freed_memory(), each in a fresh process."""
    print(f"# {args.model}, batch {args.batch}, {args.warmup} warm-up + {args.steps} steps, one process each, "
          f"1 thread; ours through the ddp strategy at world size 1 (its compute thread allocates); load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'framework':<10} {'malloc':<22} {'user ms/step':>12} {'sys ms/step':>12} {'minor faults/step':>18}")
    for framework in ("ringweave", "torch"):
        for retain in ("0", "1"):
            cmd = [sys.executable, os.path.abspath(__file__), "--page-faults-worker", f"{framework}:{retain}",
                   "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd",
                   str(args.n_embd), "--block-size", str(args.block_size)]
            proc = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=args.timeout_s,
                                  env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(proc.stdout.splitlines()[-1])
            label = "retain_freed_memory()" if retain == "1" else "glibc defaults"
            print(f"{framework:<10} {label:<22} {r['user_ms']:12.1f} {r['sys_ms']:12.1f} {r['minflt']:18.0f}")
    return 0


# ---- --profile: where one process's step goes ---------------------------------


def _profile_group(filename: str, name: str, owner: str) -> str:
    """What a profiled function is, from its file, name and (for layer methods) its class."""
    if owner == "Linear":
        return "matmuls: Linear layers (x W + b and its backward)"
    if owner == "_TiedHead":
        return "matmuls: the tied head (z wte^T and its backward)"
    if owner == "LayerNorm" or "layernorm" in name:
        return "layernorm"
    if owner == "GELU" or "gelu" in name or "erf" in name:
        return "gelu"
    if "softmax" in name:
        return "softmax (attention)"
    if filename.endswith("attention.py"):
        return "attention: q k^T, p v and their backward; head split/merge"
    if "_ce_" in name or "cross_entropy" in name or filename.endswith("loss.py"):
        return "cross-entropy"
    if "embedding" in name or filename.endswith("embedding.py"):
        return "embeddings (lookup, scatter-add)"
    if filename.endswith("optim.py"):
        return "optimizer (AdamW)"
    return "other (residual adds, dropout, Python)"


def profile_main(args) -> int:
    """One process, this thread: forward, backward and AdamW under cProfile, grouped."""
    import cProfile
    import inspect
    import pstats

    from threadpoolctl import threadpool_limits

    from trainer.allocator import retain_freed_memory
    from trainer.nn import Context, gpt, layers
    from trainer.optim import AdamW

    retain_freed_memory()  # as python -m trainer does

    owners = {}  # (file, first line) of a layer's forward/backward -> its class
    for cls in (layers.Linear, layers.LayerNorm, layers.GELU, gpt._TiedHead):
        for method in ("forward", "backward"):
            code = getattr(cls, method).__code__
            owners[(inspect.getsourcefile(code), code.co_firstlineno)] = cls.__name__
    model = _ringweave_model(args)
    params, grads = model.init_params(0), model.zeros()
    opt = AdamW(weight_decay=0.01, kernel="numba")
    states = [opt.init_state(p.size, p.dtype) for p in params]
    [(x, y, _, _)] = _batches(args, 0, 1)[0]

    def step():
        model.zero_grads(grads)
        model.forward_backward(params, grads, x, y, Context(), grads_zero=True,
                               checkpoint=args.activation_checkpointing)
        for p, g, s, u in zip(params, grads, states, model.units):
            opt.step(p, g, s, 1e-3, segments=u.decay_segments(0, len(p)))

    with threadpool_limits(limits=1, user_api="blas"):
        for _ in range(args.warmup):
            step()
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        for _ in range(args.steps):
            step()
        profiler.disable()
        wall = time.perf_counter() - t0
    groups: dict[str, float] = {}
    for (filename, line, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        label = _profile_group(filename, name, owners.get((filename, line), ""))
        groups[label] = groups.get(label, 0.0) + tottime
    total = sum(groups.values())
    tokens = x.size if args.model == "gpt" else len(x)
    unit = "tokens" if args.model == "gpt" else "samples"
    print(f"# {args.model}: {model.numel:,} parameters, batch {args.batch} "
          f"{'windows of ' + str(args.block_size) + ' tokens' if args.model == 'gpt' else 'rows'}, "
          f"{args.steps} steps, 1 thread; {1e3 * wall / args.steps:.1f} ms per step "
          f"({tokens * args.steps / wall:,.0f} {unit}/s) under cProfile (load {os.getloadavg()[0]:.1f})")
    print(f"{'where':<62} {'ms/step':>8} {'share':>6}")
    for label, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{label:<62} {1e3 * seconds / args.steps:8.1f} {seconds / total:6.0%}")
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
               "--compression", compression, "--model", args.model, "--n-layer", str(args.n_layer),
               "--n-head", str(args.n_head), "--n-embd", str(args.n_embd), "--block-size", str(args.block_size)]
        cmd += ["--activation-checkpointing"] if args.activation_checkpointing else []
        if getattr(args, "mesh", None) and strategy not in TORCH_STRATEGIES:
            cmd += ["--mesh", args.mesh, "--schedule", args.schedule]
            cmd += ["--micro-batches", str(args.micro_batches)] if args.micro_batches else []
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


def run_mesh(args, mesh: str, strategy: str) -> dict:
    """One mesh configuration through the launcher (the worker with --mesh)."""
    saved = (args.mesh,)
    args.mesh = mesh
    try:
        r = run_config(args, strategy, _mesh_ranks(mesh))
    finally:
        (args.mesh,) = saved
    r["label"] = f"{mesh}/{strategy}"
    return r


def format_mesh_row(r: dict) -> str:
    label = r.get("label", r["strategy"])
    if "error" in r:
        return f"{label:>16} {r['ranks']:>5}  FAILED ({r['error']})"
    pr = r["per_rank"]
    rate = r["samples_per_s"] * r.get("tokens_per_sample", 1)
    def ms(key):
        value = _mean(pr, key)
        return f"{1e3 * value:.1f}" if value == value else "-"
    if "bubble_s" in pr[0] and _mean(pr, "pipeline_s") > 0:
        bubble = f"{_mean(pr, 'bubble_s') / _mean(pr, 'pipeline_s'):.2f}/{pr[0]['bubble_formula']:.2f}"
    else:
        bubble = "-"
    sent = " ".join(f"{_mean([p['sent_per_step'] for p in pr], d) / 2**20:6.1f}" if "sent_per_step" in pr[0]
                    else f"{'-':>6}" for d in ("dp", "tp", "pp"))
    mem = max(p["maxrss_bytes"] for p in pr) / 2**20
    return (f"{label:>16} {r['ranks']:>5} {rate:>9.0f} {ms('step_s'):>8} {ms('compute_s'):>8} "
            f"{ms('exposed_comm_s'):>8} {ms('bubble_s'):>8} {bubble:>10} {sent} {mem:>7.0f}")


def mesh_header() -> str:
    return (f"{'mesh/strategy':>16} {'ranks':>5} {'tokens/s':>9} {'step ms':>8} {'compute':>8} {'exposed':>8} "
            f"{'bubble':>8} {'meas/form':>10} {'dp MiB':>6} {'tp MiB':>6} {'pp MiB':>6} {'maxrss':>7}")


def mesh_main(args) -> int:
    """--meshes: each mesh (and torch DDP / FSDP at its world size), alternating run by run."""
    meshes = [m for m in args.meshes.split(",") if m]
    strategy = args.strategies.split(",")[0] if args.strategies != ",".join(STRATEGIES) else "ddp"
    configs = [(m, strategy) for m in meshes]
    if args.compare == "torch":
        for n in sorted({_mesh_ranks(m) for m in meshes}):
            configs += [(f"torch{n}", "torch-ddp"), (f"torch{n}", "torch-fsdp")]
    model = _ringweave_model(args)
    print(f"# GPT {args.n_layer} layers x {args.n_head} heads x {args.n_embd} wide, block {args.block_size}: "
          f"{model.numel / 1e6:.2f}M parameters, AdamW float32, global batch {args.batch} windows, "
          f"{args.schedule}, {args.warmup} warm-up + {args.steps} timed steps, 1 BLAS thread per rank, "
          f"{os.cpu_count()} cores; configurations alternate run by run, best of --repeat {args.repeat}")
    print("# per-rank means per step (ms): compute, exposed communication (dp + tp + statistics waited on), "
          "bubble (blocked on pipeline receives); meas/form = bubble / pipeline time beside (p-1)/(m+p-1); "
          "MiB sent per step per rank by dimension; maxrss MiB")
    print(mesh_header(), flush=True)
    runs: dict[tuple, list] = {c: [] for c in configs}
    for _ in range(args.repeat):
        for mesh, s in configs:
            load = os.getloadavg()[0]
            if s in TORCH_STRATEGIES:
                r = run_config(args, s, int(mesh[len("torch"):]))
                r["label"] = s
            else:
                r = run_mesh(args, mesh, s)
            r["loadavg_before"] = load
            runs[(mesh, s)].append(r)
    results = []
    for tries in runs.values():
        ok = [r for r in tries if "error" not in r]
        r = max(ok, key=lambda r: r["samples_per_s"]) if ok else tries[0]
        r["repeats"] = [x.get("samples_per_s") for x in tries]
        results.append(r)
        runs_text = ", ".join(f"{x:.1f}" for x in r["repeats"] if x)
        print(format_mesh_row(r) + f"  (load {r['loadavg_before']:.1f}; samples/s of each run {runs_text})", flush=True)
    good = [r for r in results if "error" not in r]
    if good:
        best = max(good, key=lambda r: r["samples_per_s"])
        rate = best["samples_per_s"] * best.get("tokens_per_sample", 1)
        print(f"\nfastest: {best['label']} at {rate:.0f} tokens/s; the others' tokens/s against it: "
              + ", ".join(f"{r['label']} {r['samples_per_s'] / best['samples_per_s']:.2f}x"
                          for r in good if r is not best))
    out = args.out or os.path.abspath(os.path.join(args.out_dir or os.getcwd(), "parallel.json"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": dict(kind="gpt", numel=model.numel, n_layer=args.n_layer, n_head=args.n_head,
                                 n_embd=args.n_embd, block_size=args.block_size), "batch": args.batch,
                   "steps": args.steps, "warmup": args.warmup, "cores": os.cpu_count(), "results": results}, f,
                  indent=1)
    print(f"\nwrote {out}")
    return 0 if len(good) == len(results) else 1


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

    rate = r["samples_per_s"] * r.get("tokens_per_sample", 1)
    return (f"{r['strategy']:>10} {r['ranks']:>5} {rate:>9.1f} {1e3 * _mean(pr, 'step_s'):>8.1f} "
            f"{f(1e3 * _mean(pr, 'compute_s'), '.1f'):>9} {f(1e3 * comm, '.1f'):>8} {f(1e3 * exposed, '.1f'):>8} "
            f"{f(overlap, '.0%'):>8} {f(sent, '.1f'):>9} {f(held, '.1f'):>9} {mem:>9.0f} "
            f"{f(1e3 * _mean(pr, 'cpu_s'), '.0f'):>8}")


def header(model: str) -> str:
    rate = "tokens/s" if model == "gpt" else "samples/s"
    return (f"{'strategy':>10} {'ranks':>5} {rate:>9} {'step ms':>8} {'compute':>9} {'comm':>8} "
            f"{'exposed':>8} {'overlap':>8} {'MiB sent':>9} {'MiB held':>9} {'maxrss':>9} {'cpu ms':>8}")


def gpt_goals(results: list[dict]) -> list[str]:
    """The GPT's goals: at 1 rank >= 0.8x torch's tokens/s, at 4 ranks fsdp >= 1.0x torch FSDP and DDP."""
    by = {(r["strategy"], r["ranks"]): r for r in results if "error" not in r}
    lines = []
    for ours, n, theirs, goal in [("ddp", 1, "torch-ddp", 0.8), ("fsdp", 1, "torch-ddp", 0.8),
                                  ("fsdp", 4, "torch-fsdp", 1.0), ("fsdp", 4, "torch-ddp", 1.0),
                                  ("ddp", 4, "torch-ddp", 1.0)]:
        a, b = by.get((ours, n)), by.get((theirs, n))
        if a and b:
            ratio = a["samples_per_s"] / b["samples_per_s"]
            lines.append(f"{ours} / {theirs} at {n} rank(s) = {ratio:.2f}x tokens/s (goal >= {goal}x) "
                         f"{'ok' if ratio >= goal else 'MISSED'}")
    return lines


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
            strategies += ["torch-ddp", "torch-fsdp"] if args.model == "gpt" else ["torch-ddp"]
        except ImportError:
            print("--compare torch: torch is not importable, skipping the comparison", file=sys.stderr)
    model = _ringweave_model(args)  # the units' size tables only
    if args.model == "gpt":
        print(f"# GPT {args.n_layer} layers x {args.n_head} heads x {args.n_embd} wide, block {args.block_size}: "
              f"{model.numel / 1e6:.2f}M parameters, AdamW float32, global batch {args.batch} windows "
              f"({args.batch * args.block_size} tokens) at every world size, {args.warmup} warm-up + {args.steps} "
              f"timed steps, 1 BLAS thread per rank, {os.cpu_count()} cores"
              + (", activation checkpointing" if args.activation_checkpointing else ""))
    else:
        print(f"# MLP {args.in_dim}-{'-'.join([str(args.width)] * args.depth)}-{args.classes}: "
              f"{model.numel / 1e6:.2f}M parameters, AdamW float32, "
              f"{f'batch {args.batch_per_rank} per rank' if args.batch_per_rank else f'global batch {args.batch}'}, "
              f"{args.warmup} warm-up + {args.steps} timed steps, 1 BLAS thread per rank, {os.cpu_count()} cores")
    print("# per-rank means per step: compute, comm (in flight), exposed (waited on), cpu ms (CPU time of the "
          "process, all threads);\n# MiB held = params + grads + optim; maxrss = max over ranks (MiB); "
          "configurations alternate run by run, best of --repeat")
    print(header(args.model), flush=True)
    results = []
    codecs = [c for c in args.compression.split(",") if c]
    for n in ranks:
        runs = {(s, c): [] for s in strategies for c in (codecs if s not in TORCH_STRATEGIES else ["none"])}
        for _ in range(args.repeat):  # best of N: other processes on the machine only ever slow a run down
            for (s, c), tries in runs.items():  # strategies and codecs alternate run by run
                load = os.getloadavg()[0]
                r = run_config(args, s, n, c)
                r["loadavg_before"] = load
                tries.append(r)
        for (s, c), tries in runs.items():
            ok = [r for r in tries if "error" not in r]
            r = max(ok, key=lambda r: r["samples_per_s"]) if ok else tries[0]
            r["repeats"] = [x.get("samples_per_s") for x in tries]
            results.append(r)
            print(format_row(r) + f"  (load {r['loadavg_before']:.1f})", flush=True)
            if "error" in r and args.verbose:
                print(r["log"], file=sys.stderr)
    print()
    for line in (gpt_goals(results) if args.model == "gpt" else goals(results)):
        print(line)
    out = args.out or os.path.abspath(os.path.join(args.out_dir or os.getcwd(), "trainer.json"))  # not the source tree
    os.makedirs(os.path.dirname(out), exist_ok=True)
    shape = (dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
             if args.model == "gpt" else dict(in_dim=args.in_dim, width=args.width, depth=args.depth,
                                               classes=args.classes))
    with open(out, "w") as f:
        json.dump({"model": dict(kind=args.model, numel=model.numel, **shape), "batch": args.batch,
                   "steps": args.steps, "warmup": args.warmup, "cores": os.cpu_count(), "results": results,
                   "goals": gpt_goals(results) if args.model == "gpt" else goals(results)}, f, indent=1)
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
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--n-layer", type=int, default=GPT_MODEL["n_layer"])
    p.add_argument("--n-head", type=int, default=GPT_MODEL["n_head"])
    p.add_argument("--n-embd", type=int, default=GPT_MODEL["n_embd"])
    p.add_argument("--block-size", type=int, default=GPT_MODEL["block_size"])
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="one process: where the step's compute goes (cProfile, grouped); no launcher")
    p.add_argument("--interleave", action="store_true",
                   help="one process: ringweave ddp at world size 1 and torch alternate, --repeat rounds")
    p.add_argument("--page-faults", action="store_true",
                   help="user / system time and page faults per step, ours and torch's, with and without "
                        "trainer.allocator.retain_freed_memory()")
    p.add_argument("--page-faults-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="a 1M-parameter model and 5 steps (a smoke run)")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration; the fastest is reported")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per configuration")
    p.add_argument("--compression", default="none",
                   help="gradient codecs, comma-separated, each a row: e.g. none,int8 or int8+ef (TrainConfig."
                        "compression; the worker: one codec)")
    p.add_argument("--out-dir", default=None, help="directory for trainer.json (default: the current directory)")
    p.add_argument("--out", default=None, help="JSON path (default: OUT_DIR/trainer.json; --interleave: none)")
    p.add_argument("--meshes", default=None,
                   help="--model gpt: meshes to compare, e.g. dp4,tp2xdp2,pp2xdp2,tp2xpp2 (a row each)")
    p.add_argument("--micro-batches", type=int, default=None, help="pipeline micro-batches (default 8 with pp > 1)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--mesh", default=None, help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--torch-init-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model == "gpt" and args.batch is None and not args.worker:
        args.batch = GPT_BATCH  # one global batch at every world size: the training job's
    if args.batch is not None and not args.worker:
        args.batch_per_rank = None  # an explicit global batch: strong scaling
    elif args.batch is None:
        args.batch = args.batch_per_rank
    if args.quick:
        args.in_dim, args.width, args.depth, args.steps, args.warmup = 256, 512, 3, 5, 2
        args.n_layer, args.n_embd, args.block_size = 2, 64, 32
    if args.worker:
        return worker_main(args)
    if args.page_faults_worker:
        return page_faults_worker(args)
    if args.page_faults:
        return page_faults_main(args)
    if args.profile:
        return profile_main(args)
    if args.meshes:
        if args.model != "gpt":
            raise SystemExit("--meshes splits the GPT: add --model gpt")
        return mesh_main(args)
    if args.interleave:
        return interleave_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
