"""The buddy's log and replay (trainer/sharding/redundancy.py): the copy a log brings up to date equals
the neighbour's stepped state exactly after K-1, K and K+1 steps; the log is emptied at each refresh
(the step after K logged ones, whose extra bytes are `refresh_bytes`) and never holds more than K
messages; `memory_nbytes` is what a rank holds with a full log."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from runtime.store import MemoryStore
from runtime.testing import run_ranks
from trainer.data import iter_local_batches, make_synthetic
from trainer.nn import mlp
from trainer.sharding import TrainConfig, make_strategy
from trainer.sharding.redundancy import Redundancy, memory_nbytes, refresh_bytes

pytestmark = pytest.mark.timeout(60)
K, WORLD = 3, 3
X, Y = make_synthetic(96, in_dim=5, num_classes=3, seed=3, dtype=np.float64)
F64 = dict(master_dtype="float64", param_dtype="float64", reduce_dtype="float64")


def config(**kw) -> TrainConfig:  # the clip bites (coef < 1): the replay must apply the step's coefficient
    return TrainConfig(**{**F64, "lr": 1e-2, "warmup_steps": 0, "total_steps": 8, "seed": 2, "clip_norm": 0.05, **kw})


def batches(world: int, rank: int) -> list:
    return [[(X[b.indices], Y[b.indices], b.offset, b.global_size)]
            for b in iter_local_batches(len(X), 16, world, rank, seed=1, epoch=0)]


def strategy(name: str, g, store, **kw):
    return make_strategy(name, mlp(5, (6,), 3, dtype=np.float64), config(**kw), g,
                         redundancy=Redundancy(store, timeout=5.0, refresh_every=K))


def own_state(s) -> list:
    """This rank's master shards and optimizer buffers (copies), and its optimizer step counters."""
    return [[s._master_shard(i).copy(), *(b.copy() for b in s.states[i].buffers.values()), s.states[i].step]
            for i in range(len(s.units))]


def replayed(el) -> list:
    """The copy ``el``'s log brings up to date, replayed on a clone (``el`` keeps its log): as own_state."""
    clone = copy.copy(el)
    clone._masters, clone._states, clone.log = copy.deepcopy((el._masters, el._states, el.log))
    clone.replay()
    assert clone.log == []
    return [[m, *st.buffers.values(), st.step] for m, st in zip(clone._masters, clone._states)]


def assert_exact(copy_state: list, neighbour: list, where) -> None:
    for i, (got, want) in enumerate(zip(copy_state, neighbour)):
        assert got[-1] == want[-1], (where, i, "optimizer step")
        for k, (a, b) in enumerate(zip(got[:-1], want[:-1])):
            assert a.dtype == b.dtype and np.array_equal(a, b), (where, i, k)


@pytest.mark.parametrize("name,kw", [("zero1", {}), ("zero2", {"loss_scale": True}), ("fsdp", {}),
                                     ("zero3", {"optimizer": "sgd"}),  # momentum and decay: the update reads p
                                     ("zero2", {"param_dtype": "float32", "reduce_dtype": "float32"})])
async def test_a_replayed_copy_equals_the_neighbours_state_and_a_refresh_empties_the_log(name, kw):
    store = MemoryStore()

    async def body(g):
        s = strategy(name, g, store, **kw)
        try:
            await s.setup()
            seen = []  # per step: (log length, own state, replayed copy, bytes sent)
            for mbs in batches(g.size, g.rank)[: K + 1]:
                sent = (await s.train_step(mbs)).comm_bytes
                seen.append((len(s.redundancy.log), own_state(s), replayed(s.redundancy), sent))
            await s.redundancy.refresh(s)  # every rank: the whole state again, the log emptied
            after = (s.redundancy.log, [[m, *st.buffers.values(), st.step] for m, st in
                                        zip(s.redundancy._masters, s.redundancy._states)])
            return seen, after, s.lengths, len(s.states[0].buffers)
        finally:
            s.close()

    per_rank = await run_ranks(WORLD, body)
    for r, (seen, (log, refreshed), lengths, buffers) in enumerate(per_rank):
        neighbour = per_rank[(r + 1) % WORLD][0]
        assert [n for n, *_ in seen] == [*range(1, K + 1), 1], r  # the step after K logged ones refreshed
        for t in (K - 2, K - 1, K):  # after K-1, K and K+1 steps
            assert_exact(seen[t][2], neighbour[t][1], (r, t + 1))
        assert log == []
        assert_exact(refreshed, neighbour[K][1], (r, "refreshed"))
        extra = seen[K][3] - seen[K - 1][3]  # the refresh step sent the whole state beside the usual message
        assert extra == refresh_bytes(lengths, WORLD, master_itemsize=8, buffers=buffers) > 0, r


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
async def test_the_stated_memory_is_what_a_rank_holds_with_a_full_log(name):
    store = MemoryStore()

    async def body(g):
        s = strategy(name, g, store)
        try:
            await s.setup()
            for mbs in batches(g.size, g.rank)[:K]:
                await s.train_step(mbs)
            el = s.redundancy
            held = sum(m.nbytes for m in el._masters) + sum(st.nbytes for st in el._states) + el.log_nbytes()
            return held, len(el.log), memory_nbytes(s), s.lengths
        finally:
            s.close()

    for held, logged, stated, lengths in await run_ranks(WORLD, body):
        shard = sum(length // WORLD for length in lengths) * 8  # float64 elements of a rank's shards
        if name == "ddp":
            assert (held, logged, stated) == (0, 0, 0)
        else:  # master, Adam's m and v, and K messages
            assert logged == K and held == stated == (3 + K) * shard


async def test_refresh_every_must_be_a_whole_number_of_steps():
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="refresh_every"):
            Redundancy(MemoryStore(), refresh_every=bad)


async def test_the_steps_receive_into_the_buffers_a_refresh_freed():
    """In the steady state no step allocates its message: the K buffers a refresh empties out of the
    log are the ones the next K steps receive into (and the replay stays exact, the test above)."""
    store = MemoryStore()

    async def body(g):
        s = strategy("zero1", g, store)
        try:
            await s.setup()
            periods = []  # per refresh period: the logged messages (held: no address is reused)
            for mbs in batches(g.size, g.rank)[: 2 * K + 1]:
                await s.train_step(mbs)
                if len(s.redundancy.log) == K:
                    periods.append([m for m, *_ in s.redundancy.log])
            return periods
        finally:
            s.close()

    for periods in await run_ranks(WORLD, body):
        assert len(periods) == 2 and len(periods[0]) == K
        first = {id(m) for m in periods[0]}
        assert {id(m) for m in periods[1]} == first  # the second period's messages are the first's buffers
