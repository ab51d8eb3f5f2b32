"""Bytes each rank holds follow the ZeRO paper's accounting (Rajbhandari et al. 2020).

float32 AdamW (params 4, grads 4, Adam m and v 8 bytes per parameter), P the
model's padded parameter count (pad_to = N), N ranks:

    ddp    16P          zero1  4P + 4P + 8P/N       zero2  4P + 4P/N + 8P/N       zero3  16P/N

checked exactly from memory_bytes() on the default digits model, plus the
gathered units in flight under zero3 (the unit computing and the one prefetched).
"""

import pytest

from runtime.testing import run_ranks
from trainer.data import iter_local_batches, make_synthetic
from trainer.nn import mlp
from trainer.sharding import TrainConfig, make_strategy

EXPECTED = {  # bytes per padded parameter: (params, grads, optim) as functions of N
    "ddp": lambda n: (4, 4, 8),
    "zero1": lambda n: (4, 4, 8 / n),
    "zero2": lambda n: (4, 4 / n, 8 / n),
    "zero3": lambda n: (4 / n, 4 / n, 8 / n),
}
X, Y = make_synthetic(128, in_dim=64, num_classes=10, seed=1)


async def measure(name: str, world: int, steps: int = 2, **config):
    async def body(group):
        model = mlp(64, (256, 256), 10, pad_to=group.size)  # the default model, float32
        strategy = make_strategy(name, model, TrainConfig(adam_kernel="numpy", **config), group)
        try:
            await strategy.setup()
            for b in list(iter_local_batches(len(X), 64, group.size, group.rank, seed=0))[:steps]:
                await strategy.train_step([(X[b.indices], Y[b.indices], b.offset, b.global_size)])
            return strategy.memory_bytes(), [u.padded_numel for u in model.units]
        finally:
            strategy.close()

    return await run_ranks(world, body)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", list(EXPECTED))
async def test_memory_follows_zero_accounting(name, world):
    for mem, unit_sizes in await measure(name, world):
        P = sum(unit_sizes)
        params, grads, optim = (int(round(k * P)) for k in EXPECTED[name](world))
        assert (mem["params"], mem["grads"], mem["optim"]) == (params, grads, optim), mem
        assert mem["total"] == params + grads + optim
        assert mem["transient_now"] == 0  # nothing unsharded survives a step
        if name == "zero3":
            # at most the unit computing and the next one (prefetch) are gathered at once
            adjacent = max(a + b for a, b in zip(unit_sizes, unit_sizes[1:]))
            assert mem["gathered_peak"] == 4 * adjacent
        else:
            assert mem["gathered_peak"] == 0


@pytest.mark.timeout(30)
async def test_zero3_gathered_units_follow_options():
    """No prefetch: one unit at a time; no resharding after forward: every unit, once."""
    (mem, sizes), *_ = await measure("zero3", 2, prefetch=False)
    assert mem["gathered_peak"] == 4 * max(sizes)
    (mem, sizes), *_ = await measure("zero3", 2, reshard_after_forward=False)
    assert mem["gathered_peak"] == 4 * sum(sizes)


@pytest.mark.timeout(30)
async def test_mixed_precision_memory():
    """bf16 compute: zero3 keeps a float32 master shard plus its bf16 cast (4P/N + 2P/N) and
    bf16 gathered units; ddp keeps the float32 master and a bf16 compute copy (4P + 2P)."""
    for mem, sizes in await measure("zero3", 4, steps=1, param_dtype="bfloat16"):
        P = sum(sizes)
        assert mem["params"] == (4 + 2) * P // 4 and mem["optim"] == 8 * P // 4
        assert mem["gathered_peak"] == 2 * max(a + b for a, b in zip(sizes, sizes[1:]))
    for mem, sizes in await measure("ddp", 2, steps=1, param_dtype="bfloat16", reduce_dtype="bfloat16"):
        P = sum(sizes)
        assert (mem["params"], mem["grads"], mem["optim"]) == (6 * P, 2 * P, 8 * P)
