"""Hybrid sharding (HSDP): a data-parallel dimension that shards within one group and replicates
across another.

What it is: `Replicas(replicate)`, the part zero1/2/3 and fsdp hold beside their shard group
(`make_strategy(name, model, config, group, replicate=R)`: the dp ranks are S shards x R
replicas), and `step_bytes`, the bytes each rank sends in one step. With R = 1 it does nothing.

    parameters, optimizer state  sharded within the shard group; replica 0's broadcast at setup,
                                 then every replica steps the same shard with the same gradient
    gradients                    reduce_scatter within the shard group, then the shard
                                 all_reduce(sum) across the replicas (no compression there),
                                 issued in the units' launch order (`turn`) on every replica
    loss, overflow, norm         summed over the shard group, then across the replicas; the sum
                                 of squares counted on replica 0 only (the others hold copies)
    checkpoints                  replica 0 writes the shards, the others nothing; loading is as
                                 without replicas (each rank reads the range of its shard)

Bytes per rank and applied step (ring volumes, as trainer/sharding/accounted.py counts them), unit
i padded to L_i, S shards, R replicas, e_p / e_r bytes per parameter / reduced gradient element:

    reduce_scatter    sum_i (S-1)/S L_i e_r            replica all_reduce   sum_i 2 (R-1)/R (L_i / S) e_r
    all_gather        zero1/2: sum_i (S-1)/S L_i e_p   fsdp: sum_i A g_i (S-1)/S L_i e_p
    statistics        2 (S-1)/S 24 + 2 (R-1)/R 24      (A micro-batches; g_i: fsdp_gathers)

What it is not: no compression of the replica all_reduce, no ddp (already every parameter replicated).
"""

from __future__ import annotations

import asyncio

import numpy as np

from trainer.sharding.accounted import AccountedCollectives

__all__ = ["Replicas", "step_bytes", "fsdp_gathers"]

STATS_NBYTES = 3 * 8  # the step's [loss, found_inf, sum of squares] in float64


class Replicas:
    """The replicate dimension (the module docstring); ``group`` None or of one rank: none."""

    def __init__(self, group=None) -> None:
        self.group = group if group is not None and group.size > 1 else None
        self.acc = AccountedCollectives(self.group) if self.group is not None else None
        self.size = self.group.size if self.group is not None else 1
        self.rank = self.group.rank if self.group is not None else 0
        self._last: _Turn | None = None  # the latest reduction's place in the replicas' order

    def accounted(self) -> list[AccountedCollectives]:
        return [self.acc] if self.acc is not None else []

    def turn(self) -> "_Turn | None":
        """A place in the replicas' order of reductions, taken by a launched reduction before its first
        await (the loop starts launched tasks in launch order, the same on every rank), so the
        replicas' all_reduces are issued in that order whichever shard group call ends first."""
        if self.acc is None:
            return None
        self._last = _Turn(self._last)
        return self._last

    async def reduce(self, shard: np.ndarray, turn: "_Turn | None") -> None:
        """A reduced gradient shard, summed in place over the replicas in ``turn``'s place (awaited
        inside the launched reduction of its unit, so the strategy's drain waits for it too)."""
        if turn is None:
            return
        if turn.before is not None:
            await turn.before.done  # the previous reduction issued and finished its all_reduce
        await self.acc.all_reduce(shard)

    @staticmethod
    def release(turn: "_Turn | None") -> None:
        """The reduction holding ``turn`` is over (done, failed or cancelled): the next may go."""
        if turn is not None and not turn.done.done():
            turn.done.set_result(None)

    async def broadcast(self, arrays: list[np.ndarray]) -> None:
        """Replica 0's arrays onto every replica, in place (setup: one initialisation for all)."""
        if self.acc is not None:
            for a in arrays:
                await self.acc.broadcast(a, 0)

    async def agree(self, stats: np.ndarray) -> None:
        """Sums the step's statistics over the replicas, in place (after the shard group's sum)."""
        if self.acc is not None:
            await self.acc.exposed(self.acc.all_reduce(stats))

    async def digests(self, mine: np.ndarray) -> np.ndarray:
        """Every replica's digest (int64 (1,) each), rank-major; just ``mine`` without replicas."""
        if self.acc is None:
            return mine.copy()
        every = np.zeros(self.size * mine.size, dtype=mine.dtype)
        await self.acc.all_gather(every, mine)
        return every

    def written(self, state: dict) -> dict:
        """``state`` as a checkpoint writes it from this rank: replicas other than 0 write no shard."""
        if self.rank == 0:
            return state
        shards = {name: np.asarray(a)[:0] for name, a in state["shards"].items()}
        layout = {name: {**lay, "replicated": False} for name, lay in state["layout"].items()}
        return {**state, "shards": shards, "layout": layout}

    @property
    def bytes_sent(self) -> int:
        return self.acc.bytes_sent if self.acc is not None else 0

    @property
    def comm_s(self) -> float:
        return self.acc.comm_s if self.acc is not None else 0.0


class _Turn:
    """One reduction's place in the replicas' order: the turn before it, and when it is over."""

    def __init__(self, before: "_Turn | None") -> None:
        self.before = before
        self.done = asyncio.get_running_loop().create_future()


def _ring(nbytes: int, factor: float, size: int) -> int:
    """A ring collective's bytes per rank, as AccountedCollectives counts them (truncated alike)."""
    return 0 if size == 1 else int(factor * (size - 1) / size * nbytes)


def fsdp_gathers(calls, reshard_after_forward: bool = True) -> list[int]:
    """All-gathers of each unit in one micro-batch of zero3/fsdp (trainer/sharding/fsdp.py): each
    forward call gathers its unit and each backward call again, but the unit of the last forward
    call, kept for its backward; without resharding a unit is gathered once per call, e.g. the GPT's
    tied unit 0 twice (its embed call's backward comes after the head's freed it)."""
    units = max(c.unit for c in calls) + 1
    out = [0] * units
    for c in calls:
        out[c.unit] += 2 if reshard_after_forward else 1
    if reshard_after_forward:
        out[calls[-1].unit] -= 1
    return out


def step_bytes(name: str, lengths: list[int], shard: int, replicate: int = 1, *, param_itemsize: int,
               reduce_itemsize: int, gathers: list[int] | None = None, micro_batches: int = 1) -> int:
    """Bytes one rank sends in an applied step of ``name`` (zero1 | zero2 | zero3 | fsdp) over
    ``shard`` x ``replicate`` data-parallel ranks (the module docstring's formula), uncompressed.

    Args:
        lengths: every unit's padded length (a multiple of ``shard``), e.g. strategy.lengths.
        gathers: zero3/fsdp: all-gathers per unit and micro-batch (fsdp_gathers(model.calls)).
        micro_batches: the step's micro-batches (zero3/fsdp gather in each).
    """
    if name in ("zero3", "fsdp") and gathers is None:
        raise ValueError(f"{name}: give the gathers per unit (fsdp_gathers(model.calls))")
    total = _ring(STATS_NBYTES, 2.0, shard) + _ring(STATS_NBYTES, 2.0, replicate)
    for i, length in enumerate(lengths):
        total += _ring(length * reduce_itemsize, 1.0, shard)  # reduce_scatter of the unit's gradient
        total += _ring(length // shard * reduce_itemsize, 2.0, replicate)  # its shard across the replicas
        times = 1 if name in ("zero1", "zero2") else gathers[i] * micro_batches
        total += times * _ring(length * param_itemsize, 1.0, shard)  # parameter all-gathers
    return total
