"""Embeddings with hand-written backward: token lookup and learned positions.

What it is: two layers of the layer protocol (trainer/nn/layers.py).

    Embedding(V, C)            forward:  y[b, t] = W[idx[b, t]]            # idx (B, T) ints, y (B, T, C)
                               backward: dW[idx[b, t]] += dy[b, t]         # a scatter-add: repeated
                                                                           # tokens add up
    PositionalEmbedding(T, C)  forward:  y[b, t] = x[b, t] + P[t]          # x, y (B, T', C), T' <= T
                               backward: dP[t] += sum_b dy[b, t];  dx = dy

The scatter-add runs as `np.add.at` (kernel="reference") or a Numba loop
(kernel="fast", trainer/nn/layer_kernels.py; bench/results/trainer.md#the-layer-kernels-reference-fused-numba-shipped).
Neither layer is weight-decayed (nanoGPT's and DeepSpeed's groups). Init: N(0, 0.02^2), as GPT-2.

What it is not: no padding index, no max-norm, no sparse gradients (the gradient is
the dense (V, C) buffer of the unit, which the strategies reduce as any other).
"""

from __future__ import annotations

import numpy as np

from trainer.nn import layer_kernels
from trainer.nn.layers import Layer, check_kernel

__all__ = ["Embedding", "PositionalEmbedding"]


class Embedding(Layer):
    """Token embedding W (num_embeddings, dim); see the module docstring."""

    def __init__(self, num_embeddings: int, dim: int, *, init_std: float = 0.02, kernel: str = "fast") -> None:
        if num_embeddings <= 0 or dim <= 0:
            raise ValueError(f"Embedding sizes must be > 0, got num_embeddings={num_embeddings} dim={dim}")
        self.num_embeddings, self.dim, self.init_std = num_embeddings, dim, init_std
        self.kernel = check_kernel(kernel)

    def param_shapes(self):
        return [("weight", (self.num_embeddings, self.dim))]

    def decay(self, name):
        return False

    def init(self, params, rng):
        params["weight"][...] = rng.normal(0.0, self.init_std, size=params["weight"].shape)

    def output_shape(self, shape):
        return (*shape, self.dim)

    def check_indices(self, idx: np.ndarray) -> None:
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"Embedding input must be integer token ids, got dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_embeddings):
            raise ValueError(f"token ids must be in [0, {self.num_embeddings}), got range [{idx.min()}, {idx.max()}]")

    def forward(self, params, idx, ctx):
        self.check_indices(idx)
        return params["weight"][idx], idx  # (B, T, C): fancy indexing copies the rows

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        idx = cache.reshape(-1)  # (N,)
        d2 = dout.reshape(-1, self.dim)  # (N, C)
        dw = grads["weight"]  # (V, C)
        if self.kernel == "fast" and layer_kernels.use_fast(d2, dw) and d2.dtype == dw.dtype:
            layer_kernels.embedding_backward(np.ascontiguousarray(idx, dtype=np.int64), d2, dw)
        else:
            np.add.at(dw, idx, d2)
        return None  # no gradient flows into integer ids


class PositionalEmbedding(Layer):
    """Learned positional embedding P (max_positions, dim), added to the input; see the module docstring."""

    def __init__(self, max_positions: int, dim: int, *, init_std: float = 0.02) -> None:
        if max_positions <= 0 or dim <= 0:
            raise ValueError(f"PositionalEmbedding sizes must be > 0, got max_positions={max_positions} dim={dim}")
        self.max_positions, self.dim, self.init_std = max_positions, dim, init_std

    def param_shapes(self):
        return [("weight", (self.max_positions, self.dim))]

    def decay(self, name):
        return False

    def init(self, params, rng):
        params["weight"][...] = rng.normal(0.0, self.init_std, size=params["weight"].shape)

    def forward(self, params, x, ctx, start: int = 0):
        """x (B, T', C) gets positions start .. start + T' - 1 (start > 0: decoding with a KV cache)."""
        T = x.shape[-2]
        if start + T > self.max_positions:
            raise ValueError(f"sequence of {start + T} positions is longer than the block size {self.max_positions}")
        return x + params["weight"][start : start + T], (T, start)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        T, start = cache
        lead = tuple(range(dout.ndim - 2))
        grads["weight"][start : start + T] += dout.sum(axis=lead) if lead else dout  # (T, C)
        return dout
