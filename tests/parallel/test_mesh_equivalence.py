"""dp x tp x pp equals single-process training: the float64 GPT on every mesh shape the trainer
offers, each data-parallel strategy on dp, both pipeline schedules, with and without gradient
accumulation, activation checkpointing and clipping: parameters after 3 steps, losses and gradient
norms to 1e-12, on every rank.

The matrix is not the full cross product (9 meshes x 5 strategies x 2 schedules x 8 variants);
each row runs one combination, chosen so that every mesh meets several strategies and variants,
every strategy runs on dp, tp and pp, and both schedules meet accumulation and checkpointing.
"""

import numpy as np
import pytest

from mesh_cases import CONFIG, assert_equals_reference, make_config, reference, step_batches, train_mesh
from runtime.testing import run_ranks
from tests.overflow import OverflowAt
from trainer.nn import GPT
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.sharding import TrainConfig, make_strategy

AC = {"activation_checkpointing": True}
ACC = {"grad_accum": 2}
CLIP = {"clip_norm": 0.3}
CASES = [  # (strategy, dp, tp, pp, schedule, micro-batches, variant)
    ("ddp", 1, 2, 1, "1f1b", 2, {**ACC, **AC}),
    ("zero1", 1, 4, 1, "1f1b", 1, CLIP),
    ("ddp", 1, 1, 2, "1f1b", 4, {}),
    ("zero2", 1, 1, 2, "gpipe", 4, {**ACC, **AC, **CLIP}),
    ("ddp", 1, 1, 4, "gpipe", 4, {}),
    ("fsdp", 1, 1, 4, "1f1b", 8, {**ACC, **AC}),
    ("ddp", 2, 2, 1, "1f1b", 2, ACC),
    ("zero1", 2, 1, 2, "1f1b", 4, {**AC, **CLIP}),
    ("ddp", 2, 1, 2, "gpipe", 2, {}),
    ("fsdp", 1, 2, 2, "1f1b", 4, {**ACC, **AC, **CLIP}),
    ("zero2", 1, 2, 2, "gpipe", 4, {}),
    ("zero3", 2, 2, 1, "1f1b", 2, {**ACC, **AC, **CLIP}),
    ("fsdp", 2, 2, 1, "1f1b", 1, {}),
    ("fsdp", 2, 2, 2, "1f1b", 4, {**ACC, **CLIP}),
]


def _id(case):
    name, dp, tp, pp, sched, m, variant = case
    return f"{name}-dp{dp}tp{tp}pp{pp}-{sched}-m{m}-{'+'.join(variant) or 'plain'}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
async def test_mesh_equals_single_process(case):
    name, dp, tp, pp, sched, m, variant = case
    want_params, want_losses, want_norms = reference(variant.get("clip_norm"))
    out = await train_mesh(name, dp=dp, tp=tp, pp=pp, parallel=ParallelConfig(schedule=sched, micro_batches=m),
                           **variant)
    assert len(out) == dp * tp * pp
    for params, results, strategy, _ in out:
        assert_equals_reference(params, results, want_params, want_losses, want_norms)
        assert strategy.memory_bytes()["transient_now"] == 0
    if variant.get("clip_norm"):
        assert all(n > variant["clip_norm"] for n in want_norms)  # the clip bit


@pytest.mark.timeout(60)
async def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_of_the_mesh():
    """Loss scaling is agreed across the whole mesh: an inf in one tp rank's gradient at the last stage
    skips step 1 everywhere (the scale halves on every rank), and the run equals one process with the
    same step skipped."""
    async def run(dp, tp, pp, at_rank):
        config = make_config(loss_scale=True)

        async def body(world):
            mesh = Mesh(world, dp=dp, tp=tp, pp=pp)
            s = make_parallel_strategy("zero2", CONFIG, config, mesh, parallel=ParallelConfig(micro_batches=2))
            try:
                await s.setup()
                if world.rank == at_rank:
                    s.model = OverflowAt(s.model, 1)  # this stage's backward puts an inf in unit 0 at step 1
                results = [await s.train_step(mbs) for mbs in step_batches(dp, mesh.coords["dp"], 1)[:3]]
                return results, await s.full_params()
            finally:
                s.close()

        return await run_ranks(dp * tp * pp, body)

    one = await run(1, 1, 1, 0)
    mesh = await run(1, 2, 2, 3)  # rank 3: the last stage, tp rank 1
    for results, params in mesh:
        assert [r.skipped for r in results] == [False, True, False]
        assert [r.loss_scale for r in results] == [2.0**16, 2.0**16, 2.0**15]
        for got, want in zip(params, one[0][1]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose([r.loss for r in results], [r.loss for r in one[0][0]], rtol=1e-12)


@pytest.mark.timeout(60)
async def test_float16_with_loss_scaling_on_a_mesh_equals_one_process_to_its_precision():
    """Mixed precision on tp2 x pp2: float16 compute copies, float32 master and reduction, dynamic loss
    scaling on; the same scale every step on every rank, the losses and parameters of one process
    to float32 summation order."""
    config = TrainConfig(lr=2e-2, seed=5, weight_decay=0.1, param_dtype="float16", init_scale=2.0**20)

    async def one(world):
        s = make_strategy("ddp", GPT(CONFIG), config, world)
        try:
            await s.setup()
            return [await s.train_step(mbs) for mbs in step_batches(1, 0, 1)], await s.full_params()
        finally:
            s.close()

    async def mesh(world):
        s = make_parallel_strategy("zero2", CONFIG, config, Mesh(world, tp=2, pp=2),
                                   parallel=ParallelConfig(micro_batches=2))
        try:
            await s.setup()
            return [await s.train_step(mbs) for mbs in step_batches(1, 0, 1)], await s.full_params()
        finally:
            s.close()

    [(want, want_params)] = await run_ranks(1, one)
    for results, params in await run_ranks(4, mesh):
        assert [r.loss_scale for r in results] == [r.loss_scale for r in want] == [2.0**20] * 3
        np.testing.assert_allclose([r.loss for r in results], [r.loss for r in want], rtol=1e-6)
        for got, ref in zip(params, want_params):
            np.testing.assert_allclose(got, ref, atol=1e-4)
