"""The GPT's units for one tensor-parallel rank, and the maps between their flat buffers and the
full model's.

What it is: `gpt_units(config, tp)` -> (every unit of the GPT for tp rank tp.rank, the loss).
At tp = 1 they are trainer.nn.gpt's own units and CrossEntropyLoss. At tp = t > 1 each unit is
a `ShardedUnit`: the same module tree with the tensor-parallel layers in place (tensor.py,
vocab.py) and beside it the full unit it cuts:

    unit 0   GPTEnds(wte=VocabParallelEmbedding, head=VocabParallelHead): wte rows [lo, hi) of V
    unit l   Block(attn=ParallelSelfAttention, mlp=ParallelMLP): heads [h0, h1), MLP columns
    loss     VocabParallelCrossEntropy

A ShardedUnit's flat buffer holds its parameters in the full unit's order and names, each cut
as its layer's `tp_split` says, or whole (replicated: LayerNorms, wpe, row-parallel biases).
`full_index(unit)` is, for every element of the local buffer, its position in the full unit's
flat buffer (None for an unsharded unit: the identity). It serves

    init          the full unit's initialisation (one seed), cut: a tp run starts from the
                  single-process parameters
    checkpoints   save the full layout (mesh-independent), load any layout (fullstate.py)
    full_params   gather the tp parts back into the full unit

`replicated_ranges(unit)`: the local ranges of replicated parameters (the global norm counts
them on tp rank 0 only).

Checks (`check_divides`): heads and widths must split over tp, the vocabulary must give every
rank a row; each a ValueError naming the flag to change.

What it is not: no parallel layers of its own (tensor.py, vocab.py), no strategy.
"""

from __future__ import annotations

import numpy as np

from trainer.nn.gpt import GPT, Block, GPTConfig, GPTEnds
from trainer.nn.layers import Container
from trainer.nn.unit import Unit
from trainer.parallel.tp_group import TPGroup
from trainer.parallel.tensor import ParallelMLP, ParallelSelfAttention
from trainer.parallel.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, VocabParallelHead

__all__ = ["check_divides", "ShardedUnit", "gpt_units", "full_index", "replicated_ranges", "split_of"]


def check_divides(config: GPTConfig, tp: int, pp: int) -> None:
    """Raises ValueError when the model does not split over tp x pp (the module docstring)."""
    if config.n_head % tp:
        raise ValueError(f"the GPT's {config.n_head} heads do not split over tp={tp}: choose --tp dividing "
                         f"--n-head")
    if config.vocab_size < tp:
        raise ValueError(f"a vocabulary of {config.vocab_size} tokens cannot split over tp={tp}")
    if config.n_layer < pp:
        raise ValueError(f"{config.n_layer} blocks cannot fill pp={pp} stages (each needs at least one block): "
                         f"choose --pp <= --n-layer")


def split_of(layer, name: str):
    """The Split of parameter ``name`` (dotted, as in param_shapes) of ``layer``, or None (whole)."""
    while isinstance(layer, Container):
        child, _, name = name.partition(".")
        layer = layer._by_name[child]
    fn = getattr(layer, "tp_split", None)
    return fn(name) if fn is not None else None


class ShardedUnit(Unit):
    """A unit holding this tp rank's parts of ``full``'s parameters (the module docstring)."""

    def __init__(self, module, full: Unit, *, dtype=np.float32, entries=None) -> None:
        self.full = None
        super().__init__(module, dtype=dtype, entries=entries)
        self.full = full
        mine, theirs = [s.name for s in self.param_specs], [s.name for s in full.param_specs]
        if mine != theirs:
            raise ValueError(f"a sharded unit must name the full unit's parameters in order: {mine} vs {theirs}")

    @Unit.index.setter
    def index(self, value: int) -> None:
        Unit.index.fset(self, value)
        if self.full is not None:
            self.full.index = value

    def full_index(self) -> np.ndarray:
        """(numel,) int64: where each local element sits in the full unit's flat buffer."""
        parts = []
        for mine, whole in zip(self.param_specs, self.full.param_specs):
            split = split_of(self.module, mine.name)
            if split is None:
                parts.append(np.arange(whole.offset, whole.end, dtype=np.int64))
                continue
            idx = np.arange(whole.offset, whole.end, dtype=np.int64).reshape(split.view)
            cut = np.take(idx, np.arange(split.lo, split.hi), axis=split.axis).reshape(-1)
            if cut.size != mine.numel:
                raise ValueError(f"{mine.name}: split {split} gives {cut.size} elements, the layer has {mine.numel}")
            parts.append(cut)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def replicated_ranges(self) -> list[tuple[int, int]]:
        """Local [lo, hi) of the parameters every tp rank holds whole."""
        return [(s.offset, s.end) for s in self.param_specs if split_of(self.module, s.name) is None]

    def init_params(self, seed: int, length: int | None = None, dtype=None) -> np.ndarray:
        """The full unit's initialisation from (seed, index), cut to this rank's parts."""
        full = self.full.init_params(seed, self.full.numel, np.float64)
        out = np.zeros(self.padded_numel if length is None else int(length), dtype=np.float64)
        out[: self.numel] = full[self.full_index()]
        return out.astype(self.dtype if dtype is None else dtype)


def full_index(unit: Unit) -> np.ndarray | None:
    return unit.full_index() if isinstance(unit, ShardedUnit) else None


def replicated_ranges(unit: Unit) -> list[tuple[int, int]]:
    return unit.replicated_ranges() if isinstance(unit, ShardedUnit) else []


def gpt_units(config: GPTConfig, tp: TPGroup, *, dtype=np.float32) -> tuple[list[Unit], object]:
    """Every unit of the GPT for tp rank ``tp.rank`` of ``tp.size``, and the loss."""
    full = GPT(config, dtype=dtype)
    if tp.size == 1:
        return full.units, full.loss
    check_divides(config, tp.size, 1)
    C = config.n_embd
    ends = GPTEnds(config, wte=VocabParallelEmbedding(config.vocab_size, C, tp))
    ends.head = VocabParallelHead(ends, tp)
    units = [ShardedUnit(ends, full.units[0], dtype=dtype, entries=ends.entries())]
    proj_std = 0.02 / np.sqrt(2 * config.n_layer)
    for block in range(1, config.n_layer + 1):
        attn = ParallelSelfAttention(C, config.n_head, tp, dropout=config.dropout, bias=config.bias,
                                     proj_init_std=proj_std, kernel=config.kernel)
        mlp = ParallelMLP(C, 4 * C, tp, gelu=config.gelu, dropout=config.dropout, bias=config.bias,
                          proj_init_std=proj_std, kernel=config.kernel)
        units.append(ShardedUnit(Block(config, attn=attn, mlp=mlp), full.units[block], dtype=dtype))
    for i, unit in enumerate(units):
        unit.index = i
    return units, VocabParallelCrossEntropy(config.vocab_size, tp)
