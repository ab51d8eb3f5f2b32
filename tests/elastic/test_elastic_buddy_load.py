"""After a checkpoint is loaded into an elastic strategy (a resume, or the fallback when a shard had
no copy left), every rank's copy of its buddy's shard equals that shard again, bit for bit, before
the next step uses it: the copies are fetched afresh (Redundancy.refresh), not kept from set-up."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.store import MemoryStore
from runtime.testing import run_ranks
from trainer.data import iter_local_batches, make_synthetic
from trainer.nn import mlp
from trainer.sharding import TrainConfig, make_strategy
from trainer.sharding.redundancy import Redundancy

pytestmark = pytest.mark.timeout(60)
X, Y = make_synthetic(64, in_dim=5, num_classes=3, seed=3, dtype=np.float64)
CONFIG = TrainConfig(lr=1e-2, warmup_steps=0, total_steps=8, seed=2, master_dtype="float64", param_dtype="float64",
                     reduce_dtype="float64")


def batches(world: int, rank: int) -> list:
    return [[(X[b.indices], Y[b.indices], b.offset, b.global_size)]
            for b in iter_local_batches(len(X), 16, world, rank, seed=1, epoch=0)]


def copies_equal_buddies(strategies) -> bool:
    n = len(strategies)
    for r, s in enumerate(strategies):
        buddy = strategies[(r + 1) % n]
        for i in range(len(s.units)):
            if s.redundancy.masters[i].tobytes() != buddy._master_shard(i).tobytes():
                return False
            for key, buf in buddy.states[i].buffers.items():
                if s.redundancy.states[i].buffers[key].tobytes() != buf.tobytes():
                    return False
    return True


@pytest.mark.parametrize("name", ["zero2", "fsdp"])
async def test_buddy_copies_follow_a_loaded_checkpoint(name):
    trained, fresh = [None] * 3, [None] * 3
    stores = MemoryStore(), MemoryStore()  # each strategy's commit votes

    async def body(g):
        a = trained[g.rank] = make_strategy(name, mlp(5, (6,), 3, dtype=np.float64), CONFIG, g,
                                            redundancy=Redundancy(stores[0], timeout=5.0))
        b = fresh[g.rank] = make_strategy(name, mlp(5, (6,), 3, dtype=np.float64), CONFIG, g,
                                          redundancy=Redundancy(stores[1], timeout=5.0))
        try:
            await a.setup()
            await b.setup()
            steps = batches(g.size, g.rank)
            for mbs in steps[:3]:
                await a.train_step(mbs)
            b.load_state_dict(a.state_dict())  # a resume: each rank its own shards
            for s in (a, b):
                await s.train_step(steps[3])
            return await b.full_params(), await a.full_params()
        finally:
            a.close()
            b.close()

    results = await run_ranks(3, body)
    assert copies_equal_buddies(fresh), "the loaded strategy's buddy copies are not its buddies' shards"
    for got, want in results:
        for x, y in zip(got, want):
            assert x.tobytes() == y.tobytes()
