"""Layers with hand-written backward passes: Linear, ReLU, GELU, LayerNorm, Dropout, and the containers.

What it is: each layer is a stateless description (shapes, hyper-parameters) with `forward` and
`backward` side by side and the math above them. Parameters are NOT owned by the layer: they
arrive as a dict of arrays (views into a unit's flat buffer, trainer/nn/unit.py), and so do the
gradients. The layer protocol (every class below follows it):

    param_shapes() -> list[(name, shape)]          # size table, in buffer order
    decay(name) -> bool                            # weight decay applies (default: matrices)
    init(params, rng) -> None                      # fill float64 views in place
    forward(params, x, ctx) -> (out, cache)        # ctx: trainer.nn.Context
    backward(params, cache, dout, grads, *, grads_zero=False) -> dx
                                                   # ACCUMULATES (+=) into grads
    bind(stream) -> None                           # names the layer's RNG stream
    output_shape(shape) -> shape                   # the output's shape for an input's (pipeline stages)
    split                                          # its tensor-parallel declaration (below)

`grads_zero=True` promises `grads` holds +0.0 (a layer may write instead of add when the bits are
the same); a cache never aliases an array a later layer writes in place. `Container` holds named
children (parameter names "<child>.<name>"), `Sequential` runs numbered ones in order. LayerNorm
and GELU take `kernel="fast"` (trainer/nn/layer_kernels.py) or "reference" (the NumPy written here).

Tensor-parallel declarations (`split`, turned into layers by trainer/parallel/split.py): None
(replicated), Linear "column" (output features cut across the tp group) or "row" (input features
cut: it follows a column one and sums the parts), LayerNorm and Dropout "column" (acting on the
cut features between the two). At tp = 1 a declaration changes nothing.

What it is not: no autograd, no parameter storage, no device handling, no convolutions;
attention and embeddings are in their own files.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainer.nn import layer_kernels
from trainer.nn.context import Context

__all__ = ["Layer", "Linear", "ReLU", "GELU", "LayerNorm", "Dropout", "Container", "Sequential", "KERNELS",
           "check_kernel", "SPLITS"]

KERNELS = ("fast", "reference")
SPLITS = {"Linear": ("column", "row"), "LayerNorm": ("column",), "Dropout": ("column",)}  # declarable splits


def _check_split(layer: str, split: str | None) -> str | None:
    if split is not None and split not in SPLITS[layer]:
        raise ValueError(f"{layer} split must be None or one of {SPLITS[layer]}, got {split!r}")
    return split


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel

Params = dict[str, np.ndarray]


class Layer:
    """Base class: a layer without parameters and an identity forward."""

    split: str | None = None  # the tensor-parallel split it declares (module docstring); None: replicated

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return []

    def decay(self, name: str) -> bool:
        """Whether weight decay applies to parameter `name` (nanoGPT's groups): matrices
        yes; biases and norms (1-D) no. Embeddings override it (no)."""
        return len(dict(self.param_shapes())[name]) >= 2

    def init(self, params: Params, rng: np.random.Generator) -> None:
        """Fill `params` (float64 views) in place from `rng`."""

    def bind(self, stream: tuple[int, ...]) -> None:
        """Name this layer's random stream (only Dropout uses it)."""

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the output for an input of ``shape`` (the default: the same, as an
        activation, a norm or a dropout keeps it)."""
        return tuple(shape)

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
    init: W, b ~ U(-1/sqrt(in), 1/sqrt(in)), as torch.nn.Linear; with init_std,
          W ~ N(0, init_std^2) and b = 0 (GPT-2's initialisation).

    With grads_zero, x^T dy is written straight into dW's buffer (np.matmul out=):
    0 + t == t bit for bit for every t but -0.0, and a matmul never returns -0.0
    (its sums start from +0.0, in BLAS and in NumPy's own loop alike), so the
    bits are those of dW += x^T dy, without the (in, out) temporary and the pass
    that adds it. The bias keeps +=: a sum reduction starts from its first term
    and may return -0.0.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 init_std: float | None = None, split: str | None = None) -> None:
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear sizes must be > 0, got in={in_features} out={out_features}")
        self.in_features, self.out_features, self.bias = in_features, out_features, bias
        self.init_std = init_std
        self.split = _check_split("Linear", split)

    def output_shape(self, shape):
        return (*shape[:-1], self.out_features)

    def param_shapes(self):
        shapes = [("weight", (self.in_features, self.out_features))]
        return shapes + ([("bias", (self.out_features,))] if self.bias else [])

    def init(self, params, rng):
        if self.init_std is not None:
            params["weight"][...] = rng.normal(0.0, self.init_std, size=params["weight"].shape)
            if self.bias:
                params["bias"][...] = 0.0
            return
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


_GELU_C, _GELU_A = layer_kernels.GELU_C, layer_kernels.GELU_A  # sqrt(2 / pi), 0.044715


class GELU(Layer):
    """GELU, exact or tanh-approximated (torch.nn.GELU(approximate="none" | "tanh")).

    approximate="tanh" (GPT-2's, and the default here):
        u = c (x + a x^3),  t = tanh(u),  y = 0.5 x (1 + t),  c = sqrt(2/pi), a = 0.044715
        dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)
    approximate="none" (the exact erf form, torch's default):
        y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))
        dy/dx = Phi(x) + x phi(x),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    backward: dx = dy * dy/dx
    """

    FORMS = ("tanh", "none")

    def __init__(self, approximate: str = "tanh", *, kernel: str = "fast") -> None:
        if approximate not in self.FORMS:
            raise ValueError(f"GELU approximate must be one of {self.FORMS}, got {approximate!r}")
        self.approximate, self.kernel = approximate, check_kernel(kernel)
        self.exact = approximate == "none"

    def forward(self, params, x, ctx):
        if self.kernel == "fast" and layer_kernels.use_fast(x):
            if self.exact:
                out, e = layer_kernels.gelu_erf_forward(x)
                return out, (x, e, "fast")
            out, t = layer_kernels.gelu_tanh_forward(x)
            return out, (x, t, "fast")
        if self.exact:
            cdf = 0.5 * (1.0 + _erf(x * _INV_SQRT2))
            return x * cdf, (x, cdf)
        t = np.tanh(_GELU_C * (x + _GELU_A * (x * x * x)))  # x*x*x, not np.power: bench/results/trainer.md#gelu-cube
        return 0.5 * x * (1.0 + t), (x, t)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        if len(cache) == 3:  # the fast path: t is tanh(u), or erf(x / sqrt 2) for the exact form
            x, t, _ = cache
            if dout.dtype == x.dtype:
                return (layer_kernels.gelu_erf_backward if self.exact else layer_kernels.gelu_tanh_backward)(x, t, dout)
            t = 0.5 * (1.0 + t) if self.exact else t  # the reference's cache: Phi(x), or tanh(u)
        else:
            x, t = cache
        if self.exact:
            local = t + x * _INV_SQRT_2PI * np.exp(-0.5 * x * x)  # t is Phi(x) here
        else:
            local = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
        return dout * local


_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf element-wise (NumPy has none; SciPy, the trainer extra, has)."""
    from trainer.extras import need  # local, as SciPy: ~0.2 s to import, and only the reference path needs it

    special = need("scipy.special", package="SciPy", extra="trainer", what="the exact GELU's reference kernel")
    return special.erf(x).astype(x.dtype, copy=False)


class LayerNorm(Layer):
    """Layer normalization over the last dimension (biased variance, as torch).

    forward:  mu = mean_c x,  var = mean_c (x - mu)^2,  rstd = 1 / sqrt(var + eps)
              xhat = (x - mu) rstd,  y = xhat w + b          # x, y (N, C); w, b (C,)
    backward: dw += sum_n dy xhat,  db += sum_n dy
              g = dy w
              dx = rstd (g - mean_c g - xhat mean_c(g xhat))

    The NumPy path keeps (xhat, rstd); the kernel path keeps (x, mean, rstd), x being
    the caller's array (no copy), and recomputes xhat in its one backward pass.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, kernel: str = "fast", split: str | None = None) -> None:
        if dim <= 0:
            raise ValueError(f"LayerNorm dim must be > 0, got {dim}")
        self.dim, self.eps, self.kernel = dim, eps, check_kernel(kernel)
        self.split = _check_split("LayerNorm", split)

    def param_shapes(self):
        return [("weight", (self.dim,)), ("bias", (self.dim,))]

    def init(self, params, rng):
        params["weight"][...] = 1.0
        params["bias"][...] = 0.0

    def forward(self, params, x, ctx):
        w, b = params["weight"], params["bias"]
        if self.kernel == "fast" and x.dtype == np.result_type(x, w) and layer_kernels.use_fast(x, w, b):
            x2 = x.reshape(-1, self.dim)  # (N, C), a view
            out = np.empty_like(x2)
            mean, rstd = np.empty(len(x2), np.float64), np.empty(len(x2), np.float64)  # (N,)
            layer_kernels.layernorm_forward(x2, w, b, self.eps, out, mean, rstd)
            return out.reshape(x.shape), (x2, mean, rstd)
        mu = x.mean(axis=-1, keepdims=True)  # (N, 1)
        xc = x - mu  # (N, C)
        rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)  # (N, 1)
        xhat = xc * rstd  # (N, C)
        return xhat * w + b, (xhat, rstd)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        if len(cache) == 3:  # the kernel path
            x2, mean, rstd = cache
            d2 = np.ascontiguousarray(dout.reshape(-1, self.dim), dtype=x2.dtype)  # (N, C)
            dx = np.empty_like(d2)
            dw, db = np.zeros(self.dim), np.zeros(self.dim)  # (C,) float64 sums
            layer_kernels.layernorm_backward(d2, x2, mean, rstd, params["weight"], dx, dw, db)
            grads["weight"] += dw
            grads["bias"] += db
            return dx.reshape(dout.shape)
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

    def __init__(self, p: float, *, split: str | None = None) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout p must be in [0, 1), got {p}")
        self.p = p
        self.stream: tuple[int, ...] = (0,)
        self.split = _check_split("Dropout", split)

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


class Container(Layer):
    """Named children; parameter names are prefixed "<child>." (torch style).

    A subclass sets `self.children = [(name, layer), ...]` (buffer order) and writes
    its own forward/backward over `self.sub(params, name)`. Random streams: child j
    gets (*stream, j); weight decay: each child decides for its own parameters. Its
    output_shape is the input's unless the subclass says otherwise.
    """

    children: list[tuple[str, Layer]]

    def _index(self) -> None:
        """Builds the name tables; call after setting `children`."""
        self._names = {name: [n for n, _ in layer.param_shapes()] for name, layer in self.children}
        self._by_name = dict(self.children)

    def param_shapes(self):
        return [(f"{name}.{n}", s) for name, layer in self.children for n, s in layer.param_shapes()]

    def decay(self, name):
        child, _, rest = name.partition(".")
        return self._by_name[child].decay(rest)

    def sub(self, params: Params, name: str) -> Params:
        """Child `name`'s parameters (or gradients) out of this container's dict, unprefixed."""
        return {n: params[f"{name}.{n}"] for n in self._names[name]}

    def init(self, params, rng):
        for name, layer in self.children:
            layer.init(self.sub(params, name), rng)

    def bind(self, stream):
        for j, (_, layer) in enumerate(self.children):
            layer.bind((*stream, j))


class Sequential(Container):
    """Children applied in order; parameter names are prefixed `"{j}."` (torch style).

    forward:  h_0 = x,  h_{j+1} = f_j(h_j),  y = h_J
    backward: dh_J = dy,  dh_j = f_j'^T(dh_{j+1}) in reverse order, dx = dh_0
    """

    def __init__(self, *layers: Layer) -> None:
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        self.layers = list(layers)
        self.children = [(str(j), layer) for j, layer in enumerate(self.layers)]
        self._index()

    def _split(self, params: Params) -> list[Params]:
        return [self.sub(params, name) for name, _ in self.children]

    def output_shape(self, shape):
        for layer in self.layers:
            shape = layer.output_shape(shape)
        return tuple(shape)

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
