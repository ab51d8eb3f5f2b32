"""Pipeline stages of the GPT: which blocks each stage runs, balanced by parameter count, and the
stage's own Model.

What it is: the GPT's units are [ends, block 1, ..., block L] and its calls
[embed, block 1 .. block L, head] (trainer/nn/gpt.py). `stage_layers` cuts the L blocks into
pp contiguous runs; stage s runs its blocks, the first stage also the embedding, the last also
the head. The tied token embedding (unit 0) therefore lives on the first AND the last stage
(Megatron-LM's word-embedding copy): the two copies start equal (one seed) and stay equal
because their gradients are summed across the two stages before the optimizer steps them
(the mesh's embedding group, trainer/parallel/strategy.py).

    pp = 2, L = 4:  stage 0: units [0, 1, 2]  calls [embed, block 1, block 2]
                    stage 1: units [0, 3, 4]  calls [block 3, block 4, head]

Balancing ("by parameter count"): the cut that makes the largest stage, counting the ends
unit on the first and last stage, as small as possible (a dynamic program over the cut
points; ties go to the earliest cut), every stage at least one block. A given list
(`--stage-layers 3,1`) is taken as it is after checks.

`stage_model(units, loss)`: a trainer.nn.Model of this stage's units and calls. Its units keep
their GLOBAL index (the key of their dropout streams and their initialisation), so a stage
runs exactly the single-process model's part.

What it is not: no interleaved (virtual) stages, no cuts inside a block.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.nn.model import Call, Model

__all__ = ["balance", "PipelineLayout"]


def balance(block_costs: list[int], pp: int, ends_cost: int = 0) -> list[int]:
    """Blocks per stage (pp contiguous runs, each >= 1 block) minimising the largest stage's cost;
    the first and last stage also carry ``ends_cost``. E.g. balance([10] * 4, 2, 5) == [2, 2]."""
    L = len(block_costs)
    if pp < 1 or L < pp:
        raise ValueError(f"{L} blocks cannot fill {pp} pipeline stages (each stage needs at least one block): "
                         f"choose --pp <= {L}")
    prefix = [0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> int:  # stage s runs blocks [a, b)
        return prefix[b] - prefix[a] + (ends_cost if s == 0 or s == pp - 1 else 0)

    INF = float("inf")
    # best[s][j]: the smallest largest-stage cost of stages 0..s covering blocks [0, j)
    best = [[INF] * (L + 1) for _ in range(pp)]
    cut = [[0] * (L + 1) for _ in range(pp)]
    for j in range(1, L + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, pp):
        for j in range(s + 1, L + 1):
            for a in range(s, j):  # stage s runs [a, j)
                value = max(best[s - 1][a], cost(s, a, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, a
    sizes, j = [], L
    for s in range(pp - 1, 0, -1):
        a = cut[s][j]
        sizes.append(j - a)
        j = a
    sizes.append(j)
    return sizes[::-1]


@dataclass(frozen=True)
class PipelineLayout:
    """Stage `stage` of `pp` over a GPT of `n_layer` blocks cut as `layers` (blocks per stage)."""
    pp: int
    stage: int
    layers: tuple[int, ...]  # blocks per stage, e.g. (2, 2)

    def __post_init__(self) -> None:
        if len(self.layers) != self.pp or any(n < 1 for n in self.layers):
            raise ValueError(f"stage layers {list(self.layers)} must give each of the {self.pp} stages at least "
                             f"one block")
        if not 0 <= self.stage < self.pp:
            raise ValueError(f"stage {self.stage} is outside 0..{self.pp - 1}")

    @classmethod
    def build(cls, n_layer: int, pp: int, stage: int, layers=None, block_costs=None, ends_cost: int = 0):
        """The layout of ``stage``: ``layers`` as given (checked), else balanced by parameter count."""
        if layers is not None:
            layers = tuple(int(n) for n in layers)
            if sum(layers) != n_layer:
                raise ValueError(f"stage layers {list(layers)} add up to {sum(layers)} blocks, the model has "
                                 f"{n_layer}")
        else:
            layers = tuple(balance(list(block_costs or [1] * n_layer), pp, ends_cost))
        return cls(pp, stage, layers)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def n_layer(self) -> int:
        return sum(self.layers)

    def blocks(self, stage: int | None = None) -> range:
        """The global unit indices of the stage's blocks (blocks are units 1..L)."""
        s = self.stage if stage is None else stage
        start = 1 + sum(self.layers[:s])
        return range(start, start + self.layers[s])

    def units(self, stage: int | None = None) -> list[int]:
        """Global unit indices the stage holds, in order: 0 (first or last stage), then its blocks."""
        s = self.stage if stage is None else stage
        ends = [0] if s == 0 or s == self.pp - 1 else []
        return ends + list(self.blocks(s))

    def owner(self, unit: int) -> int:
        """The stage that saves and reports unit ``unit`` (unit 0: the first)."""
        if unit == 0:
            return 0
        for s in range(self.pp):
            if unit in self.blocks(s):
                return s
        raise ValueError(f"unit {unit} is not in the model's {self.n_layer} blocks")

    def calls(self) -> list[Call]:
        """The stage's calls over GLOBAL unit indices (the GPT's calls, cut)."""
        calls = [Call(0, "embed")] if self.first else []
        calls += [Call(u, checkpoint=True) for u in self.blocks()]
        return calls + ([Call(0, "head")] if self.last else [])

    def stage_model(self, units: list, loss) -> Model:
        """A Model of this stage's units (``units``: every global unit, indexed by global index)
        whose units keep their global index."""
        held = self.units()
        local = {g: i for i, g in enumerate(held)}
        model = Model([units[g] for g in held], calls=[Call(local[c.unit], c.entry, c.checkpoint)
                                                      for c in self.calls()], loss=loss)
        for g, unit in zip(held, model.units):
            unit.index = g  # dropout streams and initialisation follow the global model
        model.global_index = held
        return model
