"""Device kernels against CuPy (and torch) in the same run: what ``python bench/kernels.py --device cuda`` runs.

    python bench/kernels.py --device cuda                 # 16M float32 elements (64 MB), best of 5

Every variant is validated against the NumPy reference (bit-exact, NaN == NaN) before it is timed;
a timed call is ``t0; call; cuda.synchronize(); t1`` (our functions synchronize already), best of
``--repeat``. GB/s: reductions count 3 x nbytes of traffic, codecs the float32 bytes in (encode) or
out (decode); "peak" is a device-to-device copy of the same bytes (2 x nbytes). Peers: CuPy's
in-place ufuncs (``cupy.add(a, b, out=a)``, i.e. ``a += b``), its float16 cast, and
``torch.topk`` of |x| where torch has CUDA. Goals: ``reduce_into`` >= 0.8x CuPy's in-place
add, top-k encode >= 100 GB/s at 16M elements.

Refuses to run without a GPU (bench/device.gpu_problem); under NUMBA_ENABLE_CUDASIM=1 it runs with
whatever ``--n`` is given (use a few hundred) to exercise itself, and its times mean nothing.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from numba import cuda

from collectives.compress import cuda as ccuda
from collectives.compress import get_codec
from collectives.compress import reference as cref
from collectives.kernels import cuda as kcuda
from collectives.kernels import reference
from collectives.kernels.reference import bits_equal


def best_of(fn, repeat: int) -> float:
    if not kcuda.SIMULATOR:  # the simulator has nothing to warm up (and each call costs it seconds)
        fn()  # warm-up: compile, allocate
        cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def line(label: str, nbytes: int, t: float, peak: float, peer: tuple[str, float] | None = None) -> str:
    s = f"{label:<30} {nbytes / t / 1e9:9.1f} GB/s  {100 * nbytes / t / 1e9 / peak:4.0f}% of peak"
    if peer is not None:
        name, tp = peer
        s += f"   {name} {nbytes / tp / 1e9:9.1f} GB/s   ours / {name} = {tp / t:5.2f}x"
    print(s)
    return s


def _peers():
    cupy = torch = None
    if not kcuda.SIMULATOR:
        try:
            import cupy
        except ImportError:
            print("# CuPy not importable: no CuPy column (pip install cupy-cuda13x)")
        try:
            import torch
            if not torch.cuda.is_available():
                torch = None
        except ImportError:
            pass
    return cupy, torch


def sample(dtype, n, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 100, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def device(host):
    if host.dtype == reference.BFLOAT16:
        return kcuda.as_bfloat16(cuda.to_device(host.view(np.uint16)))
    return cuda.to_device(host)


def to_host(d):
    return d.bits.copy_to_host().view(d.dtype) if isinstance(d, kcuda.Bits16) else d.copy_to_host()


def run(n: int, repeat: int) -> None:
    cupy, torch = _peers()
    if kcuda.SIMULATOR:
        print("# NUMBA_ENABLE_CUDASIM=1: the CUDA simulator; these figures measure nothing")
        # Its block manager polls the simulated threads in a loop that keeps the GIL until the
        # interpreter takes it (every 5 ms by default), while they wait for it at each barrier.
        sys.setswitchinterval(1e-4)
    a, b = cuda.to_device(np.ones(n, np.float32)), cuda.device_array(n, np.float32)
    peak = 2 * 4 * n / best_of(lambda: b.copy_to_device(a), repeat) / 1e9
    print(f"peak (device-to-device copy, 2 x {4 * n >> 20} MiB): {peak:.1f} GB/s")

    print(f"\n== reductions, dst = dst <op> src, {n} elements; GB/s of 3 x nbytes")
    cases = [(np.float32, op) for op in reference.OPS] + [
        (dt, "sum") for dt in (np.float16, reference.BFLOAT16, np.float64, np.int8, np.int32, np.int64, np.uint8)]
    for dtype, op in cases:
        dtype = np.dtype(dtype)
        src, dst0 = sample(dtype, n, 1), sample(dtype, n, 2)
        want = reference.reduce_into(dst0.copy(), src, op)
        d, s = device(dst0), device(src)
        kcuda.reduce_into(d, s, op)
        assert bits_equal(to_host(d), want), (op, dtype)
        t = best_of(lambda: kcuda.reduce_into(d, s, op), repeat)
        peer = None
        if cupy is not None and dtype != reference.BFLOAT16:
            ufunc = {"sum": cupy.add, "prod": cupy.multiply, "min": cupy.minimum, "max": cupy.maximum}[op]
            ca, cb = cupy.asarray(dst0), cupy.asarray(src)
            peer = ("cupy", best_of(lambda: ufunc(ca, cb, out=ca), repeat))
        line(f"reduce_into {op} {dtype}", 3 * n * dtype.itemsize, t, peak, peer)

    print(f"\n== codecs on {n} float32; GB/s of float32 bytes in (encode) / out (decode)")
    x = sample(np.float32, n, 3)
    xd = cuda.to_device(x)
    def words(w):
        return w.view(np.uint16) if w.dtype.kind == "V" or w.dtype == np.float16 else w

    for name, kw in [("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"stochastic": True}), ("topk", {})]:
        ref, dev = get_codec(name, backend="numpy", **kw), get_codec(name, **kw)
        want, got = ref.encode(x), dev.encode(xd)
        assert all(bits_equal(words(w), g.copy_to_host()) for w, g in zip(want, got)), name
        assert bits_equal(dev.decode(got, n).copy_to_host(), ref.decode(want, n)), name
        label = name + (" stochastic" if kw else "")
        peer = None
        if name == "fp16" and cupy is not None:
            cx = cupy.asarray(x)
            peer = ("cupy astype", best_of(lambda: cx.astype(cupy.float16), repeat))
        if name == "topk" and torch is not None:
            tx, k = torch.from_numpy(x).cuda(), len(want[0])
            peer = ("torch.topk", best_of(lambda: torch.topk(tx.abs(), k, sorted=False), repeat))
        line(f"{label} encode", 4 * n, best_of(lambda: dev.encode(xd), repeat), peak, peer)
        line(f"{label} decode", 4 * n, best_of(lambda: dev.decode(got, n), repeat), peak)
    acc = ccuda.zeros(n)
    for name in ("int8", "topk"):
        codec = get_codec(name)
        payload = codec.encode(xd)
        line(f"{name} decode_add", 4 * n, best_of(lambda: codec.decode_add(payload, acc), repeat), peak)
    codec = get_codec("int8")
    q, sc = codec.encode(xd)
    err = ccuda.zeros(n)
    line("int8 residual (fused)", 4 * n, best_of(lambda: ccuda.int8_residual(xd, q, sc, codec.block, err), repeat),
         peak)  # fmt: skip
    k = max(1, n // 100)
    v, i = ccuda.topk_encode(xd, k)
    wv, wi = cref.topk_encode(x, k)
    assert np.array_equal(i.copy_to_host(), wi) and bits_equal(v.copy_to_host(), wv)
