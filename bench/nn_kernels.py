"""The trainer's layer kernels: the NumPy reference, a fused Numba variant, and the shipped fast path.

    python bench/nn_kernels.py                 # the default GPT's shapes, float32, one thread
    python bench/nn_kernels.py --batch 16      # a rank's share at 4 ranks

For each operation the script validates every variant against the reference
(float32, relative 1e-4), then times it (best of 7 rounds of 10 calls) and prints
milliseconds and the speed-up over the reference, all in one run:

- softmax: the causal softmax of attention over (B H, T, T) scores;
  v1 = one fused Numba loop (scalar exp), v2 = trainer/nn/layer_kernels.py (Numba shift, NumPy's
  in-place SIMD exp, Numba normalisation: what ships);
- gelu (tanh) over (B T, 4C): v1 = one fused Numba loop (scalar tanh), v2 = what ships
  (Numba polynomial, in-place np.tanh, Numba output);
- layernorm forward and backward over (B T, C): v2 = the Numba kernels that ship;
- cross-entropy forward+backward over (B T, 256): v1 = fused Numba (scalar exp), v2 = what ships;
- embedding scatter-add of (B T, C) rows into (256, C): reference np.add.at, v2 = the Numba loop.

Why these variants: this Numba has no vector math library (numba.config.USING_SVML is
False), so exp and tanh inside a Numba loop run one element at a time; NumPy's are SIMD.

What it is not: no matmuls (BLAS), no multi-rank figures (bench/trainer.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from trainer.nn import attention, layer_kernels  # noqa: E402
from trainer.nn.layers import GELU, LayerNorm  # noqa: E402
from trainer.nn.loss import cross_entropy_backward, cross_entropy_forward  # noqa: E402

C_GELU, A_GELU = layer_kernels.GELU_C, layer_kernels.GELU_A


@njit(nogil=True, cache=True)
def softmax_fused(s, scale, p):  # pragma: no cover - v1: one loop per row, scalar exp
    G, T, _ = s.shape
    for g in range(G):
        for i in range(T):
            m = -np.inf
            for j in range(i + 1):
                m = max(m, scale * s[g, i, j])
            total = 0.0
            for j in range(i + 1):
                e = math.exp(scale * s[g, i, j] - m)
                p[g, i, j] = e
                total += e
            for j in range(i + 1):
                p[g, i, j] /= total
            for j in range(i + 1, T):
                p[g, i, j] = 0.0


@njit(nogil=True, cache=True)
def gelu_fused(x, out):  # pragma: no cover - v1: scalar tanh
    for k in range(x.shape[0]):
        v = x[k]
        out[k] = 0.5 * v * (1.0 + math.tanh(C_GELU * (v + A_GELU * v * v * v)))


@njit(nogil=True, cache=True)
def ce_fused(logits, y, weight, d):  # pragma: no cover - v1: one pass per row, scalar exp
    N, K = logits.shape
    total = 0.0
    for n in range(N):
        m = -np.inf
        for k in range(K):
            m = max(m, logits[n, k])
        s = 0.0
        for k in range(K):
            e = math.exp(logits[n, k] - m)
            d[n, k] = e
            s += e
        for k in range(K):
            d[n, k] *= weight / s
        d[n, y[n]] -= weight
        total += math.log(s) - (logits[n, y[n]] - m)
    return total


def best_ms(fn, rounds: int = 7, calls: int = 10) -> float:
    fn()
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e3 * best


def check(name: str, got, want, rtol: float = 1e-4) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.allclose(got, want, rtol=rtol, atol=rtol * max(1e-30, float(np.abs(want).max()))):
        raise SystemExit(f"{name}: does not match the reference (max abs diff {np.abs(got - want).max():.3g})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64, help="windows (default 64: the training job's global batch)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    args = p.parse_args(argv)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
    B, T, C, H = args.batch, args.block_size, args.n_embd, args.n_head
    rng = np.random.default_rng(0)
    f32 = np.float32
    rows = []

    # softmax
    s = rng.standard_normal((B * H, T, T)).astype(f32)
    scale = 1.0 / math.sqrt(C // H)
    ref = attention.causal_softmax(s, scale, kernel="reference")
    p1 = np.empty_like(s)
    softmax_fused(s, scale, p1)
    check("softmax v1", p1, ref)
    check("softmax v2", layer_kernels.causal_softmax_forward(s, scale), ref)
    rows.append(("softmax fwd", (B * H, T, T), best_ms(lambda: attention.causal_softmax(s, scale, "reference")),
                 best_ms(lambda: softmax_fused(s, scale, p1)),
                 best_ms(lambda: layer_kernels.causal_softmax_forward(s, scale))))

    # gelu
    x = rng.standard_normal((B * T, 4 * C)).astype(f32)
    ref_layer, fast_layer = GELU("tanh", kernel="reference"), GELU("tanh", kernel="fast")
    out1 = np.empty(x.size, f32)
    gelu_fused(x.reshape(-1), out1)
    want = ref_layer.forward({}, x, None)[0]
    check("gelu v1", out1.reshape(x.shape), want)
    check("gelu v2", fast_layer.forward({}, x, None)[0], want)
    rows.append(("gelu tanh fwd", x.shape, best_ms(lambda: ref_layer.forward({}, x, None)),
                 best_ms(lambda: gelu_fused(x.reshape(-1), out1)), best_ms(lambda: fast_layer.forward({}, x, None))))
    d = rng.standard_normal(x.shape).astype(f32)
    c_ref, c_fast = ref_layer.forward({}, x, None)[1], fast_layer.forward({}, x, None)[1]
    check("gelu bwd v2", fast_layer.backward({}, c_fast, d, {}), ref_layer.backward({}, c_ref, d, {}))
    rows.append(("gelu tanh bwd", x.shape, best_ms(lambda: ref_layer.backward({}, c_ref, d, {})), None,
                 best_ms(lambda: fast_layer.backward({}, c_fast, d, {}))))

    # layernorm
    h = rng.standard_normal((B * T, C)).astype(f32)
    params = {"weight": rng.standard_normal(C).astype(f32), "bias": rng.standard_normal(C).astype(f32)}
    ln_ref, ln_fast = LayerNorm(C, kernel="reference"), LayerNorm(C, kernel="fast")
    check("layernorm v2", ln_fast.forward(params, h, None)[0], ln_ref.forward(params, h, None)[0])
    rows.append(("layernorm fwd", h.shape, best_ms(lambda: ln_ref.forward(params, h, None)), None,
                 best_ms(lambda: ln_fast.forward(params, h, None))))
    dh = rng.standard_normal(h.shape).astype(f32)
    cr, cf = ln_ref.forward(params, h, None)[1], ln_fast.forward(params, h, None)[1]

    def grads():
        return {"weight": np.zeros(C, f32), "bias": np.zeros(C, f32)}

    check("layernorm bwd v2", ln_fast.backward(params, cf, dh, grads()), ln_ref.backward(params, cr, dh, grads()))
    rows.append(("layernorm bwd", h.shape, best_ms(lambda: ln_ref.backward(params, cr, dh, grads())), None,
                 best_ms(lambda: ln_fast.backward(params, cf, dh, grads()))))

    # cross-entropy
    logits = rng.standard_normal((B * T, 256)).astype(f32)
    y = rng.integers(0, 256, B * T)
    w = 1.0 / (B * T)

    def ce_ref():
        loss, cache = cross_entropy_forward(logits, y, B * T)
        return loss, cross_entropy_backward(cache)

    d1 = np.empty_like(logits)
    ce_fused(logits, y, w, d1)
    check("cross-entropy v1", d1, ce_ref()[1])
    check("cross-entropy v2", layer_kernels.cross_entropy_forward_backward(logits, y, w)[1], ce_ref()[1])
    rows.append(("cross-entropy fwd+bwd", logits.shape, best_ms(ce_ref), best_ms(lambda: ce_fused(logits, y, w, d1)),
                 best_ms(lambda: layer_kernels.cross_entropy_forward_backward(logits, y, w))))

    # embedding scatter-add
    idx = rng.integers(0, 256, B * T)
    dout = rng.standard_normal((B * T, C)).astype(f32)
    wa, wb = np.zeros((256, C), f32), np.zeros((256, C), f32)
    np.add.at(wa, idx, dout)
    layer_kernels.embedding_backward(idx, dout, wb)
    check("embedding v2", wb, wa)
    rows.append(("embedding scatter-add", dout.shape, best_ms(lambda: np.add.at(wa, idx, dout)), None,
                 best_ms(lambda: layer_kernels.embedding_backward(idx, dout, wb))))

    print(f"# float32, 1 thread, B={B} T={T} C={C} H={H}; Numba {numba.__version__} (SVML "
          f"{'on' if numba.config.USING_SVML else 'off'}), NumPy {np.__version__}; load {os.getloadavg()[0]:.1f}; "
          f"every variant validated against the reference first")
    print(f"{'operation':<24} {'shape':>16} {'reference ms':>13} {'v1 fused ms':>12} {'v2 shipped ms':>14} "
          f"{'v2 speed-up':>11}")
    for name, shape, ref_ms, v1_ms, v2_ms in rows:
        v1 = f"{v1_ms:12.3f}" if v1_ms is not None else f"{'-':>12}"
        print(f"{name:<24} {str(tuple(shape)):>16} {ref_ms:13.3f} {v1} {v2_ms:14.3f} {ref_ms / v2_ms:10.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
