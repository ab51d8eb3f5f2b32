"""Tensor parallelism (Megatron-LM): the conjugate f / g pairs, column- and row-parallel Linear,
attention with its heads split across the tp group, the MLP split column-then-row, and what acts on
the cut features between a column and a row layer (LayerNorm, dropout).

How it works (t ranks, Megatron-LM core/tensor_parallel/layers.py and mappings.py). Y = X A is split

    column-parallel  A = [A_1 ... A_t] by columns:  Y_i = X A_i      every rank needs all of X
    row-parallel     A = [A_1; ...; A_t] by rows,   X = [X_1 ... X_t]:  Y = sum_i X_i A_i

    f  copy_to_tp       forward: identity           backward: all_reduce(sum) of dX
    g  reduce_from_tp   forward: all_reduce(sum)    backward: identity

A column-parallel layer runs f on its input, a row-parallel layer g on its output; chained
column-then-row, the part between needs nothing but element-wise work on this rank's features
(GELU; dropout with the single-process mask's columns, `ColumnDropout`, `HeadDropout`) or a
LayerNorm whose row statistics are summed over the group (`SplitLayerNorm`: two all_reduces of
N numbers forward, one of 2N backward). Attention splits its heads (qkv cut along H, proj the
same heads' rows). The row-parallel bias, and LayerNorms after a g, are replicated: every tp rank
holds them whole and computes the same gradient. Each layer names how its parameters cut the
full ones (`tp_split(name)` -> Split, or None: replicated); trainer/parallel/gpt.py turns that
into index maps between a rank's flat buffer and the full model's. docs/design.md has the
communication count per block and the dropout streams.

What it is not: no sequence parallelism, no overlap of the tp all-reduce with the next matmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainer.nn.attention import attention_backward, attention_forward
from trainer.nn.gpt import MLP
from trainer.nn.layers import GELU, Container, Dropout, Layer, Linear, check_kernel
from trainer.parallel.tp_group import TPGroup, part

__all__ = ["Split", "copy_to_tp", "copy_to_tp_backward", "reduce_from_tp", "reduce_from_tp_backward",
           "ColumnParallelLinear", "RowParallelLinear", "HeadDropout", "ColumnDropout", "SplitLayerNorm",
           "ParallelSelfAttention", "ParallelMLP"]


@dataclass(frozen=True)
class Split:
    """How a local parameter cuts the full one: the full parameter reshaped to ``view``, elements
    [lo, hi) along ``axis``, read in C order. E.g. qkv's weight (C, 3C) on tp rank 1 of 2 with
    H = 4 heads: Split(view=(C, 3, 4, hs), axis=2, lo=2, hi=4)."""
    view: tuple[int, ...]
    axis: int
    lo: int
    hi: int


# ---- the conjugate pairs (mappings) ---------------------------------------------------


def copy_to_tp(x: np.ndarray, tp: TPGroup) -> np.ndarray:
    """f forward: identity (every rank holds the whole input)."""
    return x


def copy_to_tp_backward(dx: np.ndarray, tp: TPGroup) -> np.ndarray:
    """f backward: the input's gradient is the sum of every rank's partial one."""
    return tp.all_reduce(dx)


def reduce_from_tp(y: np.ndarray, tp: TPGroup) -> np.ndarray:
    """g forward: the output is the sum of every rank's partial one."""
    return tp.all_reduce(y)


def reduce_from_tp_backward(dy: np.ndarray, tp: TPGroup) -> np.ndarray:
    """g backward: identity (every rank's partial output had the whole gradient)."""
    return dy


# ---- linear layers ------------------------------------------------------------------------


class ColumnParallelLinear(Layer):
    """Y_i = f(X) A_i + b_i: this rank's columns of Linear(in, out).

    The output columns are cut as `out_view` along `out_axis` (default: plain columns); this
    rank holds part `rank` of `size` of that axis, e.g. out_view=(3, H, hs), out_axis=1 for
    the fused qkv. The output stays split (Megatron's gather_output=False).
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *, bias: bool = True,
                 init_std: float | None = None, out_view: tuple[int, ...] | None = None, out_axis: int = 0) -> None:
        self.out_view = tuple(out_view) if out_view is not None else (out_features,)
        if math.prod(self.out_view) != out_features:
            raise ValueError(f"out_view {self.out_view} must hold {out_features} features")
        self.out_axis, self.tp = out_axis, tp
        n = self.out_view[out_axis]
        if n < tp.size:
            raise ValueError(f"{n} columns (axis {out_axis} of {self.out_view}) cannot split over tp={tp.size}")
        self.lo, self.hi = part(n, tp.rank, tp.size)
        local = out_features // n * (self.hi - self.lo)
        self.linear = Linear(in_features, local, bias, init_std=init_std)
        self.in_features, self.out_features, self.bias = in_features, out_features, bias

    def param_shapes(self):
        return self.linear.param_shapes()

    def decay(self, name):
        return self.linear.decay(name)

    def tp_split(self, name: str) -> Split:
        if name == "weight":
            return Split((self.in_features, *self.out_view), 1 + self.out_axis, self.lo, self.hi)
        return Split(self.out_view, self.out_axis, self.lo, self.hi)

    def output_shape(self, shape):
        return self.linear.output_shape(shape)  # this rank's columns

    def forward(self, params, x, ctx):
        return self.linear.forward(params, copy_to_tp(x, self.tp), ctx)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        dx = self.linear.backward(params, cache, dout, grads, grads_zero=grads_zero)
        return copy_to_tp_backward(dx, self.tp)


class RowParallelLinear(Layer):
    """Y = g(sum_i X_i A_i) + b: this rank's rows of Linear(in, out); X arrives split (the
    output of a column-parallel layer), b is whole and added after the sum.

    forward:  y = all_reduce(x_i W_i) + b                 # x_i (N, in/t), W_i (in/t, out)
    backward: dW_i += x_i^T dy;  db += sum_n dy;  dx_i = dy W_i^T      (no communication)
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *, bias: bool = True,
                 init_std: float | None = None, in_lo: int | None = None, in_hi: int | None = None) -> None:
        self.tp = tp
        if in_features < tp.size:
            raise ValueError(f"{in_features} rows cannot split over tp={tp.size}")
        self.lo, self.hi = part(in_features, tp.rank, tp.size) if in_lo is None else (in_lo, in_hi)
        self.linear = Linear(self.hi - self.lo, out_features, bias, init_std=init_std)
        self.in_features, self.out_features, self.bias = in_features, out_features, bias

    def param_shapes(self):
        return self.linear.param_shapes()

    def decay(self, name):
        return self.linear.decay(name)

    def tp_split(self, name: str) -> Split | None:
        if name == "weight":
            return Split((self.in_features, self.out_features), 0, self.lo, self.hi)
        return None  # the bias: replicated

    def output_shape(self, shape):
        return (*shape[:-1], self.out_features)

    def forward(self, params, x, ctx):
        local = self.hi - self.lo
        x2 = x.reshape(-1, local)  # (N, in/t)
        y = reduce_from_tp(x2 @ params["weight"], self.tp)  # (N, out): the sum over ranks
        if self.bias:
            y += params["bias"]
        return y.reshape(*x.shape[:-1], self.out_features), (x2, x.shape)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        dout = reduce_from_tp_backward(dout, self.tp)
        return self.linear.backward(params, cache, dout, grads, grads_zero=grads_zero)


# ---- attention and MLP ------------------------------------------------------------------------


class HeadDropout(Dropout):
    """Dropout on (N, H_local, ...) attention probabilities with the single-process mask of heads
    [h0, h1) out of H: per row n, the generator skips to element ((offset + n) H + h0) * inner
    of the (N, H, ...) stream (Dropout's layout) and draws H_local * inner values."""

    def __init__(self, p: float, n_head: int, h0: int, h1: int) -> None:
        super().__init__(p)
        self.n_head, self.h0, self.h1 = n_head, h0, h1

    def mask(self, shape, dtype, ctx):
        N, local = shape[0], shape[1]
        if local != self.h1 - self.h0:
            raise ValueError(f"HeadDropout holds heads [{self.h0}, {self.h1}), got {local} in shape {shape}")
        inner = math.prod(shape[2:])
        row = self.n_head * inner  # elements per sample of the whole mask
        rng = ctx.rng(self.stream)
        u = np.empty(shape, np.float64)
        rng.bit_generator.advance(ctx.batch_offset * row + self.h0 * inner)  # to this rank's first element
        for n in range(N):
            u[n] = rng.random(shape[1:])
            rng.bit_generator.advance(row - local * inner)  # the other ranks' heads of this row
        return ((u >= self.p) / (1.0 - self.p)).astype(dtype)


class ColumnDropout(Dropout):
    """Dropout on features [lo, hi) of ``features`` (after a column-parallel layer) with the
    single-process mask's columns: the mask of the whole (..., features) input is drawn, as a tp = 1
    run draws it, and this rank's columns kept."""

    def __init__(self, p: float, features: int, lo: int, hi: int) -> None:
        super().__init__(p)
        self.features, self.lo, self.hi = features, lo, hi

    def mask(self, shape, dtype, ctx):
        if shape[-1] != self.hi - self.lo:
            raise ValueError(f"ColumnDropout holds features [{self.lo}, {self.hi}), got shape {shape}")
        whole = (*shape[:-1], self.features)
        return super().mask(whole, dtype, ctx)[..., self.lo : self.hi]


class SplitLayerNorm(Layer):
    """LayerNorm over features [lo, hi) of ``dim`` (after a column-parallel layer): this rank holds
    those features of the weight and bias; each row's statistics are sums over the tp group.

    forward:  mu = all_reduce(sum_c x_i) / C;  var = all_reduce(sum_c (x_i - mu)^2) / C      # (N,) each
              xhat_i = (x_i - mu) rstd,  y_i = xhat_i w_i + b_i,  rstd = 1 / sqrt(var + eps)
    backward: dw_i += sum_n dy_i xhat_i,  db_i += sum_n dy_i,  g_i = dy_i w_i
              [sum_c g, sum_c g xhat] all_reduced (2, N);  dx_i = rstd (g_i - mean g - xhat_i mean(g xhat))
    """

    def __init__(self, dim: int, tp: TPGroup, *, eps: float = 1e-5) -> None:
        if dim < tp.size:
            raise ValueError(f"a LayerNorm of {dim} features cannot split over tp={tp.size}")
        self.dim, self.eps, self.tp = dim, eps, tp
        self.lo, self.hi = part(dim, tp.rank, tp.size)

    def param_shapes(self):
        return [("weight", (self.hi - self.lo,)), ("bias", (self.hi - self.lo,))]

    def tp_split(self, name: str) -> Split:
        return Split((self.dim,), 0, self.lo, self.hi)

    def init(self, params, rng):
        params["weight"][...] = 1.0
        params["bias"][...] = 0.0

    def _sum(self, rows: np.ndarray) -> np.ndarray:
        """Row sums over every rank's features, in place (every rank of the group holds the same rows)."""
        return self.tp.all_reduce(rows) if rows.size else rows

    def forward(self, params, x, ctx):
        x2 = x.reshape(-1, self.hi - self.lo)  # (N, C_i)
        mu = self._sum(np.ascontiguousarray(x2.sum(axis=1))) / self.dim  # (N,)
        xc = x2 - mu[:, None]
        rstd = 1.0 / np.sqrt(self._sum(np.ascontiguousarray((xc * xc).sum(axis=1))) / self.dim + self.eps)
        xhat = xc * rstd[:, None]  # (N, C_i)
        return (xhat * params["weight"] + params["bias"]).reshape(x.shape), (xhat, rstd)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        xhat, rstd = cache
        d2 = dout.reshape(xhat.shape)  # (N, C_i)
        grads["weight"] += (d2 * xhat).sum(axis=0)
        grads["bias"] += d2.sum(axis=0)
        g = d2 * params["weight"]
        sums = self._sum(np.stack([g.sum(axis=1), (g * xhat).sum(axis=1)]))  # (2, N)
        dx = rstd[:, None] * (g - sums[0][:, None] / self.dim - xhat * (sums[1][:, None] / self.dim))
        return dx.reshape(dout.shape)


class ParallelSelfAttention(Container):
    """Causal self-attention over this rank's heads [h0, h1) (trainer/nn/attention.py's math).

    Children, as CausalSelfAttention's (same order, so the same dropout streams): qkv
    ColumnParallelLinear(C, 3C) cut by heads, proj RowParallelLinear(C, C) cut by the same
    heads' rows, attn_drop (HeadDropout), resid_drop (replicated).
    """

    def __init__(self, n_embd: int, n_head: int, tp: TPGroup, *, dropout: float = 0.0, bias: bool = True,
                 init_std: float | None = 0.02, proj_init_std: float | None = None, kernel: str = "fast") -> None:
        if n_head % tp.size:
            raise ValueError(f"n_head={n_head} heads do not split over tp={tp.size}: choose --tp dividing "
                             f"the heads")
        self.n_embd, self.n_head, self.head_size = n_embd, n_head, n_embd // n_head
        self.h0, self.h1 = part(n_head, tp.rank, tp.size)
        self.local_heads = self.h1 - self.h0
        self.kernel = check_kernel(kernel)
        hs = self.head_size
        self.attn_drop, self.resid_drop = HeadDropout(dropout, n_head, self.h0, self.h1), Dropout(dropout)
        self.children = [
            ("qkv", ColumnParallelLinear(n_embd, 3 * n_embd, tp, bias=bias, init_std=init_std,
                                         out_view=(3, n_head, hs), out_axis=1)),
            ("proj", RowParallelLinear(n_embd, n_embd, tp, bias=bias,
                                       init_std=init_std if proj_init_std is None else proj_init_std,
                                       in_lo=self.h0 * hs, in_hi=self.h1 * hs)),
            ("attn_drop", self.attn_drop),
            ("resid_drop", self.resid_drop),
        ]
        self._index()
        self.qkv, self.proj = self._by_name["qkv"], self._by_name["proj"]

    def forward(self, params, x, ctx):
        B, T, _ = x.shape
        Hl, hs = self.local_heads, self.head_size
        h, c_qkv = self.qkv.forward(self.sub(params, "qkv"), x, ctx)  # (B, T, 3 Hl hs)
        q, k, v = (h.reshape(B, T, 3, Hl, hs)[:, :, j].transpose(0, 2, 1, 3) for j in range(3))  # (B, Hl, T, hs)
        y, c_att = attention_forward(q, k, v, dropout=self.attn_drop, ctx=ctx, kernel=self.kernel)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, Hl * hs)  # merge this rank's heads (a copy)
        out, c_proj = self.proj.forward(self.sub(params, "proj"), y, ctx)  # (B, T, C), summed over ranks
        out, c_drop = self.resid_drop.forward({}, out, ctx)
        return out, (c_qkv, c_att, c_proj, c_drop)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        c_qkv, c_att, c_proj, c_drop = cache
        B, T, _ = dout.shape
        Hl, hs = self.local_heads, self.head_size
        d = self.resid_drop.backward({}, c_drop, dout, {})
        dy = self.proj.backward(self.sub(params, "proj"), c_proj, d, self.sub(grads, "proj"), grads_zero=grads_zero)
        dq, dk, dv = attention_backward(dy.reshape(B, T, Hl, hs).transpose(0, 2, 1, 3), c_att, kernel=self.kernel)
        dqkv = np.empty((B, T, 3, Hl, hs), dtype=dq.dtype)  # merge [dq | dk | dv]
        for j, d_part in enumerate((dq, dk, dv)):
            dqkv[:, :, j] = d_part.transpose(0, 2, 1, 3)
        return self.qkv.backward(self.sub(params, "qkv"), c_qkv, dqkv.reshape(B, T, 3 * Hl * hs),
                                 self.sub(grads, "qkv"), grads_zero=grads_zero)


class ParallelMLP(MLP):
    """The block's MLP split column-then-row: fc ColumnParallelLinear(C, 4C) -> GELU on this rank's
    columns -> proj RowParallelLinear(4C, C) over the same rows -> dropout (replicated).
    Forward and backward are MLP's (a loop over the children)."""

    def __init__(self, n_embd: int, hidden: int, tp: TPGroup, *, gelu: str = "tanh", dropout: float = 0.0,
                 bias: bool = True, init_std: float | None = 0.02, proj_init_std: float | None = None,
                 kernel: str = "fast") -> None:
        lo, hi = part(hidden, tp.rank, tp.size)
        self.children = [
            ("fc", ColumnParallelLinear(n_embd, hidden, tp, bias=bias, init_std=init_std)),
            ("act", GELU(gelu, kernel=kernel)),
            ("proj", RowParallelLinear(hidden, n_embd, tp, bias=bias, in_lo=lo, in_hi=hi,
                                       init_std=init_std if proj_init_std is None else proj_init_std)),
            ("drop", Dropout(dropout)),
        ]
        self._index()
