"""Resume through the loop with the real strategies and checkpoints (ranks as tasks, in-memory
transport): stopping mid-epoch and resuming gives exactly the losses, history and parameters of an
uninterrupted run, from the stop's checkpoint and from an earlier `checkpoint_every` one; and a
checkpoint saved at 2 ranks under zero3 resumes at 1 rank under ddp (float64, to rounding)."""

import io
import shutil

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from trainer import checkpoint
from trainer.data import Split, make_synthetic
from trainer.loop import Callback, fit
from trainer.nn import mlp
from trainer.runid import RunError
from trainer.sharding import make_strategy
from trainer.sharding.base import TrainConfig

pytestmark = pytest.mark.timeout(60)

EPOCHS, G = 3, 16  # 100 rows: 7 steps per epoch, the last of 4 rows


@pytest.fixture(autouse=True)
def one_blas_thread():
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def data(dtype):
    x, y = make_synthetic(120, in_dim=8, num_classes=3, seed=3, class_sep=1.0, dtype=dtype)
    return Split(x[20:], y[20:], x[:20], y[:20], 3)


class Record(Callback):
    def __init__(self, stop_at=None):
        self.losses, self.stop_at = {}, stop_at

    def on_step_end(self, state):
        self.losses[state.step] = state.result.loss
        state.stop_training = state.step == self.stop_at


def make_body(name, split, dtype, *, stop_at=None, resume=False, ckpt=None, every=0):
    master = "float64" if dtype == np.float64 else "float32"

    async def body(group):
        config = TrainConfig(strategy=name, lr=5e-3, warmup_steps=3, total_steps=EPOCHS * 7, min_lr=1e-4,
                             master_dtype=master, param_dtype=master, reduce_dtype=master, seed=2)
        model = mlp(8, (16, 16), 3, dropout=0.1, pad_to=group.size, dtype=dtype)
        strategy = make_strategy(name, model, config, group)
        await strategy.setup()
        rec = Record(stop_at)
        try:
            history = await fit(strategy, split, config, epochs=EPOCHS, global_batch_size=G, callbacks=[rec],
                                checkpoint_dir=ckpt, checkpoint_every=every, keep_last=5, resume=resume,
                                group=group, progress_stream=io.StringIO(), summary_stream=io.StringIO())
            params = np.concatenate(await strategy.full_params())
        finally:
            strategy.close()
        return history, rec.losses, params

    return body


async def test_resume_mid_epoch_equals_uninterrupted(ranks, tmp_path):
    split = data(np.float32)
    (full, full_losses, full_params), _ = await ranks(2, make_body("zero3", split, np.float32))
    assert len(full_losses) == EPOCHS * 7

    ckpt = str(tmp_path / "ckpt")
    (cut, cut_losses, _), _ = await ranks(2, make_body("zero3", split, np.float32, stop_at=10, ckpt=ckpt, every=4))
    assert cut.stopped_early and sorted(cut_losses) == list(range(1, 11))
    steps = [int(p.name.split("-")[1]) for p in checkpoint.list_checkpoints(ckpt)]
    assert steps == [4, 7, 8, 10]  # every 4 steps, the end of epoch 0, the stop
    assert checkpoint.read_metadata(ckpt)["extra"]["loop"]["epoch"] == 1
    backup = tmp_path / "backup"
    shutil.copytree(ckpt, backup)

    for source, first in [(ckpt, 11), (str(backup), 9)]:
        if first == 9:  # as if the run had died after step 10's work but before its checkpoint
            shutil.rmtree(checkpoint.latest(source))
        (res, res_losses, res_params), _ = await ranks(2, make_body("zero3", split, np.float32, resume=True,
                                                                   ckpt=source))
        assert res.resumed_from == ((1, 3) if first == 11 else (1, 1))
        assert sorted(res_losses) == list(range(first, EPOCHS * 7 + 1))
        for step, loss in res_losses.items():
            assert loss == full_losses[step], step  # bit for bit
        assert [e.as_dict() | {"samples_per_s": 0, "train_time_s": 0, "epoch_time_s": 0, "steps": 0}
                for e in res.epochs] == \
               [e.as_dict() | {"samples_per_s": 0, "train_time_s": 0, "epoch_time_s": 0, "steps": 0}
                for e in full.epochs]
        np.testing.assert_array_equal(res_params, full_params)


async def test_resume_onto_another_world_size_and_strategy(ranks, tmp_path):
    split = data(np.float64)
    (full, full_losses, full_params), = await ranks(1, make_body("ddp", split, np.float64))
    ckpt = str(tmp_path / "ckpt")
    await ranks(2, make_body("zero3", split, np.float64, stop_at=9, ckpt=ckpt))
    (res, res_losses, res_params), = await ranks(1, make_body("ddp", split, np.float64, resume=True, ckpt=ckpt))
    assert sorted(res_losses) == list(range(10, EPOCHS * 7 + 1))
    for step, loss in res_losses.items():
        assert loss == pytest.approx(full_losses[step], rel=1e-10)
    np.testing.assert_allclose(res_params, full_params, rtol=1e-9, atol=1e-12)
    assert res.final.val_acc == full.final.val_acc


async def test_resume_refuses_a_different_batching(ranks, tmp_path):
    split = data(np.float32)
    ckpt = str(tmp_path / "ckpt")
    await ranks(1, make_body("ddp", split, np.float32, stop_at=3, ckpt=ckpt))

    async def body(group):
        config = TrainConfig(strategy="ddp", seed=2)
        strategy = make_strategy("ddp", mlp(8, (16, 16), 3, dropout=0.1, pad_to=1), config, group)
        await strategy.setup()
        try:
            await fit(strategy, split, config, epochs=EPOCHS, global_batch_size=32, checkpoint_dir=ckpt,
                      resume=True, group=group, progress_stream=io.StringIO(), summary_stream=io.StringIO())
        finally:
            strategy.close()

    [error] = await ranks(1, body, return_exceptions=True)
    assert isinstance(error, RunError) and "global_batch_size: 16 -> 32" in str(error), error


async def test_resume_auto_with_an_empty_directory_starts_fresh(ranks, tmp_path):
    split = data(np.float32)
    (res, losses, _), = await ranks(1, make_body("ddp", split, np.float32, resume="auto", ckpt=str(tmp_path / "new")))
    assert res.resumed_from is None and sorted(losses) == list(range(1, EPOCHS * 7 + 1))
    assert [int(p.name.split("-")[1]) for p in checkpoint.list_checkpoints(tmp_path / "new")] == [7, 14, 21]


async def test_resume_with_an_empty_or_missing_directory_is_an_error(ranks, tmp_path):
    """Before, resume=True into a missing directory (a typo) silently started a new run."""
    split = data(np.float32)
    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "typo", tmp_path / "empty"):
        errors = await ranks(2, make_body("ddp", split, np.float32, resume=True, ckpt=str(where)),
                             return_exceptions=True)
        for error in errors:  # every rank, the same one line
            assert isinstance(error, RunError), error
            assert str(error) == (f"no checkpoint in {where}; to start fresh drop --resume, or use --resume auto to "
                                  f"resume only when there is one")
        assert not checkpoint.list_checkpoints(where)
