"""Throughput of the reduction kernels and codecs: Numba against the NumPy reference.

    python bench/kernels.py                 # 16M float32 elements (64 MB), best of 3
    python bench/kernels.py --n 1000000 --repeat 5
    python bench/kernels.py --offload       # also: when to move a reduction off the event loop
    python bench/kernels.py --device cuda --repeat 5   # numba.cuda kernels vs CuPy (bench/kernels_device.py)

Each variant is validated against the NumPy reference (bit-exact, NaN == NaN)
before it is timed; the first call (compile /
cache load) is not timed. Figures are the best of ``--repeat`` runs, single
thread, on whatever the machine is doing at the time.

Napkin math: a reduction reads dst and src and writes dst, 3 x nbytes of
memory traffic; a codec is counted by the float32 bytes it consumes (encode) or
produces (decode). "peak" is this machine's single-thread in-place
``np.add(a, b, out=a)`` on float32 (3 x nbytes), the ceiling for a memory-bound
kernel here. Reductions also print the fastest NumPy peer, the in-place ufunc
(``np.add(dst, src, out=dst)`` ...), because the reference is written to be
obvious (it copies through the compute dtype), not fast.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from collectives import kernels  # noqa: E402
from collectives.compress import cpu as ccpu  # noqa: E402
from collectives.compress import get_codec  # noqa: E402
from collectives.compress import reference as cref  # noqa: E402
from collectives.kernels import cpu, reference  # noqa: E402
from collectives.kernels.reference import bits_equal  # noqa: E402


def best_of(fn, repeat: int) -> float:
    fn()  # warm-up: compile or load from cache, fault pages in; not timed
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def line(label: str, nbytes: int, t_ref: float, t_fast: float, peak: float) -> None:
    gbs_ref, gbs_fast = nbytes / t_ref / 1e9, nbytes / t_fast / 1e9
    print(f"{label:<28} numpy {gbs_ref:7.2f} GB/s   numba {gbs_fast:7.2f} GB/s   "
          f"ratio {t_ref / t_fast:6.2f}x   numba at {100 * gbs_fast / peak:4.0f}% of peak")  # fmt: skip


def bench_reductions(n: int, repeat: int, peak: float) -> None:
    print(f"\n== reductions, dst = dst <op> src, {n} elements; GB/s of 3 x nbytes traffic")
    rng = np.random.default_rng(0)
    cases = [(np.float32, op) for op in reference.OPS] + [
        (dt, "sum") for dt in (np.float16, reference.BFLOAT16, np.float64, np.int8, np.int32, np.int64, np.uint8)
    ]
    for dtype, op in cases:
        dtype = np.dtype(dtype)
        with np.errstate(all="ignore"):
            if dtype.kind in "iu":
                src = rng.integers(0, 100, n).astype(dtype)
            else:
                src = rng.standard_normal(n).astype(dtype)
        dst0 = src[::-1].copy()
        want = reference.reduce_into(dst0.copy(), src, op)
        assert bits_equal(cpu.reduce_into(dst0.copy(), src, op), want), (dtype, op)
        dst = dst0.copy()  # results drift over repeats; the cost does not
        t_ref = best_of(lambda: reference.reduce_into(dst, src, op), repeat)
        t_fast = best_of(lambda: cpu.reduce_into(dst, src, op), repeat)
        line(f"{op} {dtype}", 3 * dst.nbytes, t_ref, t_fast, peak)
        ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        t_peer = best_of(lambda: ufunc(dst, src, out=dst), repeat)
        print(f"{'':<28} peer np.{ufunc.__name__}(out=dst) {3 * dst.nbytes / t_peer / 1e9:7.2f} GB/s"
              f"   numba vs peer {t_peer / t_fast:6.2f}x")


def bench_codecs(n: int, repeat: int, peak: float) -> None:
    print(f"\n== codecs on {n} float32 ({4 * n >> 20} MiB); GB/s of float32 bytes in (encode) / out (decode)")
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n).astype(np.float32)
    for name, kw in [("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"stochastic": True}), ("topk", {})]:
        ref, fast = get_codec(name, backend="numpy", **kw), get_codec(name, backend="numba", **kw)
        label = name + (" stochastic" if kw else "")
        want = ref.encode(x)
        got = fast.encode(x)
        fast.calls = ref.calls = 0  # same stochastic stream for the check
        assert all(bits_equal(w, g) for w, g in zip(ref.encode(x), fast.encode(x))), name
        assert bits_equal(ref.decode(want, n), fast.decode(got, n)), name
        line(f"{label} encode", 4 * n, best_of(lambda: ref.encode(x), repeat),
             best_of(lambda: fast.encode(x), repeat), peak)  # fmt: skip
        line(f"{label} decode", 4 * n, best_of(lambda: ref.decode(want, n), repeat),
             best_of(lambda: fast.decode(got, n), repeat), peak)  # fmt: skip
    # the same kernels writing into a preallocated output: what a fresh output's first-touch page faults
    # cost (the codecs return new arrays, as the NumPy reference does; THP here is "madvise", so 4 KiB pages)
    h16, out32 = np.empty(n, np.uint16), np.empty(n, np.float32)
    bf16 = get_codec("bf16", backend="numpy")
    line("bf16 encode into out", 4 * n, best_of(lambda: bf16.encode(x), repeat),
         best_of(lambda: ccpu.cast_encode(x, h16, True), repeat), peak)  # fmt: skip
    i8 = get_codec("int8", backend="numpy")
    q, sc = i8.encode(x)
    line("int8 decode into out", 4 * n, best_of(lambda: i8.decode((q, sc), n), repeat),
         best_of(lambda: ccpu.int8_decode(q, sc, i8.block, out32), repeat), peak)  # fmt: skip
    # gather-decode-sum: decode_add into a preallocated float32 accumulator (the collective's hot path;
    # plain decode above also pays page faults for its fresh 64 MiB output, on both sides)
    acc = np.zeros_like(x)
    for name in ("int8", "topk"):
        ref, fast = get_codec(name, backend="numpy"), get_codec(name, backend="numba")
        payload = fast.encode(x)
        a_ref, a_fast = np.zeros_like(x), np.zeros_like(x)
        ref.decode_add(payload, a_ref)
        fast.decode_add(payload, a_fast)
        assert bits_equal(a_ref, a_fast), name
        line(f"{name} decode_add", 4 * n, best_of(lambda: ref.decode_add(payload, acc), repeat),
             best_of(lambda: fast.decode_add(payload, acc), repeat), peak)  # fmt: skip
    # error feedback: y = x + e (compensate) and the int8 residual e = y - decode (fused in Numba)
    e, y = np.zeros_like(x), np.empty_like(x)
    t_ref = best_of(lambda: cref.ef_compensate(x, e, y), repeat)
    t_fast = best_of(lambda: ccpu.ef_compensate(x, e, y), repeat)
    line("error feedback compensate", 4 * n, t_ref, t_fast, peak)
    codec = get_codec("int8")
    payload = codec.encode(x)
    t_ref = best_of(lambda: np.subtract(x, codec.decode(payload, n), out=e), repeat)
    t_fast = best_of(lambda: codec.residual_into(x, payload, e), repeat)
    line("int8 residual (fused)", 4 * n, t_ref, t_fast, peak)
    # PowerSGD: the Gram-Schmidt is the part with a Numba kernel; matmuls are BLAS either way
    rows = max(4, n // 1024)
    p = rng.standard_normal((rows, 4)).astype(np.float32)
    want = cref.orthogonalize(p.copy())
    got = p.copy()
    ccpu.orthogonalize(got)
    assert bits_equal(got, want)
    t_ref = best_of(lambda: cref.orthogonalize(p.copy()), repeat)
    t_fast = best_of(lambda: ccpu.orthogonalize(p.copy()), repeat)
    line(f"powersgd orthogonalize {rows}x4", p.nbytes, t_ref, t_fast, peak)
    m = rng.standard_normal((rows, 1024)).astype(np.float32)
    t_all = best_of(lambda: get_codec("powersgd", backend="numba").encode(m), repeat)
    print(f"{'powersgd encode (all phases)':<28} {m.nbytes / t_all / 1e9:7.2f} GB/s for a {rows}x1024 matrix, rank 4")


def bench_offload(repeat: int) -> None:
    print("\n== off-thread reduction: asyncio.to_thread hand-off vs kernel time (float32 sum)")

    async def handoff() -> float:
        await asyncio.to_thread(lambda: None)  # start the pool
        times = []
        for _ in range(200):
            start = time.perf_counter()
            await asyncio.to_thread(lambda: None)
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    overhead = asyncio.run(handoff())
    print(f"hand-off round trip (median of 200): {overhead * 1e6:.0f} us")
    for nbytes in [1 << k for k in range(14, 26, 2)]:
        a = np.ones(nbytes // 4, np.float32)
        t = best_of(lambda: cpu.reduce_into(a, a, "sum"), repeat)
        print(f"{nbytes >> 10:>8} KiB  kernel {t * 1e6:9.1f} us   hand-off / kernel = {overhead / t:6.2f}")
    print("(the algorithms reduce on the calling thread: bench/results/kernels.md#worker-thread-hand-off)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16 << 20, help="elements, e.g. 16777216")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--offload", action="store_true", help="also measure the off-thread threshold")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the numba.cuda kernels against CuPy / torch (bench/kernels_device.py)")
    args = parser.parse_args()
    if args.device == "cuda":
        from bench.device import gpu_problem
        problem = gpu_problem()
        if problem:
            raise SystemExit(f"--device cuda: {problem}")
        from bench import kernels_device
        kernels_device.run(args.n, args.repeat)
        return
    t0 = time.perf_counter()
    warm = cpu.warmup()
    print(f"kernels.cpu.warmup(): {warm:.2f} s (from the on-disk cache if it is warm); "
          f"dispatch default: {kernels.choose_backend(np.empty(1))}")
    src = np.ones(args.n, np.float32)
    dst = np.ones_like(src)
    t_add = best_of(lambda: np.add(dst, src, out=dst), args.repeat)
    peak = 3 * src.nbytes / t_add / 1e9
    print(f"peak (np.add in place, float32, 3 x nbytes): {peak:.2f} GB/s")
    bench_reductions(args.n, args.repeat, peak)
    bench_codecs(args.n, args.repeat, peak)
    if args.offload:
        bench_offload(args.repeat)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
