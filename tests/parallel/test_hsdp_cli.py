"""HSDP through `python -m trainer --replicas R`: at 4 ranks as 2 replicas x 2 shard ranks, fsdp
trains the same steps as one process (float64, to 1e-12) and each rank sends, per step, exactly
the bytes of `trainer.sharding.hsdp.step_bytes` (the README's table, "Parallelism": the shard
group's reduce_scatter and all_gathers, the replicas' all_reduce of the gradient shard, the step's
statistics in both groups); at R = 1 that is what fsdp sends without replicas. A replica count
that does not fit the world is one line and exit 2 on every rank.
"""

import io

import pytest

from mesh_cases import MLP, assert_same_history, run_trainer
from runtime.testing import run_ranks
from trainer.cli import build_model, load_data, make_config, parse_args
from trainer.loop import fit, steps_per_epoch
from trainer.sharding import make_strategy
from trainer.sharding.hsdp import fsdp_gathers, step_bytes


def formula_bytes(args, shard: int, replicas: int) -> int:
    """step_bytes of one fsdp step (one micro-batch) of the model of ``args``, float64."""
    model = build_model(args, load_data(args))
    return step_bytes("fsdp", [u.padded_length(shard) for u in model.units], shard, replicas, param_itemsize=8,
                      reduce_itemsize=8, gathers=fsdp_gathers(model.calls))


@pytest.mark.timeout(60)
async def test_the_formula_at_one_replica_is_what_fsdp_sends_today():
    args = parse_args(MLP)
    data = load_data(args)
    config = make_config(args, steps_per_epoch(len(data.train), args.batch_size, args.grad_accum))

    async def body(world):
        strategy = make_strategy("fsdp", build_model(args, data), config, world)
        try:
            await strategy.setup()
            history = await fit(strategy, data, config, epochs=1, global_batch_size=args.batch_size, group=world,
                                progress_stream=io.StringIO(), summary_stream=io.StringIO())
            return [r.comm_bytes / r.steps for r in history.ranks]
        finally:
            strategy.close()

    per_step = (await run_ranks(2, body))[0]
    assert per_step == [formula_bytes(args, 2, 1)] * 2


@pytest.mark.timeout(60)
def test_a_replica_count_that_does_not_divide_dp_is_one_line_and_exit_2(tmp_path):
    code, out, _ = run_trainer([*MLP, "--replicas", "3"], tmp_path, ranks=2, timeout=50)
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert "[rank 0] trainer: error: dp=2 ranks do not split into replicate=3 replicas" in out, out[-3000:]
    assert "[rank 1] trainer: error" not in out and "epoch 1/2" not in out


@pytest.mark.timeout(240)
def test_hsdp_at_2x2_equals_one_process_and_sends_the_formula(tmp_path):
    code, out, one = run_trainer(MLP, tmp_path)
    assert code == 0, out[-3000:]
    code, out, hsdp = run_trainer([*MLP, "--replicas", "2"], tmp_path, ranks=4, timeout=200)
    assert code == 0, out[-3000:]
    assert "fsdp on 4 rank(s) (HSDP: 2 replicas x 2 shard ranks)" in out
    assert len(one["epochs"]) == 2
    assert_same_history(hsdp, one)
    formula = formula_bytes(parse_args(MLP), 2, 2)
    assert [rank["comm_bytes"] / rank["steps"] for rank in hsdp["ranks"]] == [formula] * 4
