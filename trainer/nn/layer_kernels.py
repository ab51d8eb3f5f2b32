"""The fast path of the layers where NumPy makes extra passes: Numba loops around NumPy's SIMD exp and tanh.

What it is: the kernels behind `kernel="fast"` (the default) of LayerNorm, GELU, the causal
softmax of attention, the embedding's scatter-add and the softmax cross-entropy. Each computes
what the NumPy reference in the layer's file computes (trainer/nn/layers.py, attention.py,
embedding.py, loss.py keep the readable versions, run with `kernel="reference"`), with fewer
passes over memory and no temporaries; they agree with it to rounding (float64: relative 1e-12),
not bit for bit, since a loop sums in another order than NumPy's pairwise sums. Every
transcendental runs in NumPy, in place, and the arithmetic passes around it in Numba
(bench/results/trainer.md#the-layer-kernels-reference-fused-numba-shipped says why).

    if use_fast(x, w, b):                                   # float32 / float64, C contiguous
        layernorm_forward(x, w, b, eps, out, mean, rstd)   # x (N, C); mean, rstd (N,)
    out, t = gelu_tanh_forward(x)                           # t kept for gelu_tanh_backward

Every Numba kernel is `@njit(nogil=True)`, so the event loop moves collectives while the model
computes on its thread; compiled lazily per dtype and cached in the user's cache folder
(collectives/kernels/jitcache.py). The signatures and the summation order: docs/design.md, "The
trainer: units and strategies".

What it is not: no threading inside a kernel (several ranks already share the cores), no matmuls
(NumPy's BLAS does those), no float16 (the layers take their reference path for it).
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import njit

from collectives.kernels import jitcache

jitcache.serve(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # before the first @njit: the disk
# cache goes to the user's cache folder, not into the package (collectives/kernels/jitcache.py)

__all__ = [
    "use_fast", "layernorm_forward", "layernorm_backward", "gelu_tanh_forward", "gelu_tanh_backward",
    "gelu_erf_forward", "gelu_erf_backward", "causal_softmax_forward", "causal_softmax_backward",
    "embedding_backward", "cross_entropy_forward_backward",
]

_JIT = dict(nogil=True, cache=True)
# sums may be reordered (and multiply-adds fused) so that LLVM vectorises them
# (bench/results/trainer.md#the-layer-kernels-reference-fused-numba-shipped); no flag that assumes
# finite values, so inf and NaN still propagate (loss scaling looks for them)
_JIT_SUMS = dict(nogil=True, cache=True, fastmath={"reassoc", "contract"})
_FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
GELU_C = math.sqrt(2.0 / math.pi)  # 0.7978845608...
GELU_A = 0.044715
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def use_fast(*arrays: np.ndarray) -> bool:
    """True when every array is float32 / float64 and C-contiguous (what the kernels take)."""
    return all(a.dtype in _FAST_DTYPES and a.flags.c_contiguous for a in arrays)


# ---- row maximum ----------------------------------------------------------------


@njit(inline="always", cache=True)
def _row_max(a, n, lo, hi):  # pragma: no cover - compiled
    """max of a[n, lo:hi] (hi > lo), as four interleaved running maxima (they vectorise; one does
    not). A NaN never wins a comparison here; the exp pass that follows still turns it into NaN."""
    m0 = a[n, lo]
    m1, m2, m3 = m0, m0, m0
    k = lo
    while k + 4 <= hi:
        v0, v1, v2, v3 = a[n, k], a[n, k + 1], a[n, k + 2], a[n, k + 3]
        m0 = v0 if v0 > m0 else m0
        m1 = v1 if v1 > m1 else m1
        m2 = v2 if v2 > m2 else m2
        m3 = v3 if v3 > m3 else m3
        k += 4
    while k < hi:
        v0 = a[n, k]
        m0 = v0 if v0 > m0 else m0
        k += 1
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    return m2 if m2 > m0 else m0


# ---- LayerNorm ------------------------------------------------------------------


@njit(**_JIT_SUMS)
def layernorm_forward(x, w, b, eps, out, mean, rstd):  # pragma: no cover - compiled
    """Per row n: mean, rstd = 1 / sqrt(var + eps), out = (x - mean) rstd w + b."""
    N, C = x.shape
    for n in range(N):
        s = 0.0
        for c in range(C):
            s += x[n, c]
        m = s / C
        v = 0.0
        for c in range(C):
            d = x[n, c] - m
            v += d * d
        r = 1.0 / math.sqrt(v / C + eps)
        mean[n] = m
        rstd[n] = r
        for c in range(C):
            out[n, c] = (x[n, c] - m) * r * w[c] + b[c]


@njit(**_JIT_SUMS)
def layernorm_backward(dout, x, mean, rstd, w, dx, dw, db):  # pragma: no cover - compiled
    """dx = rstd (g - mean_c g - xhat mean_c(g xhat)) with g = dout w; dw += sum_n dout xhat,
    db += sum_n dout (dw, db float64)."""
    N, C = x.shape
    for n in range(N):
        m, r = mean[n], rstd[n]
        g_sum = 0.0
        gx_sum = 0.0
        for c in range(C):
            xhat = (x[n, c] - m) * r
            g = dout[n, c] * w[c]
            g_sum += g
            gx_sum += g * xhat
            dw[c] += dout[n, c] * xhat
            db[c] += dout[n, c]
        g_mean = g_sum / C
        gx_mean = gx_sum / C
        for c in range(C):
            xhat = (x[n, c] - m) * r
            dx[n, c] = r * (dout[n, c] * w[c] - g_mean - xhat * gx_mean)


# ---- GELU -----------------------------------------------------------------------


@njit(**_JIT)
def _gelu_tanh_inner(x, u):  # pragma: no cover - compiled
    """u = c (x + a x^3), flat."""
    for k in range(x.shape[0]):
        v = x[k]
        u[k] = GELU_C * (v + GELU_A * v * v * v)


@njit(**_JIT)
def _gelu_out(x, t, out):  # pragma: no cover - compiled
    """out = 0.5 x (1 + t), flat (t: tanh of the inner, or erf(x / sqrt 2))."""
    for k in range(x.shape[0]):
        out[k] = 0.5 * x[k] * (1.0 + t[k])


@njit(**_JIT)
def _gelu_tanh_backward(x, t, dout, dx):  # pragma: no cover - compiled
    """dx = dout (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)), flat."""
    for k in range(x.shape[0]):
        v, tk = x[k], t[k]
        dx[k] = dout[k] * (0.5 * (1.0 + tk) + 0.5 * v * (1.0 - tk * tk) * GELU_C * (1.0 + 3.0 * GELU_A * v * v))


def gelu_tanh_forward(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(0.5 x (1 + t), t) with t = tanh(c (x + a x^3)): Numba, np.tanh in place, Numba."""
    flat = x.reshape(-1)
    t = np.empty_like(flat)
    _gelu_tanh_inner(flat, t)
    np.tanh(t, out=t)
    out = np.empty_like(flat)
    _gelu_out(flat, t, out)
    return out.reshape(x.shape), t.reshape(x.shape)


def gelu_tanh_backward(x: np.ndarray, t: np.ndarray, dout: np.ndarray) -> np.ndarray:
    dout = np.ascontiguousarray(dout, dtype=x.dtype)
    dx = np.empty_like(dout)
    _gelu_tanh_backward(x.reshape(-1), t.reshape(-1), dout.reshape(-1), dx.reshape(-1))
    return dx


@njit(**_JIT)
def _erf_half(x, out):  # pragma: no cover - compiled
    """out = erf(x / sqrt 2), flat (libm's erf, one element at a time: NumPy has no erf)."""
    for k in range(x.shape[0]):
        out[k] = math.erf(x[k] * _INV_SQRT2)


@njit(**_JIT)
def _gelu_erf_backward(x, e, dout, dx):  # pragma: no cover - compiled
    """dx = dout (Phi(x) + x phi(x)), with e = erf(x / sqrt 2), e2 = exp(-x^2 / 2) given in dx."""
    for k in range(x.shape[0]):
        dx[k] = dout[k] * (0.5 * (1.0 + e[k]) + x[k] * _INV_SQRT_2PI * dx[k])


def gelu_erf_forward(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(0.5 x (1 + erf(x / sqrt 2)), erf(x / sqrt 2))."""
    flat = x.reshape(-1)
    e = np.empty_like(flat)
    _erf_half(flat, e)
    out = np.empty_like(flat)
    _gelu_out(flat, e, out)
    return out.reshape(x.shape), e.reshape(x.shape)


def gelu_erf_backward(x: np.ndarray, e: np.ndarray, dout: np.ndarray) -> np.ndarray:
    flat = x.reshape(-1)
    dx = flat * flat  # exp(-x^2 / 2), in place
    dx *= -0.5
    np.exp(dx, out=dx)
    _gelu_erf_backward(flat, e.reshape(-1), np.ascontiguousarray(dout, dtype=x.dtype).reshape(-1), dx)
    return dx.reshape(x.shape)


# ---- causal softmax (attention) -------------------------------------------------


@njit(**_JIT)
def _softmax_shift(s, scale, z):  # pragma: no cover - compiled
    """z[g, i, j] = scale (s - max_{j' <= last} s) for j <= last = i + Tk - Tq, else -inf (scale > 0)."""
    G, Tq, Tk = s.shape
    off = Tk - Tq
    for g in range(G):
        sg, zg = s[g], z[g]
        for i in range(Tq):
            last = i + off
            m = _row_max(sg, i, 0, last + 1)
            for j in range(last + 1):
                zg[i, j] = scale * (sg[i, j] - m)
            for j in range(last + 1, Tk):
                zg[i, j] = -np.inf


@njit(**_JIT_SUMS)
def _softmax_normalize(e):  # pragma: no cover - compiled
    """e[g, i, :] /= sum over the visible keys (the rest is exp(-inf) = 0 already)."""
    G, Tq, Tk = e.shape
    off = Tk - Tq
    for g in range(G):
        for i in range(Tq):
            last = i + off
            total = 0.0
            for j in range(last + 1):
                total += e[g, i, j]
            inv = 1.0 / total
            for j in range(last + 1):
                e[g, i, j] *= inv


def causal_softmax_forward(s: np.ndarray, scale: float) -> np.ndarray:
    """p = causal softmax of scale * s over the last axis, s (G, Tq, Tk): shift, np.exp in place, normalise."""
    p = np.empty_like(s)
    _softmax_shift(s, scale, p)
    np.exp(p, out=p)
    _softmax_normalize(p)
    return p


@njit(**_JIT_SUMS)
def causal_softmax_backward(p, dp, scale, ds):  # pragma: no cover - compiled
    """ds[g, i, j] = scale p (dp - sum_k p dp) over the visible keys, 0 above the diagonal."""
    G, Tq, Tk = p.shape
    off = Tk - Tq
    for g in range(G):
        for i in range(Tq):
            last = i + off
            dot = 0.0
            for j in range(last + 1):
                dot += p[g, i, j] * dp[g, i, j]
            for j in range(last + 1):
                ds[g, i, j] = scale * p[g, i, j] * (dp[g, i, j] - dot)
            for j in range(last + 1, Tk):
                ds[g, i, j] = 0.0


# ---- embedding --------------------------------------------------------------------


@njit(**_JIT)
def embedding_backward(idx, dout, dw):  # pragma: no cover - compiled
    """dw[idx[n], :] += dout[n, :] for n in order (repeated tokens add up)."""
    N, C = dout.shape
    for n in range(N):
        row = idx[n]
        for c in range(C):
            dw[row, c] += dout[n, c]


# ---- softmax cross-entropy ---------------------------------------------------------


@njit(**_JIT)
def _ce_shift(logits, z, maxes):  # pragma: no cover - compiled
    """z = logits - max per row; maxes (N,) float64."""
    N, K = logits.shape
    for n in range(N):
        m = _row_max(logits, n, 0, K)
        maxes[n] = m
        for k in range(K):
            z[n, k] = logits[n, k] - m


@njit(**_JIT_SUMS)
def _ce_finish(logits, y, maxes, e, weight):  # pragma: no cover - compiled
    """e = exp(z) in, weight (softmax - onehot) out; returns sum_n (log sum_k e - z[y_n])."""
    N, K = e.shape
    total = 0.0
    for n in range(N):
        s = 0.0
        for k in range(K):
            s += e[n, k]
        t = y[n]
        total += math.log(s) - (logits[n, t] - maxes[n])
        inv = weight / s
        for k in range(K):
            e[n, k] *= inv
        e[n, t] -= weight
    return total


def cross_entropy_forward_backward(logits: np.ndarray, y: np.ndarray, weight: float) -> tuple[float, np.ndarray]:
    """(sum_n -log softmax(logits_n)[y_n], weight (softmax - onehot)): shift, np.exp in place, finish."""
    d = np.empty_like(logits)  # (N, K)
    maxes = np.empty(len(logits))  # (N,)
    _ce_shift(logits, d, maxes)
    np.exp(d, out=d)
    total = _ce_finish(logits, np.ascontiguousarray(y, dtype=np.int64), maxes, d, weight)
    return float(total), d
