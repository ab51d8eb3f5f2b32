"""A Unit: one module whose parameters live in ONE flat, padded 1-D buffer.

What it is: the granularity at which sharding strategies work (FSDP gathers a unit's flat buffer
before its forward and frees it after; DDP/ZeRO reduce a unit's flat gradient as soon as its
backward finishes). The buffer layout comes from a size table, as llm.c's
`malloc_and_point_parameters`:

    param_specs = [ParamSpec(name, shape, offset), ...]  # contiguous, in order
    numel        = sum of the specs' sizes                # unpadded
    flat: [ 0.weight | 0.bias | 1.weight | 1.bias | ... | zero padding ]

Every layer weight is a view into the flat array; the padding is never read by a forward nor
written by a backward. Padding is the strategy's: it pads every unit to a multiple of its world
size (`padded_length(world)`), and the model runs on any flat buffer of at least `numel` elements.

Contract:
    forward(flat_params, x, ctx, entry=None) -> (out, cache)
        flat_params: ANY 1-D array of length >= numel (only viewed); entry: which of the
        module's entry points runs (None: the module; a unit called at two places names them)
    backward(flat_params, cache, dout, flat_grad, *, entry=None, grads_zero=False) -> dx
        ACCUMULATES (+=) into flat_grad, a 1-D array of length >= numel
    decay_segments(start, stop) -> [(lo, hi, decay)]
        the weight-decay groups of the elements [start, stop) (an optimizer's shard)
    output_shape(shape, entry=None) -> shape           the output's shape (pipeline stages)

What it is not: it owns no arrays; parameters, gradients and optimizer state all live outside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.nn.context import Context
from trainer.nn.layers import Layer, Sequential

__all__ = ["ParamSpec", "Unit", "round_up", "shard_bounds"]


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n, e.g. round_up(10, 4) == 12."""
    return -(-n // multiple) * multiple


def shard_bounds(length: int, rank: int, world_size: int) -> slice:
    """Rank `rank`'s contiguous equal part of a flat buffer of `length` (a multiple of the world size)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank} of {world_size}")
    if length % world_size:
        raise ValueError(f"a buffer of {length} elements does not split into {world_size} equal shards")
    size = length // world_size
    return slice(rank * size, (rank + 1) * size)


@dataclass(frozen=True)
class ParamSpec:
    name: str  # e.g. "0.weight"
    shape: tuple[int, ...]  # e.g. (64, 128)
    offset: int  # first element inside the flat buffer, e.g. 8192
    decay: bool = True  # weight decay applies (the layer's `decay(name)`), e.g. False for a bias

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def end(self) -> int:
        return self.offset + self.numel


class Unit:
    """A module (usually a Sequential) plus the flat-buffer layout of its parameters.

    Args:
        module: a Layer, or a list of layers that is wrapped in Sequential.
        pad_to: padded_numel is a multiple of this (the world size), e.g. 4.
        dtype: dtype of the buffers `init_params` / `zeros` make (float32, or float64
            for exact checks). forward/backward accept any dtype.
        index: position in the model; keys the dropout streams. Model sets it.
        entries: other entry points into the same parameters, {name: layer}, each
            taking the module's whole parameter dict (e.g. the GPT's "embed" and
            "head"); run with `forward(..., entry=name)`.
    """

    def __init__(self, module: Layer | list[Layer], *, pad_to: int = 1, dtype=np.float32, index: int = 0,
                 entries: dict[str, Layer] | None = None) -> None:
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
        self.module = Sequential(*module) if isinstance(module, (list, tuple)) else module
        self.entries: dict[str, Layer] = dict(entries or {})
        self.pad_to = int(pad_to)
        self.dtype = np.dtype(dtype)
        specs, offset = [], 0
        for name, shape in self.module.param_shapes():
            spec = ParamSpec(name, tuple(int(s) for s in shape), offset, bool(self.module.decay(name)))
            specs.append(spec)
            offset = spec.end
        self.param_specs: list[ParamSpec] = specs
        self.numel: int = offset
        self.padded_numel: int = round_up(offset, self.pad_to)
        self.index = index

    @property
    def index(self) -> int:
        return self._index

    @index.setter
    def index(self, value: int) -> None:
        self._index = int(value)
        self.module.bind((self._index,))

    def __repr__(self) -> str:
        return f"Unit(index={self.index}, numel={self.numel}, padded_numel={self.padded_numel}, pad_to={self.pad_to})"

    # ---- buffers ----------------------------------------------------------

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """name -> view of `flat` with the spec's shape (no copy); `flat` is 1-D with at
        least `numel` elements (padded or not: only the first numel are viewed)."""
        if flat is None or flat.ndim != 1 or flat.shape[0] < self.numel:
            raise ValueError(
                f"unit {self.index}: flat buffer must be 1-D with at least numel={self.numel} elements "
                f"(e.g. padded_numel={self.padded_numel}), got "
                f"{'None' if flat is None else f'shape {flat.shape}'}"
            )
        return {s.name: flat[s.offset : s.end].reshape(s.shape) for s in self.param_specs}

    def padded_length(self, world_size: int) -> int:
        """numel rounded up to a multiple of `world_size`: a strategy's flat buffer length."""
        return round_up(self.numel, world_size)

    def decay_segments(self, start: int, stop: int) -> list[tuple[int, int, bool]]:
        """[(lo, hi, decay)] tiling [0, stop - start): the elements [start, stop) of the flat
        buffer grouped by whether weight decay applies, adjacent groups merged; padding is
        not decayed (it stays zero either way). E.g. Linear(2, 2): (0, 4) -> [(0, 4, True)],
        (2, 6) -> [(0, 2, True), (2, 4, False)]."""
        out: list[tuple[int, int, bool]] = []
        for lo, hi, decay in [(s.offset, s.end, s.decay) for s in self.param_specs] + [(self.numel, stop, False)]:
            a, b = max(lo, start), min(hi, stop)
            if a >= b:
                continue
            if out and out[-1][2] == decay and out[-1][1] == a - start:
                out[-1] = (out[-1][0], b - start, decay)
            else:
                out.append((a - start, b - start, decay))
        return out

    def shard_slice(self, rank: int, world_size: int) -> slice:
        """The part of the flat buffer rank `rank` owns under ZeRO/FSDP sharding.

        Shards are contiguous and equal: [rank * S, (rank + 1) * S) with
        S = padded_numel // world_size, so world_size must divide padded_numel
        (build the model with pad_to = world_size or a multiple of it).
        """
        if 0 <= rank < world_size and self.padded_numel % world_size:  # a bad rank: shard_bounds says so
            raise ValueError(
                f"unit {self.index}: padded_numel={self.padded_numel} (pad_to={self.pad_to}) is not divisible by "
                f"world_size={world_size}; build the model with pad_to={world_size}"
            )
        return shard_bounds(self.padded_numel, rank, world_size)

    def zeros(self, dtype=None) -> np.ndarray:
        """A zero flat buffer (padded length), e.g. a gradient buffer."""
        return np.zeros(self.padded_numel, dtype=self.dtype if dtype is None else dtype)

    def init_params(self, seed: int, length: int | None = None, dtype=None) -> np.ndarray:
        """Deterministic parameters from (seed, unit index) only, in a flat buffer of
        `length` elements (default padded_numel; the tail is zero) of `dtype` (default the unit's).

        Values are drawn in float64 and then cast, so they do not depend on
        the padding, on the process, and (up to rounding) on the dtype.
        """
        length = self.padded_numel if length is None else int(length)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), self.index])))
        flat64 = np.zeros(length, dtype=np.float64)
        self.module.init(self.views(flat64), rng)
        return flat64.astype(self.dtype if dtype is None else dtype)

    # ---- compute ----------------------------------------------------------

    def _layer(self, entry: str | None) -> Layer:
        if entry is None:
            return self.module
        try:
            return self.entries[entry]
        except KeyError:
            raise ValueError(f"unit {self.index} has no entry {entry!r} (entries: {sorted(self.entries)})") from None

    def forward(self, flat_params: np.ndarray, x: np.ndarray, ctx: Context, entry: str | None = None
                ) -> tuple[np.ndarray, Any]:
        return self._layer(entry).forward(self.views(flat_params), x, ctx)

    def backward(self, flat_params: np.ndarray, cache: Any, dout: np.ndarray, flat_grad: np.ndarray, *,
                 entry: str | None = None, grads_zero: bool = False) -> np.ndarray:
        return self._layer(entry).backward(self.views(flat_params), cache, dout, self.views(flat_grad),
                                           grads_zero=grads_zero)

    def output_shape(self, shape: tuple[int, ...], entry: str | None = None) -> tuple[int, ...]:
        """The shape of ``forward``'s output for an input of ``shape`` (what a pipeline stage receives)."""
        return self._layer(entry).output_shape(tuple(shape))
