"""Vocabulary parallelism (Megatron-LM's VocabParallelEmbedding and cross_entropy.py): the token
embedding, the tied head and the loss with the vocabulary split across the tp group, so no rank
ever holds the full (B, T, V) logits.

How it works (t ranks; rank i holds vocabulary rows [lo_i, hi_i), tp.part: the first V % t
ranks one row more, so any V >= t splits):

    embedding   out = g(E_i[idx - lo_i] where lo_i <= idx < hi_i, else 0)        # (B, T, C)
                each token's row lives on one rank; the all_reduce (g) hands it to all.
                backward: dE_i[idx - lo_i] += dout for this rank's tokens (no communication)
    head        logits_i = f(ln_f(h)) E_i^T                                      # (B, T, V_i)
                backward: dE_i += dlogits_i^T z;  dz = all_reduce(dlogits_i E_i) (f's backward)
    loss        over this rank's columns, with two all_reduces of (B T) rows:
                    m     = all_reduce_max(max_k logits_i)                      # (N,)
                    z_i   = logits_i - m;  e_i = exp z_i
                    [S, p] = all_reduce_sum([sum_k e_i, z_i[y - lo_i] if y is here else 0])
                    l_n   = log S - p                                           # -log softmax[y]
                    dlogits_i = dloss (e_i / S - onehot_i(y)) / (T D)           # local, no communication
                metrics: the loss sum and the accuracy of the GLOBAL arg-max (the first index
                holding the maximum, as np.argmax: min over ranks of lo_i + local first index).

The embedding's row sum adds zeros to the one nonzero row, so its output is the single-process
row bit for bit; the loss and head differ from the single-process ones by summation order only.

What it is not: no padding of the vocabulary to a multiple of t (uneven parts instead), no
label smoothing, no sequence-parallel gather of the head's input.
"""

from __future__ import annotations

import numpy as np

from trainer.nn import layer_kernels
from trainer.nn.layers import Layer
from trainer.nn.loss import CrossEntropyLoss, Loss, _denominator
from trainer.parallel.tp_group import TPGroup, part
from trainer.parallel.tensor import Split, copy_to_tp, copy_to_tp_backward, reduce_from_tp

__all__ = ["VocabParallelEmbedding", "VocabParallelHead", "VocabParallelCrossEntropy"]


def _check_vocab(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    if vocab_size < tp.size:
        raise ValueError(f"a vocabulary of {vocab_size} tokens cannot split over tp={tp.size}")
    return part(vocab_size, tp.rank, tp.size)


class VocabParallelEmbedding(Layer):
    """Token embedding whose rows [lo, hi) live on this rank (the module docstring)."""

    def __init__(self, num_embeddings: int, dim: int, tp: TPGroup, *, init_std: float = 0.02) -> None:
        self.num_embeddings, self.dim, self.tp, self.init_std = num_embeddings, dim, tp, init_std
        self.lo, self.hi = _check_vocab(num_embeddings, tp)

    def param_shapes(self):
        return [("weight", (self.hi - self.lo, self.dim))]

    def decay(self, name):
        return False

    def tp_split(self, name: str) -> Split:
        return Split((self.num_embeddings, self.dim), 0, self.lo, self.hi)

    def output_shape(self, shape):
        return (*shape, self.dim)

    def forward(self, params, idx, ctx):
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"Embedding input must be integer token ids, got dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_embeddings):
            raise ValueError(f"token ids must be in [0, {self.num_embeddings}), got range [{idx.min()}, {idx.max()}]")
        w = params["weight"]  # (V_i, C)
        local = idx.reshape(-1) - self.lo  # (N,)
        here = (local >= 0) & (local < self.hi - self.lo)
        out = np.zeros((local.size, self.dim), dtype=w.dtype)  # (N, C)
        out[here] = w[local[here]]
        reduce_from_tp(out, self.tp)
        return out.reshape(*idx.shape, self.dim), (local[here], here)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        rows, here = cache
        d2 = np.ascontiguousarray(dout.reshape(-1, self.dim)[here])  # (n, C): this rank's tokens
        dw = grads["weight"]
        if layer_kernels.use_fast(d2, dw) and d2.dtype == dw.dtype:
            layer_kernels.embedding_backward(np.ascontiguousarray(rows, dtype=np.int64), d2, dw)
        else:
            np.add.at(dw, rows, d2)
        return None  # no gradient flows into integer ids


class VocabParallelHead(Layer):
    """GPTEnds' "head" entry over this rank's vocabulary rows: logits_i = f(ln_f(h)) wte_i^T."""

    def __init__(self, ends, tp: TPGroup) -> None:
        self.ends, self.tp = ends, tp

    def forward(self, params, h, ctx):
        e = self.ends
        z, c_ln = e.ln_f.forward(e.sub(params, "ln_f"), h, ctx)  # (B, T, C)
        w = params["wte.weight"]  # (V_i, C)
        return np.matmul(copy_to_tp(z, self.tp), w.T), (z, c_ln)  # (B, T, V_i)

    def backward(self, params, cache, dout, grads, *, grads_zero=False):
        e = self.ends
        z, c_ln = cache
        w = params["wte.weight"]  # (V_i, C)
        d2 = dout.reshape(-1, w.shape[0])  # (N, V_i)
        grads["wte.weight"] += d2.T @ z.reshape(-1, w.shape[1])  # the embedding adds to the same rows
        dz = copy_to_tp_backward(np.ascontiguousarray((d2 @ w).reshape(z.shape)), self.tp)  # (B, T, C)
        return e.ln_f.backward(e.sub(params, "ln_f"), c_ln, dz, e.sub(grads, "ln_f"), grads_zero=grads_zero)


class VocabParallelCrossEntropy(Loss):
    """Cross-entropy over logits split by vocabulary (the module docstring); shapes as
    CrossEntropyLoss: out (N, [T,] V_i), target (N, [T]) with ids of the whole vocabulary."""

    metric_names = ("loss", "accuracy")

    def __init__(self, vocab_size: int, tp: TPGroup) -> None:
        self.vocab_size, self.tp = vocab_size, tp
        self.lo, self.hi = _check_vocab(vocab_size, tp)

    def _split(self, out, target):
        logits, y, T = CrossEntropyLoss._flatten(out, target)
        if logits.shape[1] != self.hi - self.lo:
            raise ValueError(f"rank {self.tp.rank} holds vocabulary [{self.lo}, {self.hi}), got logits {out.shape}")
        if y.size and (y.min() < 0 or y.max() >= self.vocab_size):
            raise ValueError(f"labels must be in [0, {self.vocab_size}), got range [{y.min()}, {y.max()}]")
        local = y - self.lo
        here = np.flatnonzero((local >= 0) & (local < self.hi - self.lo))
        return logits, T, here, local[here]

    def _softmax_parts(self, logits, here, cols):
        """(e = exp(logits - m), S = sum_k e over every rank, p = the target's z) per row."""
        m = logits.max(axis=1)  # (N,)
        self.tp.all_reduce(m, "max")
        z = logits - m[:, None]  # (N, V_i)
        sums = np.zeros((2, len(logits)), np.float64)  # [sum_k e, z of the target] per row
        sums[1, here] = z[here, cols]
        e = np.exp(z, out=z)  # in place: z is not needed past the target's
        sums[0] = e.sum(axis=1)
        self.tp.all_reduce(sums)
        return e, sums[0], sums[1]

    def forward_backward(self, out, target, denominator=None, dloss=1.0):
        logits, T, here, cols = self._split(out, target)
        denom = _denominator(out.shape[0], denominator) * T
        if len(logits) == 0:  # every rank of the tp group holds the same rows: none calls
            return 0.0, np.zeros_like(out)
        e, S, p = self._softmax_parts(logits, here, cols)
        loss = float((np.log(S) - p).sum()) / denom
        d = e  # e (a fresh (N, V_i) array) becomes the gradient in place: no second logits-sized array
        d /= S[:, None].astype(e.dtype, copy=False)  # softmax over the whole vocabulary
        d[here, cols] -= 1.0
        d *= dloss / denom
        return loss, d.reshape(out.shape)

    def forward(self, out, target, denominator=None):
        loss, d = self.forward_backward(out, target, denominator, 1.0)
        return loss, d

    def backward(self, cache, dloss=1.0):
        return cache * dloss

    def metrics(self, out, target):
        logits, T, here, cols = self._split(np.asarray(out, dtype=np.float64), target)
        if len(logits) == 0:
            return {"loss": 0.0, "accuracy": 0.0}
        _, S, p = self._softmax_parts(logits, here, cols)
        m = logits.max(axis=1)
        self.tp.all_reduce(m, "max")
        at_max = logits == m[:, None]  # (N, V_i)
        first = np.where(at_max.any(axis=1), self.lo + at_max.argmax(axis=1), self.vocab_size).astype(np.float64)
        self.tp.all_reduce(first, "min")  # the global arg-max's index
        y = np.asarray(target).reshape(-1)
        return {"loss": float((np.log(S) - p).sum()) / T, "accuracy": float((first == y).sum()) / T}
