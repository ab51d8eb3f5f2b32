"""Hybrid sharding on a mesh: make_parallel_strategy takes the shard and replicate groups from the mesh
(`mesh["dp_shard"]`, `mesh["dp_replicate"]`), and dp = 2 replicas x 2 shards, beside tp or pp, equals
single-process training to 1e-12 in float64; ddp on such a mesh takes all of dp;
a checkpoint saved there loads on one rank. The mesh is trainer/parallel/mesh.py's
`Mesh(world, dp=4, replicate=2, ...)`.
"""

import numpy as np
import pytest

from mesh_cases import CONFIG, assert_equals_reference, make_config, reference, step_batches
from runtime.testing import run_ranks
from trainer import checkpoint
from trainer.nn import GPT
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.sharding import make_strategy


async def train_hybrid(name, *, tp=1, pp=1, steps=3, hook=None, **variant):
    config = make_config(**variant)

    async def body(world):
        mesh = Mesh(world, dp=4, tp=tp, pp=pp, replicate=2)
        s = make_parallel_strategy(name, CONFIG, config, mesh, parallel=ParallelConfig(micro_batches=2))
        try:
            await s.setup()
            results = [await s.train_step(mbs) for mbs in step_batches(4, mesh.coords["dp"], 1)[:steps]]
            extra = await hook(s) if hook is not None else None
            return await s.full_params(), results, s, extra
        finally:
            s.close()

    return await run_ranks(4 * tp * pp, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, tp, pp, variant", [("fsdp", 1, 2, {"clip_norm": 0.3}), ("zero2", 2, 1, {}),
                                                   ("zero1", 1, 1, {}), ("ddp", 1, 2, {})],
                         ids=["fsdp-pp2-clip", "zero2-tp2", "zero1", "ddp-pp2"])
async def test_two_replicas_of_two_shards_on_a_mesh_equal_single_process(name, tp, pp, variant):
    want_params, want_losses, want_norms = reference(variant.get("clip_norm"))
    for params, results, s, _ in await train_hybrid(name, tp=tp, pp=pp, **variant):
        assert_equals_reference(params, results, want_params, want_losses, want_norms)
        expected = (4, 1) if name == "ddp" else (2, 2)  # ddp replicates everything over all of dp
        assert (s.N, s.replicas.size) == expected


@pytest.mark.timeout(120)
async def test_a_checkpoint_of_a_hybrid_mesh_loads_on_one_rank(tmp_path):
    async def save(s):
        await checkpoint.save(s, tmp_path)

    out = await train_hybrid("fsdp", pp=2, hook=save)
    assert checkpoint.read_metadata(tmp_path)["mesh"] == {"pp": 2, "dp": 4, "tp": 1}

    async def load(group):
        s = make_strategy("zero1", GPT(CONFIG, dtype=np.float64), make_config(), group)
        try:
            await s.setup()
            checkpoint.load(s, tmp_path)
            return await s.full_params()
        finally:
            s.close()

    [params] = await run_ranks(1, load)
    for got, want in zip(params, out[0][0]):
        np.testing.assert_array_equal(got, want)
