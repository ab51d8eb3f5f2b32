"""Causal self-attention with its backward written by hand (llm.c's attention_forward / _backward).

What it is: `CausalSelfAttention`, a container of the layer protocol, and the attention core as
two plain functions, so that a tensor-parallel variant (heads split across ranks) reuses the core
and swaps the two projections. Shapes: B batch, T sequence, C = n_embd, H = n_head, hs = C / H.

    forward                                                   # x (B, T, C)
        qkv = x W_qkv + b_qkv                                  # (B, T, 3C): [q | k | v], heads inside each
        q, k, v = split_heads(qkv)                             # (B, H, T, hs) each, views (no copy)
        p = softmax(q k^T / sqrt(hs) with s[i, j] = -inf for j > i)   # causal; the row max is subtracted
        y = dropout(p) v                                       # (B, H, T, hs)
        out = dropout(merge_heads(y) W_proj + b_proj)          # (B, T, C); residual dropout
    backward                                                  # dout (B, T, C)
        dy = proj^T(dropout^T(dout)), split into heads         # (B, H, T, hs)
        dv = pd^T dy,  dpd = dy v^T,  dp = dropout^T(dpd)
        ds = p (dp - sum_j p dp) / sqrt(hs)                    # softmax backward, 0 above the diagonal
        dq = ds k,  dk = ds^T q;  dx = qkv^T(merge [dq | dk | dv])

The softmax and its backward run as Numba passes (trainer/nn/layer_kernels.py) with kernel="fast", or
as the NumPy reference below with kernel="reference". Decoding: `forward_cached(params, x_new,
kv)` appends the new positions' keys and values to a `KVCache` and attends over everything
cached, so each generated token costs one position.

What it is not: no grouped-query attention, no rotary embeddings, no flash (tiled) attention:
the (B, H, T, T) scores are materialised (a few MB at the block sizes a CPU trains).
"""

from __future__ import annotations

import math

import numpy as np

from trainer.nn import layer_kernels
from trainer.nn.layers import Container, Dropout, Linear, check_kernel

__all__ = ["CausalSelfAttention", "KVCache", "attention_forward", "attention_backward", "causal_softmax",
           "causal_softmax_backward"]


# ---- the core: reference and dispatch ----------------------------------------------


def causal_softmax(s: np.ndarray, scale: float, kernel: str = "fast") -> np.ndarray:
    """p = softmax over the last axis of scale * s, query i seeing keys j <= i + Tk - Tq.  s (..., Tq, Tk)."""
    Tq, Tk = s.shape[-2:]
    if kernel == "fast" and layer_kernels.use_fast(s):
        return layer_kernels.causal_softmax_forward(s.reshape(-1, Tq, Tk), scale).reshape(s.shape)
    z = scale * s  # (..., Tq, Tk)
    z[..., np.triu(np.ones((Tq, Tk), dtype=bool), k=Tk - Tq + 1)] = -np.inf  # the future
    z -= z.max(axis=-1, keepdims=True)  # stability: every row sees at least its own key
    e = np.exp(z)  # exp(-inf) == 0 above the diagonal
    return e / e.sum(axis=-1, keepdims=True)


def causal_softmax_backward(p: np.ndarray, dp: np.ndarray, scale: float, kernel: str = "fast") -> np.ndarray:
    """ds = scale p (dp - sum_j p dp): the gradient with respect to s (zero above the diagonal, where p is)."""
    Tq, Tk = p.shape[-2:]
    if kernel == "fast" and layer_kernels.use_fast(p, dp) and p.dtype == dp.dtype:
        ds = np.empty_like(p)
        layer_kernels.causal_softmax_backward(p.reshape(-1, Tq, Tk), dp.reshape(-1, Tq, Tk), scale, ds.reshape(-1, Tq, Tk))
        return ds
    return scale * p * (dp - (p * dp).sum(axis=-1, keepdims=True))


def attention_forward(q, k, v, *, dropout: Dropout | None = None, ctx=None, kernel: str = "fast"):
    """y = dropout(causal_softmax(q k^T / sqrt(hs))) v.  q (..., Tq, hs), k, v (..., Tk, hs).

    Returns (y (..., Tq, hs), cache)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = np.matmul(q, k.swapaxes(-1, -2))  # (..., Tq, Tk)
    p = causal_softmax(s, scale, kernel)
    del s
    pd, mask = p, None
    if dropout is not None and ctx is not None:
        pd, mask = dropout.forward({}, p, ctx)
    y = np.matmul(pd, v)  # (..., Tq, hs)
    return y, (q, k, v, p, mask, scale)


def attention_backward(dy, cache, *, kernel: str = "fast"):
    """(dq, dk, dv) of attention_forward, each the shape of its input."""
    q, k, v, p, mask, scale = cache
    pd = p if mask is None else p * mask
    dv = np.matmul(pd.swapaxes(-1, -2), dy)  # (..., Tk, hs)
    dp = np.matmul(dy, v.swapaxes(-1, -2))  # (..., Tq, Tk)
    if mask is not None:
        dp *= mask  # dropout backward
    ds = causal_softmax_backward(p, dp, scale, kernel)  # (..., Tq, Tk)
    dq = np.matmul(ds, k)  # (..., Tq, hs)
    dk = np.matmul(ds.swapaxes(-1, -2), q)  # (..., Tk, hs)
    return dq, dk, dv


# ---- the layer ------------------------------------------------------------------------


class KVCache:
    """Keys and values of the positions decoded so far, per attention layer: (B, H, T_max, hs) each."""

    def __init__(self, batch: int, n_head: int, max_positions: int, head_size: int, dtype) -> None:
        self.k = np.zeros((batch, n_head, max_positions, head_size), dtype=dtype)
        self.v = np.zeros_like(self.k)
        self.length = 0  # positions filled, e.g. 17

    def append(self, k_new: np.ndarray, v_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stores (B, H, T', hs) new keys and values; returns every cached one, (B, H, length, hs) views."""
        end = self.length + k_new.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions, {end} asked")
        self.k[:, :, self.length : end] = k_new
        self.v[:, :, self.length : end] = v_new
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class CausalSelfAttention(Container):
    """Multi-head causal self-attention with a fused QKV projection (the module docstring).

    Children: qkv Linear(C, 3C), proj Linear(C, C), attn_drop, resid_drop (Dropout).
    `proj_init_std` lets GPT-2 scale the residual projection's init by 1/sqrt(2 n_layer).
    """

    def __init__(self, n_embd: int, n_head: int, *, dropout: float = 0.0, bias: bool = True,
                 init_std: float | None = 0.02, proj_init_std: float | None = None, kernel: str = "fast") -> None:
        if n_head <= 0 or n_embd <= 0 or n_embd % n_head:
            raise ValueError(f"n_embd must be a positive multiple of n_head, got n_embd={n_embd} n_head={n_head}")
        self.n_embd, self.n_head, self.head_size = n_embd, n_head, n_embd // n_head
        self.kernel = check_kernel(kernel)
        self.attn_drop, self.resid_drop = Dropout(dropout), Dropout(dropout)
        self.children = [
            ("qkv", Linear(n_embd, 3 * n_embd, bias, init_std=init_std)),
            ("proj", Linear(n_embd, n_embd, bias, init_std=init_std if proj_init_std is None else proj_init_std)),
            ("attn_drop", self.attn_drop),
            ("resid_drop", self.resid_drop),
        ]
        self._index()
        self.qkv, self.proj = self._by_name["qkv"], self._by_name["proj"]

    def split_heads(self, qkv: np.ndarray):
        """(B, T, 3C) -> q, k, v (B, H, T, hs), views into qkv."""
        B, T, _ = qkv.shape
        parts = qkv.reshape(B, T, 3, self.n_head, self.head_size)
        return (parts[:, :, j].transpose(0, 2, 1, 3) for j in range(3))

    def forward(self, params, x, ctx):
        B, T, C = x.shape
        h, c_qkv = self.qkv.forward(self.sub(params, "qkv"), x, ctx)  # (B, T, 3C)
        q, k, v = self.split_heads(h)
        y, c_att = attention_forward(q, k, v, dropout=self.attn_drop, ctx=ctx, kernel=self.kernel)  # (B, H, T, hs)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # merge heads (a copy)
        out, c_proj = self.proj.forward(self.sub(params, "proj"), y, ctx)  # (B, T, C)
        out, c_drop = self.resid_drop.forward({}, out, ctx)
        return out, (c_qkv, c_att, c_proj, c_drop)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        c_qkv, c_att, c_proj, c_drop = cache
        B, T, C = dout.shape
        d = self.resid_drop.backward({}, c_drop, dout, {})
        dy = self.proj.backward(self.sub(params, "proj"), c_proj, d, self.sub(grads, "proj"), grads_zero=grads_zero)
        dyh = dy.reshape(B, T, self.n_head, self.head_size).transpose(0, 2, 1, 3)  # (B, H, T, hs), a view
        dq, dk, dv = attention_backward(dyh, c_att, kernel=self.kernel)
        dqkv = np.empty((B, T, 3, self.n_head, self.head_size), dtype=dq.dtype)  # merge [dq | dk | dv]
        for j, d_part in enumerate((dq, dk, dv)):
            dqkv[:, :, j] = d_part.transpose(0, 2, 1, 3)
        return self.qkv.backward(self.sub(params, "qkv"), c_qkv, dqkv.reshape(B, T, 3 * C),
                                 self.sub(grads, "qkv"), grads_zero=grads_zero)

    def forward_cached(self, params, x, kv: KVCache, ctx):
        """Evaluation with a KV cache: x (B, T', C) are the next T' positions; returns (B, T', C)."""
        B, T, C = x.shape
        h, _ = self.qkv.forward(self.sub(params, "qkv"), x, ctx)
        q, k, v = self.split_heads(h)
        k_all, v_all = kv.append(k, v)  # (B, H, length, hs)
        y, _ = attention_forward(q, k_all, v_all, kernel=self.kernel)  # query i sees keys <= its position
        out, _ = self.proj.forward(self.sub(params, "proj"), y.transpose(0, 2, 1, 3).reshape(B, T, C), ctx)
        return out
