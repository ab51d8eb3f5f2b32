"""Checkpoints are mesh-independent: saved at tp=2 pp=2 they load at dp=4, on one rank and on another
mesh, and a data-parallel checkpoint loads on a mesh; each run then takes the third step and equals
three steps of single-process training (parameters to 1e-12), optimizer state and step included."""

import numpy as np
import pytest

from mesh_cases import CONFIG, make_config, reference, step_batches, train_mesh
from runtime.testing import run_ranks
from trainer import checkpoint
from trainer.nn import GPT
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.sharding import make_strategy


def saver(path):
    async def save(strategy):
        await checkpoint.save(strategy, path)
        return await strategy.full_params()
    return save


async def third_step(path, *, strategy: str, world: int, mesh: dict | None = None):
    """Loads ``path`` on ``world`` ranks (a plain data-parallel strategy, or a mesh) and runs step 3."""
    config = make_config()

    async def body(group):
        if mesh is None:
            s, dp, dp_rank = make_strategy(strategy, GPT(CONFIG, dtype=np.float64), config, group), world, group.rank
        else:
            m = Mesh(group, **mesh)
            s = make_parallel_strategy(strategy, CONFIG, config, m, parallel=ParallelConfig(micro_batches=2))
            dp, dp_rank = m.shape["dp"], m.coords["dp"]
        try:
            await s.setup()
            meta = checkpoint.load(s, path)
            result = await s.train_step(step_batches(dp, dp_rank, 1)[2])
            return meta, result, await s.full_params()
        finally:
            s.close()

    return await run_ranks(world, body)


@pytest.mark.timeout(120)
async def test_saved_at_tp2_pp2_it_loads_at_dp4_on_one_rank_and_on_another_mesh(tmp_path):
    want_params, want_losses, _ = reference()
    saved = await train_mesh("zero2", tp=2, pp=2, steps=2, parallel=ParallelConfig(micro_batches=2),
                             body_hook=saver(tmp_path))
    meta = checkpoint.read_metadata(tmp_path)
    assert meta["mesh"] == {"pp": 2, "dp": 1, "tp": 2} and meta["step"] == 2
    assert [u["numel"] for u in meta["units"]] == [u.numel for u in GPT(CONFIG).units]  # the full layout
    files = checkpoint.read_full_params(tmp_path)
    full_at_save = saved[0][3]
    for i, unit in enumerate(GPT(CONFIG).units):  # what was saved is the full model's parameters
        got = np.concatenate([files[f"{i}.{s.name}"].reshape(-1) for s in unit.param_specs])
        np.testing.assert_array_equal(got, full_at_save[i])
    for strategy, world, mesh in [("ddp", 4, None), ("fsdp", 4, None), ("zero1", 1, None),
                                  ("zero3", 4, {"dp": 2, "pp": 2}), ("ddp", 4, {"tp": 4})]:
        for meta, result, params in await third_step(tmp_path, strategy=strategy, world=world, mesh=mesh):
            assert meta["step"] == 2
            np.testing.assert_allclose(result.loss, want_losses[2], rtol=1e-12)
            for i, (got, want) in enumerate(zip(params, want_params)):
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{strategy} {mesh} unit {i}")


@pytest.mark.timeout(60)
async def test_a_data_parallel_checkpoint_loads_on_a_mesh(tmp_path):
    want_params, want_losses, _ = reference()
    config = make_config()

    async def save(group):
        s = make_strategy("zero3", GPT(CONFIG, dtype=np.float64), config, group)
        try:
            await s.setup()
            for mbs in step_batches(2, group.rank, 1)[:2]:
                await s.train_step(mbs)
            await checkpoint.save(s, tmp_path)
        finally:
            s.close()

    await run_ranks(2, save)
    for meta, result, params in await third_step(tmp_path, strategy="fsdp", world=4, mesh={"tp": 2, "pp": 2}):
        np.testing.assert_allclose(result.loss, want_losses[2], rtol=1e-12)
        for got, want in zip(params, want_params):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
