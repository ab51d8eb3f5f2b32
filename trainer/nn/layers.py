"""Layers with hand-written backward passes: Linear, ReLU, GELU, LayerNorm, Dropout, Sequential.

What it is: each layer is a stateless description (shapes, hyper-parameters)
with `forward` and `backward` side by side and the math above them. Parameters
are NOT owned by the layer: they arrive as a dict of arrays (views into a unit's
flat buffer, see `trainer.nn.unit`), and so do the gradients.

The layer protocol (every class below follows it):

    param_shapes() -> list[(name, shape)]          # size table, in buffer order
    init(params, rng) -> None                      # fill float64 views in place
    forward(params, x, ctx) -> (out, cache)        # ctx: trainer.nn.Context
    backward(params, cache, dout, grads, *, grads_zero=False) -> dx
                                                   # ACCUMULATES (+=) into grads
    bind(stream) -> None                           # names the layer's RNG stream

`ctx` is an argument of every forward (not only Dropout's) so that a container
can call its children without knowing which of them are random. `backward`
accumulates into `grads` instead of returning fresh arrays, so gradient
accumulation over micro-batches and writing straight into a flat buffer that a
collective then reduces cost nothing extra. `grads_zero=True` is the caller's
promise that `grads` holds zeros (+0.0, e.g. the first micro-batch of a step):
a layer may then write its gradient instead of adding it, when that gives the
same bits (Linear's weight gradient does, without a (in, out) temporary).

Inputs are (N, C) or (..., C): leading dimensions are flattened by the layers
that need it. What it is not: no autograd, no parameter storage, no device
handling, no convolutions or attention.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainer.nn.context import Context

__all__ = ["Layer", "Linear", "ReLU", "GELU", "LayerNorm", "Dropout", "Sequential"]

Params = dict[str, np.ndarray]


class Layer:
    """Base class: a layer without parameters and an identity forward."""

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return []

    def init(self, params: Params, rng: np.random.Generator) -> None:
        """Fill `params` (float64 views) in place from `rng`."""

    def bind(self, stream: tuple[int, ...]) -> None:
        """Name this layer's random stream (only Dropout uses it)."""

    def forward(self, params: Params, x: np.ndarray, ctx: Context) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    def backward(self, params: Params, cache: Any, dout: np.ndarray, grads: Params, *,
                 grads_zero: bool = False) -> np.ndarray:
        raise NotImplementedError


class Linear(Layer):
    """y = x @ W + b with W of shape (in, out).

    forward:  y = x W + b                     # x (N, in), W (in, out), y (N, out)
    backward: dx = dy W^T                     # (N, in)
              dW += x^T dy                    # (in, out)
              db += sum_n dy[n]               # (out,)
    init: W, b ~ U(-1/sqrt(in), 1/sqrt(in)), as torch.nn.Linear.

    With grads_zero, x^T dy is written straight into dW's buffer (np.matmul out=):
    0 + t == t bit for bit for every t but -0.0, and a matmul never returns -0.0
    (its sums start from +0.0, in BLAS and in NumPy's own loop alike), so the
    bits are those of dW += x^T dy, without the (in, out) temporary and the pass
    that adds it. The bias keeps +=: a sum reduction starts from its first term
    and may return -0.0.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear sizes must be > 0, got in={in_features} out={out_features}")
        self.in_features, self.out_features, self.bias = in_features, out_features, bias

    def param_shapes(self):
        shapes = [("weight", (self.in_features, self.out_features))]
        return shapes + ([("bias", (self.out_features,))] if self.bias else [])

    def init(self, params, rng):
        bound = 1.0 / math.sqrt(self.in_features)
        for name, _ in self.param_shapes():
            params[name][...] = rng.uniform(-bound, bound, size=params[name].shape)

    def forward(self, params, x, ctx):
        x2 = x.reshape(-1, self.in_features)  # (N, in)
        y = x2 @ params["weight"]  # (N, out)
        if self.bias:
            y += params["bias"]
        return y.reshape(*x.shape[:-1], self.out_features), (x2, x.shape)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        x2, x_shape = cache
        d2 = dout.reshape(-1, self.out_features)  # (N, out)
        dW = grads["weight"]  # (in, out)
        if grads_zero and dW.dtype == np.result_type(x2, d2):
            np.matmul(x2.T, d2, out=dW)  # dW was +0.0: the same bits as dW += x^T dy (see above)
        else:
            dW += x2.T @ d2
        if self.bias:
            grads["bias"] += d2.sum(axis=0)  # (out,)
        return (d2 @ params["weight"].T).reshape(x_shape)  # (N, in)


class ReLU(Layer):
    """y = max(x, 0);  dx = dy * [x > 0]."""

    def forward(self, params, x, ctx):
        positive = x > 0
        return np.where(positive, x, 0).astype(x.dtype, copy=False), positive

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        return np.where(cache, dout, 0).astype(dout.dtype, copy=False)


_GELU_C = math.sqrt(2.0 / math.pi)  # 0.7978845608...
_GELU_A = 0.044715


class GELU(Layer):
    """GELU, tanh approximation (as GPT-2 / torch approximate='tanh').

    forward:  u = c (x + a x^3),  t = tanh(u),  y = 0.5 x (1 + t)
              with c = sqrt(2/pi), a = 0.044715
    backward: dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)
              dx = dy * dy/dx
    """

    def forward(self, params, x, ctx):
        t = np.tanh(_GELU_C * (x + _GELU_A * (x * x * x)))  # x*x*x, not np.power: bench/results/trainer.md#gelu-cube
        return 0.5 * x * (1.0 + t), (x, t)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        x, t = cache
        local = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
        return dout * local


class LayerNorm(Layer):
    """Layer normalization over the last dimension (biased variance, as torch).

    forward:  mu = mean_c x,  var = mean_c (x - mu)^2,  rstd = 1 / sqrt(var + eps)
              xhat = (x - mu) rstd,  y = xhat w + b          # x, y (N, C); w, b (C,)
    backward: dw += sum_n dy xhat,  db += sum_n dy
              g = dy w
              dx = rstd (g - mean_c g - xhat mean_c(g xhat))
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        if dim <= 0:
            raise ValueError(f"LayerNorm dim must be > 0, got {dim}")
        self.dim, self.eps = dim, eps

    def param_shapes(self):
        return [("weight", (self.dim,)), ("bias", (self.dim,))]

    def init(self, params, rng):
        params["weight"][...] = 1.0
        params["bias"][...] = 0.0

    def forward(self, params, x, ctx):
        mu = x.mean(axis=-1, keepdims=True)  # (N, 1)
        xc = x - mu  # (N, C)
        rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)  # (N, 1)
        xhat = xc * rstd  # (N, C)
        return xhat * params["weight"] + params["bias"], (xhat, rstd)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        xhat, rstd = cache  # (sums keep +=: a reduction may return -0.0, which 0 + t would not)
        lead = tuple(range(dout.ndim - 1))
        grads["weight"] += (dout * xhat).sum(axis=lead)  # (C,)
        grads["bias"] += dout.sum(axis=lead)  # (C,)
        g = dout * params["weight"]  # (N, C)
        g_mean = g.mean(axis=-1, keepdims=True)  # (N, 1)
        gx_mean = (g * xhat).mean(axis=-1, keepdims=True)  # (N, 1)
        return rstd * (g - g_mean - xhat * gx_mean)


class Dropout(Layer):
    """Inverted dropout with a reproducible mask.

    forward (training):  m = [u >= p] / (1 - p),  y = x m,  u ~ U[0, 1) per element
    forward (eval) or p == 0:  y = x
    backward:  dx = dy m

    u comes from `ctx.rng(stream)` only: rows [batch_offset, batch_offset + N)
    of the float64 stream of the global batch. PCG64 spends one 64-bit draw per
    float64, so the generator skips the rows before batch_offset with
    `advance(batch_offset * row size)` instead of drawing them; the mask is the
    same for any dtype, process or world size.
    """

    def __init__(self, p: float) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout p must be in [0, 1), got {p}")
        self.p = p
        self.stream: tuple[int, ...] = (0,)

    def bind(self, stream):
        self.stream = tuple(stream)

    def mask(self, shape: tuple[int, ...], dtype, ctx: Context) -> np.ndarray:
        rng = ctx.rng(self.stream)
        rng.bit_generator.advance(ctx.batch_offset * math.prod(shape[1:]))  # the rows of lower ranks
        u = rng.random(shape)  # (N, ...)
        return ((u >= self.p) / (1.0 - self.p)).astype(dtype)

    def forward(self, params, x, ctx):
        if not ctx.training or self.p == 0.0:
            return x, None
        m = self.mask(x.shape, x.dtype, ctx)
        return x * m, m

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        return dout if cache is None else dout * cache


class Sequential(Layer):
    """Children applied in order; parameter names are prefixed `"{j}."` (torch style).

    forward:  h_0 = x,  h_{j+1} = f_j(h_j),  y = h_J
    backward: dh_J = dy,  dh_j = f_j'^T(dh_{j+1}) in reverse order, dx = dh_0
    """

    def __init__(self, *layers: Layer) -> None:
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        self.layers = list(layers)
        self._names = [[n for n, _ in layer.param_shapes()] for layer in self.layers]

    def param_shapes(self):
        return [(f"{j}.{n}", s) for j, layer in enumerate(self.layers) for n, s in layer.param_shapes()]

    def _split(self, params: Params) -> list[Params]:
        return [{n: params[f"{j}.{n}"] for n in names} for j, names in enumerate(self._names)]

    def init(self, params, rng):
        for layer, sub in zip(self.layers, self._split(params)):
            layer.init(sub, rng)

    def bind(self, stream):
        for j, layer in enumerate(self.layers):
            layer.bind((*stream, j))

    def forward(self, params, x, ctx):
        caches = []
        for layer, sub in zip(self.layers, self._split(params)):
            x, cache = layer.forward(sub, x, ctx)
            caches.append(cache)
        return x, caches

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        subs, sub_grads = self._split(params), self._split(grads)
        for j in reversed(range(len(self.layers))):
            dout = self.layers[j].backward(subs[j], cache[j], dout, sub_grads[j], grads_zero=grads_zero)
        return dout
