"""Pipeline stages of any model: which of its calls each stage runs, balanced by parameter count,
and the stage's own Model.

What it is: a model's calls (trainer/nn/model.py) cut into pp contiguous runs, one per stage.
A unit called at several places (the GPT's tied unit 0: its embedding first, its head last)
pins its calls: the leading run of such calls to the first stage, the trailing run to the
last. The calls between (the body: the GPT's blocks, the MLP's units) are cut by
`stage_layers` (calls per stage, each stage at least one), and a unit both ends use lives on
the first AND the last stage (Megatron-LM's word-embedding copy: equal at the start, and
their gradients summed across the two stages, the mesh's embedding group, strategy.py).

    GPT, pp = 2, L = 4:  stage 0: units [0, 1, 2]  calls [embed, block 1, block 2]
                         stage 1: units [0, 3, 4]  calls [block 3, block 4, head]
    mlp(10, (12, 12), 3), pp = 2, balanced: stage 0: unit [0]   stage 1: units [1, 2]

Balancing ("by parameter count"): the cut that makes the largest stage as small as possible,
each body call costing its unit's numel and the pinned units counting on the first and last
stage (a dynamic program over the cut points; ties go to the earliest cut). A given list
(`--stage-layers 3,1`) is taken as it is after checks.

`stage_model(units, loss)`: a trainer.nn.Model of this stage's units (in global order) and
calls, whose units keep their GLOBAL index (the key of their dropout streams and their
initialisation), so a stage runs exactly the single-process model's part.

What it is not: no interleaved (virtual) stages, no cuts inside a unit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from trainer.nn.model import Call, Model

__all__ = ["balance", "pinned_ends", "PipelineLayout"]


def balance(block_costs: list[int], pp: int, ends_cost: int | tuple[int, int] = 0) -> list[int]:
    """Blocks (body calls) per stage (pp contiguous runs, each >= 1 block) minimising the largest
    stage's cost; the first and last stage also carry ``ends_cost`` (one for both, or (first, last)).
    E.g. balance([10] * 4, 2, 5) == [2, 2]."""
    L = len(block_costs)
    if pp < 1 or L < pp:
        raise ValueError(f"{L} blocks cannot fill {pp} pipeline stages (each stage needs at least one block): "
                         f"choose --pp <= {L}")
    first_cost, last_cost = ends_cost if isinstance(ends_cost, tuple) else (ends_cost, ends_cost)
    prefix = [0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> int:  # stage s runs blocks [a, b)
        return prefix[b] - prefix[a] + (first_cost if s == 0 else 0) + (last_cost if s == pp - 1 else 0)

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


def pinned_ends(calls) -> tuple[int, int]:
    """(calls pinned to the first stage, calls pinned to the last): the leading and trailing runs of
    calls whose unit is called more than once.

    Raises:
        ValueError: a unit called more than once with a call between the pinned runs.
    """
    shared = {u for u, n in Counter(c.unit for c in calls).items() if n > 1}
    head = 0
    while head < len(calls) and calls[head].unit in shared:
        head += 1
    tail = 0
    while tail < len(calls) - head and calls[len(calls) - 1 - tail].unit in shared:
        tail += 1
    for k in range(head, len(calls) - tail):
        if calls[k].unit in shared:
            raise ValueError(f"unit {calls[k].unit} is called at several places, one of them call {k} between "
                             f"the first and the last: a pipeline shares a unit only between its first and last "
                             f"stage, where its calls lead or trail the model's")
    return head, tail


@dataclass(frozen=True)
class PipelineLayout:
    """Stage ``stage`` of ``pp`` over ``calls`` (global unit indices): ``ends`` calls pinned to the
    first and to the last stage, the body between cut as ``layers`` (body calls per stage)."""
    pp: int
    stage: int
    layers: tuple[int, ...]  # body calls per stage, e.g. (2, 2)
    calls: tuple[Call, ...]  # every call of the model, e.g. the GPT's [embed, block 1 .. block L, head]
    ends: tuple[int, int] = (0, 0)  # e.g. (1, 1): the GPT's embed and head

    def __post_init__(self) -> None:
        if len(self.layers) != self.pp or any(n < 1 for n in self.layers):
            raise ValueError(f"stage layers {list(self.layers)} must give each of the {self.pp} stages at least "
                             f"one block")
        if sum(self.layers) + sum(self.ends) != len(self.calls):
            raise ValueError(f"stage layers {list(self.layers)} add up to {sum(self.layers)} blocks, the model has "
                             f"{len(self.calls) - sum(self.ends)}")
        if not 0 <= self.stage < self.pp:
            raise ValueError(f"stage {self.stage} is outside 0..{self.pp - 1}")

    @classmethod
    def build(cls, model: Model, pp: int, stage: int, layers=None) -> "PipelineLayout":
        """The layout of ``stage`` of ``model``: ``layers`` as given (checked), else balanced by the
        units' parameter counts (those of ``model``, the full one, so every tp rank cuts alike)."""
        calls = tuple(model.calls)
        head, tail = pinned_ends(calls)
        body = calls[head : len(calls) - tail]
        if layers is not None:
            layers = tuple(int(n) for n in layers)
            if sum(layers) != len(body):
                raise ValueError(f"stage layers {list(layers)} add up to {sum(layers)} blocks, the model has "
                                 f"{len(body)}")
        else:
            numel = [u.numel for u in model.units]
            ends = tuple(sum(numel[u] for u in {c.unit for c in run}) for run in (calls[:head], calls[len(calls) - tail:]))
            layers = tuple(balance([numel[c.unit] for c in body], pp, ends))
        return cls(pp, stage, layers, calls, (head, tail))

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def positions(self, stage: int | None = None) -> range:
        """The stage's calls as positions in ``calls`` (contiguous)."""
        s = self.stage if stage is None else stage
        head, tail = self.ends
        start = (head if s > 0 else 0) + sum(self.layers[:s])
        stop = head + sum(self.layers[: s + 1]) + (tail if s == self.pp - 1 else 0)
        return range(start, stop)

    def units(self, stage: int | None = None) -> list[int]:
        """Global unit indices the stage holds, in order."""
        return sorted({self.calls[k].unit for k in self.positions(stage)})

    def owner(self, unit: int) -> int:
        """The stage that saves and reports unit ``unit``: the first that holds it."""
        for s in range(self.pp):
            if unit in self.units(s):
                return s
        raise ValueError(f"unit {unit} is in no stage of the model's {len(self.calls)} calls")

    def shared(self) -> list[int]:
        """Units held by the first and the last stage both (pp > 1): their gradients are summed
        across the two (the mesh's embedding group)."""
        return sorted(set(self.units(0)) & set(self.units(self.pp - 1))) if self.pp > 1 else []

    def stage_calls(self) -> list[Call]:
        """This stage's calls over GLOBAL unit indices."""
        return [self.calls[k] for k in self.positions()]

    def stage_model(self, units: list, loss) -> Model:
        """A Model of this stage's units (``units``: every global unit, indexed by global index)
        whose units keep their global index."""
        held = self.units()
        local = {g: i for i, g in enumerate(held)}
        model = Model([units[g] for g in held], calls=[Call(local[c.unit], c.entry, c.checkpoint)
                                                      for c in self.stage_calls()], loss=loss)
        for g, unit in zip(held, model.units):
            unit.index = g  # dropout streams and initialisation follow the global model
        model.global_index = held
        return model
