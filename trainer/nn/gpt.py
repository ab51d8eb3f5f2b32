"""A decoder-only transformer (GPT-2's architecture) over units, with a KV-cached sampler.

What it is: `GPTConfig`, the layers the model is made of (`MLP`, `Block`, `GPTEnds` with its two
entries `embed` and `head`), and `GPT`, a trainer.nn.Model:

    unit 0      GPTEnds: wte (V, C) token embedding, wpe (T, C) positions, ln_f; two entries:
                  embed:  h = dropout(wte[idx] + wpe[:T])            # idx (B, T) -> h (B, T, C)
                  head:   logits = ln_f(h) wte^T                      # (B, T, V), the TIED matrix
    unit l      Block l (l = 1 .. n_layer), pre-LayerNorm:
                  x = x + attn(ln_1(x))                               # trainer/nn/attention.py
                  x = x + mlp(ln_2(x))                                # Linear(C, 4C), GELU, Linear(4C, C), dropout
    calls       [Call(0, "embed"), Call(1, checkpoint), ..., Call(L, checkpoint), Call(0, "head")]
    loss        cross-entropy over the vocabulary at every position (CrossEntropyLoss)

The tied matrix gets the sum of both uses' gradients in unit 0's one buffer, reduced once at
`grad_ready(0)`. Each block is one unit, so zero3/fsdp gather one block at a time.

    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64))   # dtype=np.float64 for checks
    loss = model.forward_backward(model.init_params(seed=0), model.zeros(), idx, targets, Context())
    text_ids = model.generate(params, prompt_ids, 200, temperature=0.8, top_k=40, seed=0)

Init (GPT-2 / nanoGPT): weights and embeddings N(0, 0.02^2), biases 0, LayerNorm 1/0, the two
residual projections of each block N(0, (0.02 / sqrt(2 n_layer))^2); weight decay on matrices
only. Model parallelism builds on `Block(attn=, mlp=)` and `GPTEnds(head=, wte=)`
(trainer/parallel/gpt.py: Megatron's layout).

What it is not: no flash attention, no rotary positions, no mixture of experts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from trainer.nn.attention import CausalSelfAttention, KVCache
from trainer.nn.context import EVAL
from trainer.nn.embedding import Embedding, PositionalEmbedding
from trainer.nn.layers import GELU, Container, Dropout, Layer, LayerNorm, Linear, check_kernel
from trainer.nn.loss import CrossEntropyLoss, Loss
from trainer.nn.model import Call, Model
from trainer.nn.unit import Unit

__all__ = ["GPTConfig", "MLP", "Block", "GPTEnds", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 64  # context length T, e.g. 64
    n_layer: int = 4  # blocks, e.g. 4
    n_head: int = 4  # attention heads, e.g. 4 (head size n_embd / n_head)
    n_embd: int = 128  # width C, e.g. 128
    dropout: float = 0.0  # embedding, attention and residual dropout
    bias: bool = True  # biases in the Linear layers and LayerNorms' shift (LayerNorm always has one)
    gelu: str = "tanh"  # "tanh" (GPT-2's approximation) | "none" (exact erf, torch's default)
    kernel: str = "fast"  # "fast" (trainer/nn/layer_kernels.py) | "reference" (the readable NumPy)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        GELU(self.gelu)
        check_kernel(self.kernel)

    def as_dict(self) -> dict:
        return asdict(self)


class MLP(Container):
    """The block's feed-forward part: fc Linear(C, 4C) -> GELU -> proj Linear(4C, C) -> dropout."""

    def __init__(self, n_embd: int, hidden: int, *, gelu: str = "tanh", dropout: float = 0.0, bias: bool = True,
                 init_std: float | None = 0.02, proj_init_std: float | None = None, kernel: str = "fast") -> None:
        self.children = [
            ("fc", Linear(n_embd, hidden, bias, init_std=init_std)),
            ("act", GELU(gelu, kernel=kernel)),
            ("proj", Linear(hidden, n_embd, bias, init_std=init_std if proj_init_std is None else proj_init_std)),
            ("drop", Dropout(dropout)),
        ]
        self._index()

    def forward(self, params, x, ctx):
        caches = []
        for name, layer in self.children:
            x, cache = layer.forward(self.sub(params, name), x, ctx)
            caches.append(cache)
        return x, caches

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        for (name, layer), c in zip(reversed(self.children), reversed(cache)):
            dout = layer.backward(self.sub(params, name), c, dout, self.sub(grads, name), grads_zero=grads_zero)
        return dout


class Block(Container):
    """Pre-LayerNorm transformer block (the module docstring).

    forward:  a = attn(ln_1(x));  x1 = x + a;  m = mlp(ln_2(x1));  y = x1 + m       # (B, T, C)
    backward: dx1 = dy + ln_2^T(mlp^T(dy));  dx = dx1 + ln_1^T(attn^T(dx1))
    """

    def __init__(self, config: GPTConfig, *, attn: Layer | None = None, mlp: Layer | None = None) -> None:
        C = config.n_embd
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.children = [
            ("ln_1", LayerNorm(C, kernel=config.kernel)),
            ("attn", attn or CausalSelfAttention(C, config.n_head, dropout=config.dropout, bias=config.bias,
                                                 proj_init_std=proj_std, kernel=config.kernel)),
            ("ln_2", LayerNorm(C, kernel=config.kernel)),
            ("mlp", mlp or MLP(C, 4 * C, gelu=config.gelu, dropout=config.dropout, bias=config.bias,
                               proj_init_std=proj_std, kernel=config.kernel)),
        ]
        self._index()
        self.ln_1, self.attn, self.ln_2, self.mlp = (layer for _, layer in self.children)

    def forward(self, params, x, ctx):
        h, c1 = self.ln_1.forward(self.sub(params, "ln_1"), x, ctx)
        a, c2 = self.attn.forward(self.sub(params, "attn"), h, ctx)
        x1 = x + a  # (B, T, C)
        h, c3 = self.ln_2.forward(self.sub(params, "ln_2"), x1, ctx)
        m, c4 = self.mlp.forward(self.sub(params, "mlp"), h, ctx)
        return x1 + m, (c1, c2, c3, c4)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        c1, c2, c3, c4 = cache
        kw = dict(grads_zero=grads_zero)
        d = self.mlp.backward(self.sub(params, "mlp"), c4, dout, self.sub(grads, "mlp"), **kw)
        dx1 = dout + self.ln_2.backward(self.sub(params, "ln_2"), c3, d, self.sub(grads, "ln_2"), **kw)
        d = self.attn.backward(self.sub(params, "attn"), c2, dx1, self.sub(grads, "attn"), **kw)
        d = self.ln_1.backward(self.sub(params, "ln_1"), c1, d, self.sub(grads, "ln_1"), **kw)
        d += dx1
        return d

    def forward_cached(self, params, x, kv: KVCache, ctx):
        """Evaluation over the next positions with the attention's KV cache."""
        h, _ = self.ln_1.forward(self.sub(params, "ln_1"), x, ctx)
        x1 = x + self.attn.forward_cached(self.sub(params, "attn"), h, kv, ctx)
        h, _ = self.ln_2.forward(self.sub(params, "ln_2"), x1, ctx)
        return x1 + self.mlp.forward(self.sub(params, "mlp"), h, ctx)[0]


class _Embed(Layer):
    """GPTEnds' "embed" entry: idx (B, T) -> dropout(wte[idx] + wpe[:T]) (B, T, C).

    With float16 / bfloat16 parameters the activations are float32 from here on, as an
    MLP's float32 data make them (trainer/precision.py): NumPy has no BLAS for float16
    matmuls (bench/results/trainer.md#float16-matmuls)."""

    def __init__(self, ends: "GPTEnds") -> None:
        self.ends = ends

    def output_shape(self, shape):
        return self.ends.wte.output_shape(shape)  # (B, T) -> (B, T, C)

    def forward(self, params, idx, ctx, start: int = 0):
        e = self.ends
        h, c_tok = e.wte.forward(e.sub(params, "wte"), idx, ctx)
        if h.dtype.itemsize < 4:
            h = h.astype(np.float32)
        h, c_pos = e.wpe.forward(e.sub(params, "wpe"), h, ctx, start)
        h, c_drop = e.drop.forward({}, h, ctx)
        return h, (c_tok, c_pos, c_drop)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        e = self.ends
        c_tok, c_pos, c_drop = cache
        d = e.drop.backward({}, c_drop, dout, {})
        d = e.wpe.backward(e.sub(params, "wpe"), c_pos, d, e.sub(grads, "wpe"))
        return e.wte.backward(e.sub(params, "wte"), c_tok, d, e.sub(grads, "wte"))


class _TiedHead(Layer):
    """GPTEnds' "head" entry: logits = ln_f(h) wte^T.

    forward:  z = ln_f(h) (B, T, C);  logits = z W^T (B, T, V) with W = wte (V, C)
    backward: dW += dlogits^T z (V, C), added to the embedding's gradient of the same W;
              dz = dlogits W;  dh = ln_f^T(dz)
    """

    def __init__(self, ends: "GPTEnds") -> None:
        self.ends = ends

    def forward(self, params, h, ctx):
        e = self.ends
        z, c_ln = e.ln_f.forward(e.sub(params, "ln_f"), h, ctx)  # (B, T, C)
        w = params["wte.weight"]  # (V, C)
        return np.matmul(z, w.T), (z, c_ln)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        e = self.ends
        z, c_ln = cache
        w = params["wte.weight"]  # (V, C)
        d2 = dout.reshape(-1, w.shape[0])  # (N, V)
        grads["wte.weight"] += d2.T @ z.reshape(-1, w.shape[1])  # (V, C): never written, the embedding adds too
        dz = (d2 @ w).reshape(z.shape)  # (B, T, C)
        return e.ln_f.backward(e.sub(params, "ln_f"), c_ln, dz, e.sub(grads, "ln_f"), grads_zero=grads_zero)


class GPTEnds(Container):
    """Unit 0 of the GPT: token and position embeddings, the final LayerNorm and the tied head.

    Parameters wte.weight (V, C), wpe.weight (T, C), ln_f.weight, ln_f.bias (C,). Its module's
    own forward is the embedding; `entries()` gives both entry points for the Unit. `head=`
    replaces the head and `wte=` the token embedding (e.g. vocabulary-parallel ones,
    trainer/parallel/vocab.py); the head sees this container's parameters.
    """

    def __init__(self, config: GPTConfig, *, head: Layer | None = None, wte: Layer | None = None) -> None:
        self.wte = wte or Embedding(config.vocab_size, config.n_embd, kernel=config.kernel)
        self.wpe = PositionalEmbedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.dropout)
        self.ln_f = LayerNorm(config.n_embd, kernel=config.kernel)
        self.children = [("wte", self.wte), ("wpe", self.wpe), ("drop", self.drop), ("ln_f", self.ln_f)]
        self._index()
        self.embed = _Embed(self)
        self.head = head or _TiedHead(self)

    def entries(self) -> dict[str, Layer]:
        return {"embed": self.embed, "head": self.head}

    def output_shape(self, shape):
        return self.embed.output_shape(shape)

    def forward(self, params, idx, ctx):
        return self.embed.forward(params, idx, ctx)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        return self.embed.backward(params, cache, dout, grads, grads_zero=grads_zero)


class GPT(Model):
    """The decoder-only transformer as a Model (the module docstring).

    Args:
        config: the sizes (GPTConfig).
        dtype: dtype of the buffers init_params / zeros make (float32; float64 for checks).
        pad_to: padding of those buffers (a strategy pads to its world size itself).
        loss: default CrossEntropyLoss(kernel=config.kernel).
    """

    def __init__(self, config: GPTConfig = GPTConfig(), *, dtype=np.float32, pad_to: int = 1,
                 loss: Loss | None = None) -> None:
        self.config = config
        ends = GPTEnds(config)
        units = [Unit(ends, pad_to=pad_to, dtype=dtype, entries=ends.entries())]
        units += [Unit(Block(config), pad_to=pad_to, dtype=dtype) for _ in range(config.n_layer)]
        calls = [Call(0, "embed")] + [Call(b, checkpoint=True) for b in range(1, config.n_layer + 1)]
        calls.append(Call(0, "head"))
        super().__init__(units, calls=calls, loss=loss if loss is not None else CrossEntropyLoss(config.kernel))

    def spec(self) -> dict:
        """What rebuilds this model (stored in checkpoints): {"kind": "gpt", "config": {...}}."""
        return {"kind": "gpt", "config": self.config.as_dict()}

    @classmethod
    def from_spec(cls, spec: dict, **kw) -> "GPT":
        if spec.get("kind") != "gpt":
            raise ValueError(f"not a GPT spec: {spec!r}")
        return cls(GPTConfig(**spec["config"]), **kw)

    # ---- decoding ----------------------------------------------------------------------

    def _ends(self) -> GPTEnds:
        return self.units[0].module

    def logits_cached(self, params_list, idx: np.ndarray, caches: list[KVCache]) -> np.ndarray:
        """Logits (B, T', V) of the next T' positions, extending the KV caches (one per block)."""
        ends, start = self._ends(), caches[0].length
        p0 = self.units[0].views(params_list[0])
        h, _ = ends.embed.forward(p0, idx, EVAL, start)
        for b, kv in enumerate(caches, start=1):  # unit b is block b
            h = self.units[b].module.forward_cached(self.units[b].views(params_list[b]), h, kv, EVAL)
        return ends.head.forward(p0, h, EVAL)[0]

    def new_caches(self, batch: int, dtype) -> list[KVCache]:
        c = self.config
        return [KVCache(batch, c.n_head, c.block_size, c.n_embd // c.n_head, dtype) for _ in range(c.n_layer)]

    def generate(self, params_list, prompt: np.ndarray, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> np.ndarray:
        """Samples `max_new_tokens` tokens after `prompt` (B, T0) ints; returns (B, T0 + new).

        With the KV cache each new token costs one position. When the context reaches
        block_size, the cache restarts from the last block_size // 2 tokens (a new prefill):
        the positions of a learned embedding cannot slide. `use_cache=False` recomputes the
        whole (same) context for every token: the reference the cache must equal.
        Sampling: logits / temperature, optionally only the top_k, then a draw from
        np.random.default_rng(seed); temperature 0 takes the arg-max.
        """
        idx = np.asarray(prompt, dtype=np.int64)
        if idx.ndim != 2 or idx.shape[1] < 1:
            raise ValueError(f"prompt must be (B, T0) token ids with T0 >= 1, got shape {idx.shape}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        rng = np.random.default_rng(seed)
        T = self.config.block_size
        dtype = np.result_type(params_list[0].dtype, np.float32)
        context_start = max(0, idx.shape[1] - T)  # the context is idx[:, context_start:]
        caches, fed = None, 0  # fed: tokens of the context already in the caches
        out = idx
        for _ in range(max_new_tokens):
            if out.shape[1] - context_start > T:  # full: restart from the last T // 2 tokens
                context_start = out.shape[1] - max(1, T // 2)
                caches = None
            context = out[:, context_start:]
            if not use_cache:
                logits = self.forward(params_list, context)[:, -1]
            else:
                if caches is None:
                    caches, fed = self.new_caches(len(out), dtype), 0
                logits = self.logits_cached(params_list, context[:, fed:], caches)[:, -1]
                fed = context.shape[1]
            out = np.concatenate([out, self._sample(logits, temperature, top_k, rng)[:, None]], axis=1)
        return out

    @staticmethod
    def _sample(logits: np.ndarray, temperature: float, top_k: int | None, rng) -> np.ndarray:
        logits = np.asarray(logits, dtype=np.float64)  # (B, V)
        if temperature <= 0:
            return logits.argmax(axis=-1)
        z = logits / temperature
        if top_k is not None and top_k < z.shape[-1]:
            kth = np.partition(z, -top_k, axis=-1)[:, -top_k][:, None]
            z = np.where(z < kth, -np.inf, z)
        z -= z.max(axis=-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
        return np.array([rng.choice(len(row), p=row) for row in p], dtype=np.int64)
