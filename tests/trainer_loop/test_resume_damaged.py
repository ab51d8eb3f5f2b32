"""--resume when the newest checkpoint is damaged: every rank falls back to the newest one that
loads on every rank (trainer.checkpoint.load_newest_valid), and says why. Before, the job
stopped with CheckpointError while an older checkpoint was intact (and under --max-restarts
it would have failed the same way at every restart)."""

import logging

import numpy as np
import pytest

from trainer import checkpoint
from tests.trainer_loop.test_trainer_loop_resume import data, make_body

pytestmark = pytest.mark.timeout(60)


def damage_piece(step_dir, rank: int) -> None:
    """Rewrites rank ``rank``'s parameter piece with other numbers: still a valid .npy, but its
    CRC no longer matches the metadata (what a bad disk block or a partial copy leaves)."""
    path = step_dir / f"rank{rank:05d}" / "unit0.param.npy"
    a = np.load(path)
    np.save(path, a + 1)


async def test_a_damaged_newest_checkpoint_falls_back_on_every_rank(ranks, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "ringweave.checkpoint")
    split = data(np.float32)
    ckpt = str(tmp_path / "ckpt")
    await ranks(2, make_body("zero3", split, np.float32, stop_at=10, ckpt=ckpt, every=4))
    found = checkpoint.list_checkpoints(ckpt)
    assert [p.name for p in found] == ["step-00000004", "step-00000007", "step-00000008", "step-00000010"]
    damage_piece(found[-1], 1)  # only rank 1 reads this piece: rank 0 alone would have loaded step 10
    (found[-2] / checkpoint.METADATA).write_text("{not json")  # and step 8's metadata is cut short

    (res, losses, _), (res1, _, _) = await ranks(2, make_body("zero3", split, np.float32, resume=True, ckpt=ckpt))
    assert res.resumed_from == res1.resumed_from == (1, 0)  # step 7: the end of epoch 0
    assert sorted(losses) == list(range(8, 3 * 7 + 1))
    assert "step-00000010 cannot be loaded" in caplog.text and "is corrupt" in caplog.text
    assert "step-00000008 cannot be loaded" in caplog.text


async def test_no_checkpoint_that_loads_is_a_clear_error(ranks, tmp_path):
    split = data(np.float32)
    ckpt = str(tmp_path / "ckpt")
    await ranks(1, make_body("ddp", split, np.float32, stop_at=3, ckpt=ckpt))
    for p in checkpoint.list_checkpoints(ckpt):
        (p / checkpoint.METADATA).write_text("{}")
    [error] = await ranks(1, make_body("ddp", split, np.float32, resume=True, ckpt=ckpt), return_exceptions=True)
    assert isinstance(error, checkpoint.CheckpointError) and "none of the 1 checkpoints" in str(error), error
