"""A model's units for one tensor-parallel rank, from what its layers declare.

What it is: `split_units(model, tp)` -> (every unit of ``model`` as tp rank tp.rank builds it, the
loss). The GPT keeps its own Megatron layout (gpt.py: heads, vocabulary). Any other Model is
cut by its layers' declarations (trainer/nn/layers.py, `split`): in a Sequential unit

    Linear(split="column")      -> ColumnParallelLinear   (its output features cut)
    LayerNorm(split="column")   -> SplitLayerNorm         (on the cut features, statistics summed)
    Dropout(split="column")     -> ColumnDropout          (the single-process mask's columns)
    Linear(split="row")         -> RowParallelLinear      (sums the parts: full features again)

and every undeclared layer stays whole on every rank (replicated). A unit holding a declared
layer becomes a ShardedUnit beside the full unit it cuts (initialisation, checkpoints and
full_params go through its index map); the others are the model's own (a copy). At tp = 1
nothing is cut.

`check_pairs(model)` walks the calls in order and refuses, with the layer named, a declaration
that leaves the features cut where a whole input is needed: a row Linear without a column one
before it, a column one never closed by a row one (the model's output must be whole), a cut
LayerNorm or dropout outside a pair, or any other layer with parameters inside one.

What it is not: no splits inside other containers (a Container other than Sequential that holds
a declaration is refused), no vocabulary-parallel loss for other models (their output is whole).
"""

from __future__ import annotations

import copy

from trainer.nn import GELU, GPT, Container, Dropout, Layer, LayerNorm, Linear, ReLU, Sequential
from trainer.parallel.gpt import ShardedUnit, check_divides, gpt_units
from trainer.parallel.tensor import ColumnDropout, ColumnParallelLinear, RowParallelLinear, SplitLayerNorm
from trainer.parallel.tp_group import TPGroup, part

__all__ = ["split_units", "check_pairs", "declares"]

ELEMENTWISE = (GELU, ReLU)  # layers without parameters that act on each feature alone


def declares(layer: Layer) -> bool:
    """Whether ``layer`` or a layer inside it declares a tensor-parallel split."""
    if layer.split is not None:
        return True
    return isinstance(layer, Container) and any(declares(child) for _, child in layer.children)


def _leaves(model) -> list[tuple[str, Layer]]:
    """(name, layer) of every layer the model's calls run, in order; a Sequential is opened."""
    out = []
    for c in model.calls:
        unit = model.units[c.unit]
        layer = unit.module if c.entry is None else unit.entries[c.entry]
        if isinstance(layer, Sequential):
            out += [(f"unit {c.unit} layer {j}", child) for j, child in enumerate(layer.layers)]
        else:
            if declares(layer):
                raise ValueError(f"unit {c.unit}: a {type(layer).__name__} holds a tensor-parallel declaration; "
                                 f"declare splits on the layers of a Sequential unit")
            out.append((f"unit {c.unit}", layer))
    return out


def check_pairs(model) -> None:
    """Raises ValueError unless the declarations pair up (the module docstring)."""
    cut = None  # the column Linear whose features are cut now, e.g. "unit 0 layer 0"
    for name, layer in _leaves(model):
        kind = layer.split
        if isinstance(layer, Linear) and kind == "column":
            if cut:
                raise ValueError(f"{name}: a column Linear while {cut}'s features are still cut (close it with a "
                                 f"row Linear first)")
            cut = name
        elif isinstance(layer, Linear) and kind == "row":
            if not cut:
                raise ValueError(f"{name}: a row Linear needs the cut features of a column Linear before it")
            cut = None
        elif kind == "column":  # LayerNorm, Dropout
            if not cut:
                raise ValueError(f"{name}: a {type(layer).__name__} declared 'column' outside a column/row pair")
        elif cut and not (isinstance(layer, ELEMENTWISE) or (isinstance(layer, Dropout) and layer.p == 0.0)):
            raise ValueError(f"{name}: a {type(layer).__name__} between {cut}'s column Linear and its row Linear "
                             f"would see only this rank's features: declare it split='column' (LayerNorm, Dropout)")
    if cut:
        raise ValueError(f"{cut}: a column Linear never closed by a row Linear: the model's output would stay cut")


def _split_layer(layer: Layer, tp: TPGroup, features: int | None) -> Layer:
    """``layer`` for tp rank tp.rank; ``features``: the width of the cut features before it."""
    if isinstance(layer, Linear) and layer.split == "column":
        return ColumnParallelLinear(layer.in_features, layer.out_features, tp, bias=layer.bias,
                                    init_std=layer.init_std)
    if isinstance(layer, Linear) and layer.split == "row":
        return RowParallelLinear(layer.in_features, layer.out_features, tp, bias=layer.bias, init_std=layer.init_std)
    if isinstance(layer, LayerNorm) and layer.split == "column":
        return SplitLayerNorm(layer.dim, tp, eps=layer.eps)
    if isinstance(layer, Dropout) and layer.split == "column":
        lo, hi = part(features, tp.rank, tp.size)
        return ColumnDropout(layer.p, features, lo, hi)
    return copy.deepcopy(layer)


def _split_sequential(module: Sequential, tp: TPGroup) -> Sequential:
    layers, features = [], None
    for layer in module.layers:
        layers.append(_split_layer(layer, tp, features))
        if isinstance(layer, Linear):
            features = layer.out_features
    return Sequential(*layers)


def split_units(model, tp: TPGroup, *, dtype=None) -> tuple[list, object]:
    """Every unit of ``model`` for tp rank ``tp.rank`` (global indices), and the loss (the module
    docstring). ``dtype``: the buffers' (default the model's units').

    Raises:
        ValueError: declarations that do not pair (check_pairs), a model that does not split over tp.
    """
    if isinstance(model, GPT):
        check_divides(model.config, tp.size, 1)
        return gpt_units(model.config, tp, dtype=dtype or model.units[0].dtype)
    check_pairs(model)
    full = copy.deepcopy(model.units)
    if tp.size == 1:
        return full, model.loss
    units = []
    for i, unit in enumerate(full):
        if unit.entries and declares(unit.module):
            raise ValueError(f"unit {i} has entry points and a tensor-parallel declaration: not split here")
        if declares(unit.module):
            unit = ShardedUnit(_split_sequential(unit.module, tp), unit, dtype=dtype or unit.dtype)
        unit.index = i
        units.append(unit)
    return units, model.loss
