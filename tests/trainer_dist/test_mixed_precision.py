"""Mixed precision across ranks: an injected overflow skips exactly that step on every rank
(even when only one rank's shard sees the inf), and bfloat16 / float16 training reaches
float32's validation accuracy on digits within 1 point."""

import numpy as np
import pytest

from dist_helpers import make_config, step_batches, tiny_model
from runtime.testing import run_ranks
from tests.overflow import OverflowAt
from trainer.data import iter_local_batches, load_digits_split, num_global_batches
from trainer.nn import mlp
from trainer.sharding import TrainConfig, make_strategy


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtypes", [
    {"param_dtype": "float64", "reduce_dtype": "float64"},
    {"param_dtype": "float16", "reduce_dtype": "float32", "master_dtype": "float32"},
    {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "master_dtype": "float32"},
], ids=["f64", "fp16-params", "bf16-all"])
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3"])
async def test_injected_overflow_skips_that_step_on_every_rank(name, dtypes):
    overflow_step, steps = 2, 5
    config = make_config(**dtypes, loss_scale=True, init_scale=2.0**10)

    async def body(group):
        # only rank 0's gradient gets the inf: under zero2/zero3 only rank 0's shard holds it
        model = tiny_model(group.size)
        strategy = make_strategy(name, OverflowAt(model, overflow_step) if group.rank == 0 else model, config, group)
        try:
            await strategy.setup()
            results, snapshots = [], []
            for mbs in step_batches(group.size, group.rank, 1)[:steps]:
                results.append(await strategy.train_step(mbs))
                snapshots.append(await strategy.full_params())
            return results, snapshots, strategy.state_dict()
        finally:
            strategy.close()

    for results, snapshots, state in await run_ranks(3, body):
        assert [r.skipped for r in results] == [k == overflow_step for k in range(steps)]
        for a, b in zip(snapshots[overflow_step - 1], snapshots[overflow_step]):
            np.testing.assert_array_equal(a, b)  # the skipped step changed nothing
        assert not all(np.array_equal(a, b) for a, b in zip(snapshots[overflow_step], snapshots[overflow_step + 1]))
        scales = [r.loss_scale for r in results]
        assert scales[: overflow_step + 1] == [2.0**10] * (overflow_step + 1)
        assert scales[overflow_step + 1 :] == [2.0**9] * (steps - overflow_step - 1)  # backed off once
        assert state["step"] == steps and state["optim_step"] == steps - 1
        assert all(np.isfinite(p).all() for p in snapshots[-1])


DIGITS_RECIPE = dict(lr=2e-3, weight_decay=0.01, adam_kernel="numba", seed=0)
EPOCHS, BATCH = 5, 64


async def train_digits(name: str, world: int, **dtypes) -> float:
    data = load_digits_split(seed=0)
    steps_per_epoch = num_global_batches(len(data.x_train), BATCH)
    config = TrainConfig(**DIGITS_RECIPE, **dtypes, warmup_steps=steps_per_epoch // 2,
                         total_steps=EPOCHS * steps_per_epoch, min_lr=2e-5)

    async def body(group):
        strategy = make_strategy(name, mlp(data.in_dim, (256, 256), data.num_classes, pad_to=group.size),
                                 config, group)
        try:
            await strategy.setup()
            for epoch in range(EPOCHS):
                for b in iter_local_batches(len(data.x_train), BATCH, group.size, group.rank, seed=0, epoch=epoch):
                    await strategy.train_step([(data.x_train[b.indices], data.y_train[b.indices], b.offset,
                                                b.global_size)])
            rows = np.array_split(np.arange(len(data.x_val)), group.size)[group.rank]
            return (await strategy.evaluate(data.x_val[rows], data.y_val[rows]))["accuracy"]
        finally:
            strategy.close()

    return sum(await run_ranks(world, body)) / len(data.x_val)


@pytest.mark.timeout(60)
async def test_bf16_and_fp16_reach_fp32_accuracy_on_digits():
    fp32 = await train_digits("zero3", 2)
    bf16 = await train_digits("zero3", 2, param_dtype="bfloat16", reduce_dtype="bfloat16")
    fp16 = await train_digits("ddp", 2, param_dtype="float16", reduce_dtype="float16")
    print(f"digits validation accuracy: fp32 {fp32:.4f}, bf16 {bf16:.4f}, fp16 {fp16:.4f}")
    assert fp32 >= 0.95
    assert bf16 >= fp32 - 0.01 and fp16 >= fp32 - 0.01
