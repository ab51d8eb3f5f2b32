"""The full model from a rank's parts: full parameters and checkpoints of a tp x pp mesh.

What it is: `FullLayout`, the part of MeshParallel (strategy.py) that maps between this rank's
stage units, cut for its tp rank (split.py) and sharded over dp by the data-parallel strategy,
and the FULL model's units (trainer/checkpoint.py's format: "unit3.param", "unit3.exp_avg", ...
in the layout of the unsharded unit), so any mesh and any data-parallel strategy loads them.

    full_params          every unit of the full model, unpadded, on every rank: the owning stage
                         gathers it over dp, then tp, and broadcasts it over the world
    full_state           state_dict in the full model's names: each local element carries its
                         full-layout position ("index"), or a "start" where the unit is not cut
    local_state          the reverse, for load_state_dict
    sharded_state_dict   what a checkpoint writes (collective over the mesh): per unit the owning
                         stage gathers each array over dp, then tp, and each of its dp x tp ranks
                         writes one contiguous part (memory: one full unit at a time); under
                         hybrid sharding replica 0's ranks write, the others nothing

What it is not: no checkpoint files (trainer/checkpoint.py), no training step (strategy.py).
"""

from __future__ import annotations

import numpy as np

from trainer.parallel.gpt import full_index
from trainer.parallel.split import split_units
from trainer.parallel.tp_group import TPGroup, part

__all__ = ["FullLayout"]


class FullLayout:
    """See the module docstring. ``units``: every unit for this tp rank (global index)."""

    def __init__(self, model, units: list, tp: TPGroup, layout, mesh, world_acc) -> None:
        self.model, self.units, self.tp, self.layout, self.mesh = model, units, tp, layout, mesh
        self.world_acc = world_acc
        self.global_index = layout.units()  # stage position -> global unit index
        self._tp_layouts: dict[int, list] = {}  # global unit -> every tp rank's unit (how it cuts)

    def _tp_units(self, g: int) -> list:
        """Unit g as every tp rank builds it (their cuts of the full unit)."""
        if g not in self._tp_layouts:
            size = self.tp.size
            self._tp_layouts[g] = [split_units(self.model, TPGroup.shape_only(t, size))[0][g]
                                   if t != self.tp.rank else self.units[g] for t in range(size)]
        return self._tp_layouts[g]

    async def _gather_tp(self, g: int, local: np.ndarray) -> np.ndarray:
        """Unit g's full flat buffer (unpadded) from every tp rank's unpadded local one (a unit no
        layer of which is cut is whole on every tp rank already)."""
        size = self.tp.size
        if size == 1 or full_index(self.units[g]) is None:
            return local
        units = self._tp_units(g)
        counts = [u.numel for u in units]
        width = max(counts)
        mine = np.zeros(width, local.dtype)
        mine[: local.size] = local
        every = np.empty(size * width, local.dtype)
        await self.tp.acc.all_gather(every, mine)
        full = np.empty(self.model.units[g].numel, local.dtype)
        for t, unit in enumerate(units):
            full[unit.full_index()] = every[t * width : t * width + counts[t]]
        return full

    async def _full_unit(self, s, i: int, shard: np.ndarray) -> np.ndarray:
        """Stage unit i of the full model from this rank's dp shard of one of its arrays."""
        return await self._gather_tp(self.global_index[i], await s._full_unit(i, shard))

    @staticmethod
    def _arrays(s, i: int) -> dict[str, np.ndarray]:
        arrays = {"param": s._master_shard(i)}
        arrays.update(s.states[i].buffers)
        return arrays

    async def full_params(self, s) -> list[np.ndarray]:
        """See Strategy.full_params: every unit of the FULL model, unpadded, on every rank."""
        out = []
        for g, whole in enumerate(self.model.units):
            owner = self.layout.owner(g)
            buf = np.empty(whole.numel, s.master_dtype)
            if self.layout.stage == owner:
                i = self.global_index.index(g)
                buf[:] = await self._full_unit(s, i, s._master_shard(i))
            await self.world_acc.broadcast(buf, self.mesh.rank_of(pp=owner, dp=0, tp=0))
            out.append(buf)
        return out

    def full_state(self, s, base: dict) -> dict:
        """state_dict in the names and layout of the FULL model (the module docstring)."""
        shards, layout = {}, {}
        for i, g in enumerate(self.global_index):
            index = full_index(s.units[i])
            numel = self.model.units[g].numel
            for key in self._arrays(s, i):
                local = base["layout"][f"unit{i}.{key}"]
                start, n = local["start"], len(base["shards"][f"unit{i}.{key}"])
                shards[f"unit{g}.{key}"] = base["shards"][f"unit{i}.{key}"]
                layout[f"unit{g}.{key}"] = ({"numel": numel, "start": start, "replicated": False} if index is None
                                            else {"numel": numel, "index": index[start : start + n],
                                                  "replicated": False})
        return {**base, "world_size": self.mesh.size, "rank": self.mesh.world.rank, "shards": shards,
                "layout": layout}

    def local_state(self, s, state: dict) -> dict:
        """A loaded state (full model's names) in the strategy's own names."""
        shards = {}
        for i, g in enumerate(self.global_index):
            for key in self._arrays(s, i):
                if f"unit{g}.{key}" in state["shards"]:
                    shards[f"unit{i}.{key}"] = state["shards"][f"unit{g}.{key}"]
        return {**state, "shards": shards}

    async def sharded_state_dict(self, s) -> dict:
        """What a checkpoint writes (the module docstring). Collective over the whole mesh."""
        base = s.state_dict()  # its "layout" and "shards" are replaced below
        shards, layout = {}, {}
        writers = s.N * self.tp.size  # one shard group x tp of the owning stage writes each unit
        writer = s.rank * self.tp.size + self.tp.rank
        for i, g in enumerate(self.global_index):
            if self.layout.owner(g) != self.layout.stage:
                continue  # a tied unit's second copy: the first stage saves it
            numel = self.model.units[g].numel
            lo, hi = part(numel, writer, writers)
            for key, shard in self._arrays(s, i).items():
                full = await self._full_unit(s, i, shard)
                shards[f"unit{g}.{key}"] = full[lo:hi].copy()
                layout[f"unit{g}.{key}"] = {"numel": numel, "start": lo, "replicated": False}
                del full
        state = {**base, "shards": shards, "layout": layout, "mesh": dict(self.mesh.shape)}
        return s.replicas.written(state)
