"""Device collectives against torch.distributed's Gloo on CUDA tensors, in the same processes:
what ``python bench/collectives.py --device cuda`` runs on every rank.

    python bench/collectives.py -n 4 --device cuda --compare gloo --ops all_reduce --sizes 4K,1M,16M,64M

Variants per (op, size), each validated against a closed form before it is timed (rank r
contributes ``r + i % 3``; sums are exact in every dtype):

* ``rw``: ringweave on numba device arrays, its default path (collectives/device.py);
* ``rw-cupy``: the same call on CuPy arrays (``__cuda_array_interface__``), when CuPy imports;
* ``rw-fold`` / ``rw-staged``: the pipelined path (segments, fold on the device), or the whole array
  staged through the host collectives (``RINGWEAVE_DEVICE_HOST_REDUCE_KIB`` 0 / 2**30), to place the
  threshold;
* ``gloo``: ``torch.distributed`` Gloo on torch CUDA tensors (``--compare gloo``).

A timed call is ``barrier; t0; call; device synchronize; t1; barrier`` (every library's result is
complete on the device at t1); time = median over iterations of the slowest rank. ``x gloo`` =
Gloo's time / ringweave's (> 1: ringweave faster). The pinned pool's statistics close the run.

Refuses to run without a GPU; under NUMBA_ENABLE_CUDASIM=1 it runs (tiny sizes, no peers) to
exercise its own logic, and says that its times mean nothing (tests/bench/test_bench_device.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time

import numpy as np

from bench.common import fmt_bytes, parse_sizes, stats, write_json

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def gpu_problem() -> str | None:
    """Why the device benchmarks cannot measure here (None: a GPU is usable, or the simulator was asked for)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return None
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no CUDA driver on this machine ({e}); --device cuda measures a real GPU"
    try:
        from numba import cuda
    except ImportError as e:
        return f"numba-cuda is not installed ({e}); pip install -e .[cuda]"
    if not cuda.is_available():
        return "numba.cuda finds no usable GPU (cuda.detect() says why)"
    return None


def closed_form(op: str, n: int, world: int, rank: int) -> np.ndarray:
    """What rank ``rank`` holds after ``op`` of ``n`` elements (the size column) in float64."""
    k = np.arange(n) % 3
    if op == "all_reduce":
        return world * (world - 1) / 2 + world * k
    if op == "reduce_scatter":
        m = n // world
        return (world * (world - 1) / 2 + world * k)[rank * m:(rank + 1) * m]
    if op == "all_gather":
        m = n // world
        return np.concatenate([r + np.arange(m) % 3 for r in range(world)])
    return k.astype(np.float64)  # broadcast from rank 0


def inputs(op: str, n: int, world: int, rank: int, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """(x, out) host arrays of one rank: x = rank + i % 3 (broadcast: rank 0's, others zero)."""
    m = n // world if op in ("all_gather", "reduce_scatter") else n
    count = m if op == "all_gather" else n
    x = (rank + np.arange(count) % 3).astype(dtype)
    if op == "broadcast" and rank != 0:
        x[:] = 0
    out = np.zeros(n if op == "all_gather" else m, dtype) if op in ("all_gather", "reduce_scatter") else None
    return x, out


class Ringweave:
    label = "rw"

    def __init__(self, make, to_host, sync, env=None, label="rw"):
        self.make, self.to_host, self.sync, self.env, self.label = make, to_host, sync, env or {}, label

    async def barrier(self):
        from collectives import api
        await api.barrier()

    def caller(self, op, x, out):
        import collectives as C
        calls = {"all_reduce": lambda: C.all_reduce(x), "broadcast": lambda: C.broadcast(x, src=0),
                 "all_gather": lambda: C.all_gather(out, x), "reduce_scatter": lambda: C.reduce_scatter(out, x)}

        async def call():
            saved = {k: os.environ.get(k) for k in self.env}
            os.environ.update(self.env)
            try:
                await calls[op]()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return call


class GlooCuda:
    label = "gloo"

    def __init__(self, torch, dist):
        self.torch, self.dist = torch, dist
        self.make = lambda h: torch.from_numpy(h).cuda()
        self.to_host = lambda t: t.cpu().numpy()
        self.sync = torch.cuda.synchronize

    async def barrier(self):
        self.dist.barrier()

    def caller(self, op, x, out):
        d = self.dist
        calls = {"all_reduce": lambda: d.all_reduce(x), "broadcast": lambda: d.broadcast(x, src=0),
                 "all_gather": lambda: d.all_gather_into_tensor(out, x),
                 "reduce_scatter": lambda: d.reduce_scatter_tensor(out, x)}

        async def call():
            calls[op]()
        return call


def variants(args, gloo) -> list:
    from numba import cuda

    from collectives.kernels.cuda import SIMULATOR
    sync = cuda.synchronize
    out = [Ringweave(cuda.to_device, lambda d: d.copy_to_host(), sync)]
    if "all_reduce" in args.ops:
        out.append(Ringweave(cuda.to_device, lambda d: d.copy_to_host(), sync,
                             {"RINGWEAVE_DEVICE_HOST_REDUCE_KIB": "0"}, "rw-fold"))
        out.append(Ringweave(cuda.to_device, lambda d: d.copy_to_host(), sync,
                             {"RINGWEAVE_DEVICE_HOST_REDUCE_KIB": str(1 << 30)}, "rw-staged"))
    if not SIMULATOR:
        try:
            import cupy
            out.append(Ringweave(cupy.asarray, cupy.asnumpy, sync, label="rw-cupy"))
        except ImportError:
            print("# CuPy not importable: no rw-cupy column (pip install cupy-cuda13x)")
    if gloo is not None:
        out.append(gloo)
    return out


async def join_gloo(rt):
    import torch
    import torch.distributed as dist

    from collectives import api
    key = "bench/device/gloo_port"
    if rt.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, rt.world_size, is_master=True, wait_for_workers=False)
        await rt.store.set(key, str(store.port).encode())
    else:
        store = dist.TCPStore("127.0.0.1", int(await rt.store.get(key)), rt.world_size, is_master=False)
    await api.barrier()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("gloo", store=store, rank=rt.rank, world_size=rt.world_size)
    return GlooCuda(torch, dist)


async def timed(v, call) -> float:
    await v.barrier()
    t0 = time.perf_counter()
    await call()
    v.sync()
    t1 = time.perf_counter()
    await v.barrier()
    return t1 - t0


async def rank_main(args) -> None:
    import runtime
    from collectives import api
    from collectives.device_pool import PINNED
    from collectives.kernels.cuda import SIMULATOR
    rt = await runtime.init()
    n_ranks, rank = rt.world_size, rt.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    gloo = await join_gloo(rt) if "gloo" in args.compare and not SIMULATOR else None
    vs = variants(args, gloo)
    dtype = np.dtype(np.float32)
    say(f"# ringweave bench/collectives --device cuda: {n_ranks} ranks, float32, {args.iters} iters "
        f"(+{args.warmup} warm-up); time = median of the slowest rank; x<peer> = peer / rw (>1: rw faster)")
    if SIMULATOR:
        say("# NUMBA_ENABLE_CUDASIM=1: the CUDA simulator; these times measure nothing, only the logic runs")
    say(f"{'op':<15}{'size':>10}" + "".join(f"{v.label + '(us)':>14}" for v in vs)
        + ("   x gloo" if gloo else ""))
    rows = []
    for op in args.ops:
        for size in args.sizes:
            n = max(n_ranks, size // dtype.itemsize) // n_ranks * n_ranks
            times = np.full((len(vs), args.iters), np.nan)
            for i, v in enumerate(vs):
                hx, hout = inputs(op, n, n_ranks, rank, dtype)
                x, out = v.make(hx), (v.make(hout) if hout is not None else None)
                call = v.caller(op, x, out)
                try:
                    await call()  # validation, not timed
                except RuntimeError as e:  # e.g. a Gloo build without this collective for CUDA tensors
                    if v.label != "gloo":
                        raise
                    say(f"# gloo {op}: {str(e).splitlines()[0][:120]}")
                    continue
                v.sync()
                got = v.to_host(out if out is not None else x)
                want = closed_form(op, n, n_ranks, rank)
                if not np.array_equal(got.astype(np.float64), want):
                    bad = int(np.flatnonzero(got.astype(np.float64) != want)[0])
                    raise SystemExit(f"{op} {size} B {v.label} rank {rank}: wrong at {bad}: {got[bad]} != {want[bad]}")
                for it in range(args.warmup + args.iters):
                    if op == "all_reduce":  # in place: restart from the input (not timed)
                        x = v.make(hx)
                        call = v.caller(op, x, out)
                    t = await timed(v, call)
                    if it >= args.warmup:
                        times[i, it - args.warmup] = t
            await api.all_reduce(times, op="max")
            med = [stats(t)["median_s"] if not np.isnan(t).any() else float("nan") for t in times]
            row = {"op": op, "bytes": n * dtype.itemsize, **{v.label: m * 1e6 for v, m in zip(vs, med)}}
            line = f"{op:<15}{fmt_bytes(n * dtype.itemsize):>10}" + "".join(f"{m * 1e6:14.1f}" for m in med)
            if gloo:
                row["ratio_gloo"] = med[-1] / med[0]
                line += f"{row['ratio_gloo']:9.2f}"
            say(line)
            rows.append(row)
    st = PINNED.statistics()
    say(f"# pinned pool (rank 0): kept {fmt_bytes(st.kept_bytes)} of {fmt_bytes(st.limit_bytes)}, "
        f"{st.allocations} allocations, {st.reuses} reuses, {st.evictions} evictions, {st.over_limit} over the limit")
    if rank == 0 and args.json:
        write_json(args.json, {"meta": {"world": n_ranks, "simulator": SIMULATOR, "iters": args.iters},
                               "rows": rows, "pool": st.__dict__})
        print(f"# json: {args.json}")
    if gloo:
        await api.barrier()
        gloo.dist.destroy_process_group()
    await runtime.shutdown()


def run(args) -> None:
    args.ops = [op for op in args.ops if op in OPS] or ["all_reduce"]
    if isinstance(args.sizes, str):
        args.sizes = parse_sizes(args.sizes)
    asyncio.run(rank_main(args))
