"""Checkpoints and runs: metadata["run"] is {"id", "config"} exactly; keep_last prunes only the
saving run's own checkpoints, never another run's, an unnamed one or one whose metadata cannot be
read. Before, pruning kept the highest step numbers of the directory whoever wrote them, so a new
run's checkpoints were deleted in favour of an old run's."""

import json

import pytest

from dist_helpers import make_config, step_batches, tiny_model
from runtime.testing import run_ranks
from trainer import checkpoint
from trainer.sharding import make_strategy

pytestmark = pytest.mark.timeout(30)
A, B = "a" * 32, "b" * 32


def run(id):
    return {"id": id, "config": {"model": "mlp", "hidden": [16, 16], "seed": 0}}


def steps(root):
    return [int(p.name.split("-")[1]) for p in checkpoint.list_checkpoints(root)]


async def test_pruning_removes_only_the_saving_runs_own_checkpoints(tmp_path):
    # the saves, in order: (run or None for an unnamed save, keep_last)
    plan = [(None, 3), (B, 3), (A, 2), (A, 2), (A, 2), (B, 1)]

    async def body(group):
        strategy = make_strategy("ddp", tiny_model(), make_config(), group)
        try:
            await strategy.setup()
            batches = step_batches(1, 0, 1)
            for k, (who, keep) in enumerate(plan):
                await strategy.train_step(batches[k % len(batches)])
                await checkpoint.save(strategy, tmp_path, keep_last=keep, run=run(who) if who else None)
                if k == 0:  # a checkpoint whose metadata cannot be read: nobody's, never pruned
                    (tmp_path / "step-00000000").mkdir()
                    (tmp_path / "step-00000000" / checkpoint.METADATA).write_text("{not json")
        finally:
            strategy.close()

    await run_ranks(1, body)
    # A kept its newest 2 (4, 5); B's last save (keep 1) removed B's step 2 only; 0 and 1 are nobody's
    assert steps(tmp_path) == [0, 1, 4, 5, 6]
    meta = json.loads((tmp_path / "step-00000005" / checkpoint.METADATA).read_text())
    assert meta["run"] == run(A)  # exactly {"id", "config"}
    assert "run" not in json.loads((tmp_path / "step-00000001" / checkpoint.METADATA).read_text())


@pytest.mark.parametrize("bad", [{"id": "A" * 32, "config": {}}, {"id": A, "config": {"x": {"y": 1}}},
                                 {"id": A, "config": {}, "extra": 1}])
async def test_a_run_that_breaks_the_contract_is_refused_before_anything_is_written(tmp_path, bad):
    async def body(group):
        strategy = make_strategy("ddp", tiny_model(), make_config(), group)
        try:
            await strategy.setup()
            with pytest.raises(ValueError):
                await checkpoint.save(strategy, tmp_path / "ckpt", run=bad)
        finally:
            strategy.close()

    await run_ranks(1, body)
    assert not (tmp_path / "ckpt").exists()
