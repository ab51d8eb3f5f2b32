"""torch.distributed on the "ringweave" backend beside Gloo, in the same run: DDP and FSDP2 training
steps, and the all_reduce of one large float32 tensor, beside the same NumPy array through
ringweave's own API (what the torch layer costs).

    python bench/torch_backend.py                        # launches itself with 2 ranks
    python bench/torch_backend.py -n 4 --hidden 2048 --layers 4 --steps 30 --mib 64 --json out.json
    python bench/torch_backend.py --hidden 64 --steps 3 --mib 1      # a quick check that it runs

Each rank trains the same MLP (``--layers`` Linear layers of ``--hidden`` features, ``--batch``
rows per rank) with SGD: first on "ringweave", then on Gloo (``init_process_group("gloo")``, which
our launcher's rendezvous also serves), each under DDP and under FSDP2 (``fully_shard`` per layer
and at the root). ``--warmup`` steps are not timed; a barrier precedes the timed steps, and the
median step is shown. Validation before any figure: both backends must end on the same parameters
(to float tolerance), and the all_reduce must give its closed-form sum. Rank 0 prints one row per
measurement: ringweave's time, the peer's, and the ratio peer / ringweave (above 1: ringweave is
faster). The peer of ``all_reduce numpy`` is ringweave's own API on a NumPy array of the same size
(``Communicator.all_reduce``), so its ratio is what the torch layer costs. Figures belong in
bench/results/, with the command, the machine and the date.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]
# bench/collectives.py is named like the package: this folder must not come first on sys.path
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or os.curdir).resolve() not in (_HERE, _ROOT)]


def _model(args):
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _train(args, kind: str) -> tuple[list[float], list]:
    """(step times in seconds, the final parameters) of ``--warmup`` + ``--steps`` steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    m = _model(args)
    if kind == "ddp":
        m = DistributedDataParallel(m)
    else:
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    data = [torch.randn(args.batch, args.hidden, generator=g) for _ in range(4)]
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
        x = data[step % len(data)]
        start = time.perf_counter()
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    params = m.module.parameters() if kind == "ddp" else (p.full_tensor() for p in m.parameters())
    return times, [p.detach().clone() for p in params]


def _all_reduce_times(args, run) -> list[float]:
    """Times of ``run()`` (one all_reduce), ``--warmup`` untimed first, a barrier before the rest."""
    import torch.distributed as dist
    times = []
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            dist.barrier()
        start = time.perf_counter()
        run()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def _check_sum(x, world: int) -> None:
    want = world * (world + 1) / 2  # rank r contributes r + 1
    if not (x == want).all():
        raise AssertionError(f"all_reduce gave {x.reshape(-1)[:4].tolist()}..., not {want}: nothing is timed")


def worker(args) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    import ringweave_torch

    count = args.mib * (1 << 20) // 4
    times, params = {}, {}
    for backend in ("ringweave", "gloo"):
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        for kind in ("ddp", "fsdp"):
            times[backend, kind], params[backend, kind] = _train(args, kind)
        t = torch.full((count,), float(rank + 1))
        dist.all_reduce(t)
        _check_sum(t, world)
        times[backend, "all_reduce"] = _all_reduce_times(args, lambda: dist.all_reduce(t))
        if backend == "ringweave":  # the same job's own API on a NumPy array of the same size
            comm = ringweave_torch.communicator()
            a = np.full(count, float(rank + 1), np.float32)
            comm.all_reduce(a)
            _check_sum(a, world)
            times["numpy", "all_reduce"] = _all_reduce_times(args, lambda: comm.all_reduce(a))
        dist.destroy_process_group()
    for kind in ("ddp", "fsdp"):
        worst = max((a - b).abs().max().item() for a, b in zip(params["ringweave", kind], params["gloo", kind]))
        if worst > 1e-4:
            raise AssertionError(f"{kind}: ringweave and Gloo end {worst:.3g} apart: the figures are not comparable")
    median = {key: statistics.median(v) for key, v in times.items()}
    rows = [(f"{kind} step", median["ringweave", kind], "gloo", median["gloo", kind]) for kind in ("ddp", "fsdp")]
    rows += [(f"all_reduce {args.mib} MiB", median["ringweave", "all_reduce"], "gloo", median["gloo", "all_reduce"]),
             (f"all_reduce {args.mib} MiB", median["ringweave", "all_reduce"], "numpy",
              median["numpy", "all_reduce"])]
    return {"rank": rank, "world": world, "rows": rows}


def report(result: dict, args) -> None:
    print(f"torch.distributed, {result['world']} ranks, MLP {args.layers} x {args.hidden}, batch {args.batch}, "
          f"median of {args.steps} steps / {args.iters} all_reduces")
    print(f"{'measure':<22} {'ringweave ms':>13} {'peer':>6} {'peer ms':>10} {'peer/ringweave':>15}")
    for name, ours, peer, theirs in result["rows"]:
        print(f"{name:<22} {ours * 1e3:>13.3f} {peer:>6} {theirs * 1e3:>10.3f} {theirs / ours:>15.2f}")
    if args.json:
        from bench.common import write_json
        write_json(args.json, {"args": vars(args), **result})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--hidden", type=int, default=1024, help="features per layer (default 1024)")
    p.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    p.add_argument("--batch", type=int, default=64, help="rows per rank and step (default 64)")
    p.add_argument("--steps", type=int, default=20, help="timed training steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps and all_reduces first (default 3)")
    p.add_argument("--mib", type=int, default=64, help="the all_reduce's float32 tensor, MiB (default 64)")
    p.add_argument("--iters", type=int, default=10, help="timed all_reduces (default 10)")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    p.add_argument("--timeout-s", type=float, default=600, help="stop the run after this long (default 600)")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "runtime.launch", "-n", str(args.n), "--max-time-s", str(args.timeout_s),
               __file__, *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, cwd=_ROOT)
    result = worker(args)
    if result["rank"] == 0:
        report(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
