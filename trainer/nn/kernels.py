"""Numba kernels for the layers where NumPy makes extra passes over memory.

What it is: the fast path of LayerNorm, GELU (tanh and erf), the causal softmax of
attention, the embedding's scatter-add and the softmax cross-entropy. Each kernel
computes what the NumPy reference in the layer's file computes (trainer/nn/layers.py,
attention.py, embedding.py, loss.py: the readable versions stay there, beside the
math), in one or two passes instead of NumPy's five to eight temporaries. They agree
with the reference to rounding (float64: relative 1e-12 in tests/trainer), not bit
for bit: a loop sums in another order than NumPy's pairwise sums.

    layernorm_forward(x (N, C), w, b, eps, out, mean (N,), rstd (N,))
    layernorm_backward(dout, x, mean, rstd, w, dx, dw (C,) float64 +=, db (C,) float64 +=)
    gelu_forward(x, out, exact) / gelu_backward(x, dout, dx, exact)      # flat, exact: erf form
    causal_softmax_forward(s (G, Tq, Tk), scale, p)    # query i sees keys j <= i + Tk - Tq
    causal_softmax_backward(p, dp, scale, ds)          # ds = scale * p (dp - sum_j p dp)
    embedding_backward(idx (N,), dout (N, C), dw (V, C))                 # dw[idx[n]] += dout[n]
    cross_entropy_forward_backward(logits (N, K), y (N,), weight, dlogits) -> sum_n l_n

Statistics (means, variances, sums of the softmax) are accumulated in float64 whatever
the array dtype; results are stored in the arrays' dtype. Every kernel is
`@njit(nogil=True)`: the strategies run the model on a thread beside the event loop,
and a kernel that holds no GIL lets the loop move collectives meanwhile.

Dispatch: a layer calls these when `use_numba(*arrays)` holds (float32 / float64, C
contiguous where the kernel needs it), else its NumPy reference (float16 activations,
odd strides). Compiled lazily per dtype on first use and cached on disk (cache=True).

What it is not: no threading inside a kernel (several ranks already share the cores),
no matmuls (NumPy's BLAS does those).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = [
    "use_numba", "layernorm_forward", "layernorm_backward", "gelu_forward", "gelu_backward",
    "causal_softmax_forward", "causal_softmax_backward", "embedding_backward",
    "cross_entropy_forward_backward",
]

_JIT = dict(nogil=True, cache=True)
_FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_GELU_C = math.sqrt(2.0 / math.pi)  # 0.7978845608...
_GELU_A = 0.044715
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def use_numba(*arrays: np.ndarray) -> bool:
    """True when every array is float32 / float64 and C-contiguous (what the kernels take)."""
    return all(a.dtype in _FAST_DTYPES and a.flags.c_contiguous for a in arrays)


# ---- LayerNorm ------------------------------------------------------------------


@njit(**_JIT)
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


@njit(**_JIT)
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
def gelu_forward(x, out, exact):  # pragma: no cover - compiled
    """exact: 0.5 x (1 + erf(x / sqrt 2)); else 0.5 x (1 + tanh(c (x + a x^3)))."""
    for k in range(x.shape[0]):
        v = x[k]
        if exact:
            out[k] = 0.5 * v * (1.0 + math.erf(v * _INV_SQRT2))
        else:
            out[k] = 0.5 * v * (1.0 + math.tanh(_GELU_C * (v + _GELU_A * v * v * v)))


@njit(**_JIT)
def gelu_backward(x, dout, dx, exact):  # pragma: no cover - compiled
    """dx = dout * d gelu / dx (the formulas of trainer.nn.layers.GELU)."""
    for k in range(x.shape[0]):
        v = x[k]
        if exact:
            local = 0.5 * (1.0 + math.erf(v * _INV_SQRT2)) + v * _INV_SQRT_2PI * math.exp(-0.5 * v * v)
        else:
            t = math.tanh(_GELU_C * (v + _GELU_A * v * v * v))
            local = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * v * v)
        dx[k] = dout[k] * local


# ---- causal softmax (attention) -------------------------------------------------


@njit(**_JIT)
def causal_softmax_forward(s, scale, p):  # pragma: no cover - compiled
    """p[g, i, j] = softmax_j(scale s[g, i, :i + off + 1]) for j <= i + off, else 0; off = Tk - Tq."""
    G, Tq, Tk = s.shape
    off = Tk - Tq
    for g in range(G):
        for i in range(Tq):
            last = i + off  # the last key this query sees
            m = -np.inf
            for j in range(last + 1):
                v = scale * s[g, i, j]
                if v > m:
                    m = v
            total = 0.0
            for j in range(last + 1):
                e = math.exp(scale * s[g, i, j] - m)
                p[g, i, j] = e
                total += e
            inv = 1.0 / total
            for j in range(last + 1):
                p[g, i, j] *= inv
            for j in range(last + 1, Tk):
                p[g, i, j] = 0.0


@njit(**_JIT)
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
def cross_entropy_forward_backward(logits, y, weight, dlogits):  # pragma: no cover - compiled
    """Returns sum_n -log softmax(logits_n)[y_n] (unweighted) and writes
    dlogits_n = weight * (softmax(logits_n) - onehot(y_n)), in one pass of reads per row."""
    N, K = logits.shape
    total = 0.0
    for n in range(N):
        m = -np.inf
        for k in range(K):
            if logits[n, k] > m:
                m = logits[n, k]
        s = 0.0
        for k in range(K):
            e = math.exp(logits[n, k] - m)
            dlogits[n, k] = e
            s += e
        inv = weight / s
        for k in range(K):
            dlogits[n, k] *= inv
        t = y[n]
        dlogits[n, t] -= weight
        total += math.log(s) - (logits[n, t] - m)
    return total
