"""The mesh: coordinates, groups made from new_group on every rank in one order, the sizes it refuses
and why; the pipeline's stages (balanced by parameter count) and the model checks."""

import numpy as np
import pytest

from runtime.testing import run_ranks
from trainer.nn import GPT, GPTConfig, Call, Model, mlp
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.parallel.tp_group import part
from trainer.parallel.gpt import check_divides
from trainer.parallel.offload import DiskOffload, make_offload_strategy
from trainer.parallel.pipeline import PipelineLayout, balance, pinned_ends
from trainer.parallel.strategy import MeshParallel
from trainer.sharding import TrainConfig, make_strategy
from trainer.sharding.ddp import DDPStrategy
from trainer.sharding.fsdp import FSDPStrategy
from trainer.sharding.parts import ModelParallel, NoOffload
from trainer.sharding.zero import ZeroStrategy


@pytest.mark.timeout(30)
async def test_coordinates_and_groups_of_an_8_rank_mesh():
    async def body(world):
        mesh = Mesh(world, tp=2, pp=2)  # dp: what is left
        groups = {d: mesh[d].ranks for d in ("tp", "dp", "pp")}
        ranks = {d: mesh[d].rank for d in ("tp", "dp", "pp")}
        return mesh.shape, mesh.coords, groups, ranks, mesh.embedding_group.ranks, len(world.runtime.groups)

    out = await run_ranks(8, body)
    for rank, (shape, coords, groups, ranks, emb, n_groups) in enumerate(out):
        assert shape == {"pp": 2, "dp": 2, "tp": 2}
        assert rank == (coords["pp"] * 2 + coords["dp"]) * 2 + coords["tp"]  # tp fastest
        assert ranks == {d: coords[d] for d in ("tp", "dp", "pp")}  # group rank == coordinate
        assert groups["tp"] == [rank - rank % 2, rank - rank % 2 + 1]  # contiguous: one host
        assert groups["dp"] == [r for r in range(8) if r % 2 == rank % 2 and r // 4 == rank // 4]
        assert groups["pp"] == [rank % 4, rank % 4 + 4]
        assert emb == [rank % 4, rank % 4 + 4]  # first and last stage
        # world, then every group of every axis on every rank (tp, dp_shard, the 1-rank dp_replicate
        # groups, pp; dp is dp_shard), then the embedding groups
        assert n_groups == 1 + 4 + 4 + 8 + 4 + 4


@pytest.mark.timeout(30)
async def test_sizes_that_do_not_multiply_are_refused_with_the_sizes_named():
    async def body(world):
        errors = []
        for kw in ({"tp": 4}, {"tp": 2, "pp": 2, "dp": 2}, {"tp": 0}, {"pp": 2, "dp": 2}):
            with pytest.raises(ValueError) as info:
                Mesh(world, **kw)
            errors.append(str(info.value))
        mesh = Mesh(world, tp=3)
        return errors, mesh.coordinate(5), mesh.rank_of(pp=0, dp=1, tp=2)

    errors, coordinate, rank = (await run_ranks(6, body))[0]
    assert "does not divide into tp=4 x pp=1" in errors[0]
    assert "dp=2 x tp=2 x pp=2 = 8 ranks, but the world has 6" in errors[1]
    assert "tp must be a positive integer, got 0" in errors[2]
    assert "dp=2 x tp=1 x pp=2 = 4 ranks, but the world has 6" in errors[3]
    assert coordinate == {"pp": 0, "dp": 1, "tp": 2} and rank == 5


@pytest.mark.timeout(30)
async def test_a_tensor_parallel_group_across_hosts_is_refused():
    async def body(world):
        world.runtime.nodes = ["a", "a", "b", "b"]  # what a two-host job knows (the launcher's layout)
        Mesh(world, tp=2)  # [0, 1] on a, [2, 3] on b: each tp group on one host
        Mesh(world, dp=2, pp=2)  # no tensor parallelism: nothing to check
        world.runtime.nodes = ["a", "b", "a", "b"]  # ranks dealt round-robin to hosts
        with pytest.raises(ValueError, match=r"tensor-parallel group \[0, 1\] spans hosts \['a', 'b'\]"):
            Mesh(world, tp=2)
        return True

    assert await run_ranks(4, body) == [True] * 4


def test_balance_by_parameter_count_and_the_stage_layouts():
    assert balance([10] * 4, 2, ends_cost=5) == [2, 2]
    assert balance([10] * 4, 2, ends_cost=25) == [2, 2]
    assert balance([10] * 6, 3, ends_cost=30) == [1, 4, 1]  # the ends weigh on the first and last stage
    assert balance([10] * 4, 2, ends_cost=(20, 0)) == [1, 3]  # on the first stage only
    assert balance([1, 1, 1, 9], 2) == [3, 1]
    assert balance([5] * 4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 pipeline stages"):
        balance([1, 1, 1], 4)
    gpt = GPT(GPTConfig(vocab_size=11, block_size=5, n_layer=4, n_head=4, n_embd=8))
    first, last = (PipelineLayout.build(gpt, 2, s) for s in (0, 1))
    assert first.layers == (2, 2) and first.ends == (1, 1)
    assert first.units() == [0, 1, 2] and last.units() == [0, 3, 4] and first.shared() == [0]
    assert [str(c.entry) for c in first.stage_calls()] == ["embed", "None", "None"]
    assert [str(c.entry) for c in last.stage_calls()] == ["None", "None", "head"]
    assert list(first.positions()) == [0, 1, 2] and list(last.positions()) == [3, 4, 5]
    assert [last.owner(u) for u in range(5)] == [0, 0, 0, 1, 1]
    middle = PipelineLayout.build(gpt, 3, 1, layers=(1, 2, 1))
    assert middle.units() == [2, 3] and middle.layers == (1, 2, 1) and middle.shared() == [0]
    with pytest.raises(ValueError, match="add up to 3 blocks, the model has 4"):
        PipelineLayout.build(gpt, 2, 0, layers=(2, 1))
    with pytest.raises(ValueError, match="at least one block"):
        PipelineLayout(2, 0, (4, 0), tuple(gpt.calls), (1, 1))


def test_any_model_is_cut_into_stages_by_its_calls():
    model = mlp(10, (12, 12), 3)  # numels 156, 180, 39: the first unit alone balances best
    assert pinned_ends(model.calls) == (0, 0)
    first, last = (PipelineLayout.build(model, 2, s) for s in (0, 1))
    assert first.layers == (1, 2) and first.units() == [0] and last.units() == [1, 2] and first.shared() == []
    assert [c.unit for c in last.stage_model(model.units, model.loss).calls] == [0, 1]  # local indices
    assert last.stage_model(model.units, model.loss).global_index == [1, 2]
    tied = Model(model.units, calls=[Call(0), Call(1), Call(2), Call(0)])
    assert pinned_ends(tied.calls) == (1, 1)
    with pytest.raises(ValueError, match="unit 1 is called at several places, one of them call 1"):
        pinned_ends([Call(0), Call(1), Call(1), Call(2)])


def test_models_that_do_not_divide_are_refused():
    config = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=6, n_embd=12)
    with pytest.raises(ValueError, match="6 heads do not split over tp=4"):
        check_divides(config, 4, 1)
    with pytest.raises(ValueError, match="2 blocks cannot fill pp=3"):
        check_divides(config, 2, 3)
    with pytest.raises(ValueError, match="vocabulary of 11 tokens cannot split over tp=12"):
        check_divides(GPTConfig(vocab_size=11, n_head=12, n_embd=24), 12, 1)
    check_divides(config, 3, 2)
    assert [part(11, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 11)]


@pytest.mark.timeout(30)
async def test_the_strategy_refuses_a_model_that_does_not_split_and_bad_micro_batches():
    config = TrainConfig(master_dtype="float64", param_dtype="float64", reduce_dtype="float64")

    async def body(world):
        mesh = Mesh(world, tp=2)
        with pytest.raises(ValueError, match="3 heads do not split over tp=2"):
            make_parallel_strategy("ddp", GPTConfig(vocab_size=8, n_head=3, n_embd=6, n_layer=1), config, mesh)
        with pytest.raises(ValueError, match="schedule must be one of"):
            ParallelConfig(schedule="zero-bubble")
        s = make_parallel_strategy("ddp", GPTConfig(vocab_size=8, block_size=4, n_head=2, n_embd=4, n_layer=1),
                                   config, mesh, parallel=ParallelConfig(micro_batches=3))
        try:
            await s.setup()
            x = np.zeros((2, 4), np.int64)
            with pytest.raises(ValueError, match="3 pipeline micro-batches do not divide evenly among the step's 2"):
                await s.train_step([(x, x, 0, 2), (x, x, 2, 2)])
        finally:
            s.close()
        return True

    assert await run_ranks(2, body) == [True, True]


@pytest.mark.timeout(30)
async def test_a_strategy_is_its_data_parallel_class_holding_its_parts(tmp_path):
    """No class is made per combination: a mesh strategy, an offloaded one and a plain one are the
    data-parallel strategy's own class, holding their parts as objects."""
    f64 = TrainConfig(master_dtype="float64", param_dtype="float64", reduce_dtype="float64")
    gpt = GPTConfig(vocab_size=8, block_size=4, n_head=2, n_embd=4, n_layer=2)

    async def body(world):
        made = [make_parallel_strategy("fsdp", GPT(gpt, dtype=np.float64), f64, Mesh(world, tp=2)),
                make_offload_strategy("zero2", mlp(4, (4,), 2), TrainConfig(offload="optimizer",
                                                                            offload_dir=str(tmp_path)), world),
                make_strategy("ddp", mlp(4, (4,), 2), f64, world)]
        try:
            return [(type(s), type(s.model_parallel), type(s.offload)) for s in made]
        finally:
            for s in made:
                s.close()

    for kinds in await run_ranks(2, body):
        assert kinds == [(FSDPStrategy, MeshParallel, NoOffload), (ZeroStrategy, ModelParallel, DiskOffload),
                         (DDPStrategy, ModelParallel, NoOffload)]
