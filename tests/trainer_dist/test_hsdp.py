"""Hybrid sharding (HSDP) at strategy level: 4 in-process ranks as 2 replicas x 2 shards (groups made
with new_group) equal single-process training to 1e-12 in float64 for zero1, zero2, zero3 and fsdp;
every rank sends exactly the bytes of trainer/sharding/hsdp.py's formula each step (the strategy's
accounted collectives); the replicas start from replica 0's parameters; a checkpoint holds each shard
once (replica 0's ranks write, the others nothing) and loads onto another layout, and a plain one loads
onto HSDP; replicas that drift apart are named; ddp and a wrong world are refused.
"""

import os

import numpy as np
import pytest

from dist_helpers import STEPS, make_config, reference_run, step_batches, tiny_model
from runtime.testing import run_ranks
from trainer import checkpoint
from trainer.sharding import ReplicaMismatchError, make_strategy
from trainer.sharding.hsdp import fsdp_gathers, step_bytes

SHARDS, REPLICAS = 2, 2


def hybrid_groups(world):
    """(shard group, replicate group) of this rank: shards [0, 1] [2, 3], replicas [0, 2] [1, 3]; every
    rank makes every group in one order."""
    made = {}
    for members in ([0, 1], [2, 3], [0, 2], [1, 3]):
        group = world.new_group(members)
        if world.rank in members:
            made["shard" if members[1] - members[0] == 1 else "replicate"] = group
    return made["shard"], made["replicate"]


async def train_hybrid(name, config, *, steps=STEPS, seed_of=None, hook=None):
    async def body(world):
        shard, replicate = hybrid_groups(world)
        cfg = seed_of(replicate.rank) if seed_of else config
        s = make_strategy(name, tiny_model(), cfg, shard, replicate=replicate)
        try:
            await s.setup()
            first = await s.full_params()
            results = [await s.train_step(mbs) for mbs in step_batches(world.size, world.rank, config.grad_accum)[:steps]]
            extra = await hook(s, world) if hook is not None else None
            return await s.full_params(), results, s, first, extra
        finally:
            s.close()

    return await run_ranks(SHARDS * REPLICAS, body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", [{}, {"grad_accum": 2, "clip_norm": 0.5}], ids=["plain", "accum+clip"])
@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "fsdp"])
async def test_two_replicas_of_two_shards_equal_single_process_and_send_the_formula(name, variant):
    config = make_config(**variant)
    want_params, want_losses = reference_run(config)
    for params, results, s, _, _ in await train_hybrid(name, config):
        for i, (got, want) in enumerate(zip(params, want_params)):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"unit {i}")
        np.testing.assert_allclose([r.loss for r in results], want_losses, rtol=1e-12)
        assert s.group.size == 4 and (s.N, s.replicas.size) == (SHARDS, REPLICAS)
        accums = [len(mbs) for mbs in step_batches(4, 0, config.grad_accum)[:STEPS]]  # the last step may be short

        def formula(replicas, A):
            return step_bytes(name, s.lengths, SHARDS, replicas, param_itemsize=8, reduce_itemsize=8,
                              gathers=fsdp_gathers(s.model.calls), micro_batches=A)

        assert [r.comm_bytes for r in results] == [formula(REPLICAS, A) for A in accums]
        # the replicas add an all_reduce of each reduced shard and of the statistics: 2 (R-1)/R = 1 at R = 2
        assert formula(REPLICAS, 1) - formula(1, 1) == sum(n // SHARDS * 8 for n in s.lengths) + 24


def test_the_formula_counts_what_it_says():
    lengths = [8, 4]  # padded to 2 shards
    # zero2, 2 shards x 3 replicas, float32 params, float64 reduction: per unit (S-1)/S L e_r + 2 (R-1)/R L/S e_r
    # + (S-1)/S L e_p, and the statistics 2 (S-1)/S 24 + 2 (R-1)/R 24
    want = (4 * 8 + 2 * 8) + int(4 / 3 * 4 * 8) + int(4 / 3 * 2 * 8) + (4 * 4 + 2 * 4) + 24 + int(4 / 3 * 24)
    assert step_bytes("zero2", lengths, 2, 3, param_itemsize=4, reduce_itemsize=8) == want
    assert fsdp_gathers(tiny_model().calls) == [2, 2, 1]  # the last forward call's unit stays for its backward
    assert fsdp_gathers(tiny_model().calls, reshard_after_forward=False) == [1, 1, 1]
    assert step_bytes("fsdp", [4], 1, 1, param_itemsize=4, reduce_itemsize=4, gathers=[3]) == 0  # one rank sends nothing
    with pytest.raises(ValueError, match="give the gathers per unit"):
        step_bytes("fsdp", lengths, 2, param_itemsize=4, reduce_itemsize=4)


@pytest.mark.timeout(60)
async def test_every_replica_starts_from_replica_0s_parameters():
    """Replica 1 is built with another seed: setup hands it replica 0's parameters all the same."""
    base = make_config()
    out = await train_hybrid("fsdp", base, steps=0, seed_of=lambda r: make_config(seed=base.seed + r))
    want = tiny_model().init_params(base.seed)
    for _, _, _, first, _ in out:
        for got, unit, w in zip(first, tiny_model().units, want):
            np.testing.assert_array_equal(got, w[: unit.numel])


@pytest.mark.timeout(60)
async def test_a_checkpoint_holds_each_shard_once_and_loads_onto_any_layout(tmp_path):
    config = make_config()
    want_params, _ = reference_run(config)

    async def save(s, world):
        await s.check_replicas()
        await checkpoint.save(s, tmp_path / "hybrid")
        return None

    await train_hybrid("zero2", config, hook=save)
    step_dir = checkpoint.latest(tmp_path / "hybrid")
    written = {d: sorted(os.listdir(step_dir / d)) for d in os.listdir(step_dir) if d.startswith("rank")}
    # ranks 0 and 1 are replica 0 (their shards); ranks 2 and 3, replica 1, write only their index
    assert [len(written[f"rank{r:05d}"]) > 1 for r in range(4)] == [True, True, False, False]

    async def load_plain(group):  # onto one rank of ddp (which saves it again, plain), and 3 ranks of fsdp
        s = make_strategy("ddp" if group.size == 1 else "fsdp", tiny_model(), config, group)
        try:
            await s.setup()
            checkpoint.load(s, step_dir)
            if group.size == 1:
                await checkpoint.save(s, tmp_path / "plain")
            return await s.full_params()
        finally:
            s.close()

    for world in (1, 3):
        for params in await run_ranks(world, load_plain):
            for got, want in zip(params, want_params):
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)

    async def plain_onto_hybrid(world):  # the plain checkpoint, loaded on 2 x 2 fsdp
        shard, replicate = hybrid_groups(world)
        s = make_strategy("fsdp", tiny_model(), config, shard, replicate=replicate)
        try:
            await s.setup()
            checkpoint.load(s, checkpoint.latest(tmp_path / "plain"))
            await s.check_replicas()
            return await s.full_params()
        finally:
            s.close()

    for params in await run_ranks(4, plain_onto_hybrid):
        for got, want in zip(params, want_params):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
async def test_replicas_that_drift_apart_are_named_and_wrong_layouts_refused():
    async def body(world):
        shard, replicate = hybrid_groups(world)
        with pytest.raises(ValueError, match="ddp replicates every parameter already"):
            make_strategy("ddp", tiny_model(), make_config(), shard, replicate=replicate)
        with pytest.raises(ValueError, match=r"2 shards x 2 replicas need a world of 4 ranks, got 2"):
            make_strategy("zero2", tiny_model(), make_config(), shard, replicate=replicate, world=shard)
        s = make_strategy("fsdp", tiny_model(), make_config(), shard, replicate=replicate)
        try:
            await s.setup()
            await s.check_replicas()
            if world.rank == 3:  # replica 1's copy of shard 1
                s.master[0][0] += 1.0
            try:
                await s.check_replicas()
            except ReplicaMismatchError as exc:
                return str(exc), exc.ranks
            return None
        finally:
            s.close()

    out = await run_ranks(4, body)
    assert out[0] is None and out[2] is None  # replicas of shard 0 agree
    for message, ranks in (out[1], out[3]):  # replicate group [1, 3]: its rank 1 (world rank 3) differs
        assert "shards across replicas" in message and ranks == [1]
