"""trainer.loop.fit / evaluate with a local (world size 1) strategy: history, batching,
callbacks, early stopping, progress and summary output."""

import io
import math

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from tests.trainer_loop.local_strategy import LocalStrategy
from trainer.data import Split, make_synthetic
from trainer.loop import (Callback, EarlyStopping, EpochStats, LoopState, StopAtAccuracy, evaluate, fit,
                          format_summary, steps_per_epoch)
from trainer.nn import mlp
from trainer.sharding.base import TrainConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_blas_thread():
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def small_split(n_train=150, n_val=37, seed=3) -> Split:
    x, y = make_synthetic(n_train + n_val, in_dim=8, num_classes=3, seed=seed, class_sep=2.0)
    return Split(x[n_val:], y[n_val:], x[:n_val], y[:n_val], 3)


async def make(data, **config_kw):
    defaults = dict(lr=1e-2, warmup_steps=0, total_steps=100, seed=1)
    defaults.update(config_kw)
    config = TrainConfig(**defaults)
    strategy = LocalStrategy(mlp(data.in_dim, (16,), data.num_classes), config)
    await strategy.setup()
    return strategy, config


async def quiet_fit(strategy, data, config, **kw):
    err, out = io.StringIO(), io.StringIO()
    kw.setdefault("epochs", 2)
    kw.setdefault("global_batch_size", 32)
    history = await fit(strategy, data, config, progress_stream=err, summary_stream=out, **kw)
    return history, err.getvalue(), out.getvalue()


def test_steps_per_epoch():
    assert steps_per_epoch(150, 32) == 5          # 32, 32, 32, 32, 22
    assert steps_per_epoch(150, 32, 2) == 3       # (2, 2, 1) micro-batches
    assert steps_per_epoch(128, 32, 4) == 1
    assert steps_per_epoch(0, 32) == 0


async def test_history_fields_and_exact_evaluation():
    data = small_split()
    strategy, config = await make(data)
    history, err, out = await quiet_fit(strategy, data, config, epochs=3)
    assert [e.epoch for e in history.epochs] == [0, 1, 2]
    assert history.steps == 15 and history.samples == 3 * 150
    for e in history.epochs:
        assert e.steps == 5 and e.effective_batch_size == 32
        assert e.samples_per_s > 0 and 0 < e.train_time_s <= e.epoch_time_s
        assert 0 <= e.val_acc <= 1 and 0 <= e.train_acc <= 1 and e.val_loss > 0
    # the last epoch's validation numbers are the model's, over every row exactly once
    logits = strategy.model.forward(strategy.params, data.x_val)
    assert history.final.val_acc == pytest.approx(float((logits.argmax(1) == data.y_val).mean()), abs=0)
    z = logits - logits.max(1, keepdims=True)
    loss = -(z[np.arange(len(z)), data.y_val] - np.log(np.exp(z).sum(1))).mean()
    assert history.final.val_loss == pytest.approx(loss, rel=1e-6)
    assert history.epochs[-1].train_loss < history.epochs[0].train_loss
    assert history.final.val_acc > 0.8
    # the train loss is the row-weighted mean of the step losses, the last step short (22 rows)
    assert [c[0][0] for c in strategy.calls[:5]] == [32, 32, 32, 32, 22]
    # rank stats and summary
    assert len(history.ranks) == 1 and history.ranks[0].comm_bytes == 1500 and history.comm_bytes == 1500
    assert history.ranks[0].params_bytes == sum(p.nbytes for p in strategy.params)
    assert history.ranks[0].maxrss_bytes > 10 << 20 and history.ranks[0].steps == 15
    assert "validation accuracy" in out and "samples/s" in out and "params" in out and "1.46 KiB" in out
    assert "epoch 3/3:" in err
    d = history.as_dict()
    assert d["comm_bytes"] == 1500 and len(d["epochs"]) == 3


async def test_grad_accumulation_groups_micro_batches():
    data = small_split()
    strategy, config = await make(data, grad_accum=2)
    history, _, _ = await quiet_fit(strategy, data, config, epochs=1, global_batch_size=32)
    assert [[m[0] for m in step] for step in strategy.calls] == [[32, 32], [32, 32], [22]]
    assert all(m[1] == 0 for step in strategy.calls for m in step)  # one rank: offset 0
    assert history.epochs[0].effective_batch_size == 64 and history.epochs[0].steps == 3


async def test_accumulation_equals_one_big_batch():
    """A step over A micro-batches of G rows equals one step over a batch of A*G rows in float64
    when the data order is the same (one epoch, no shuffle dependence: compare parameters)."""
    x, y = make_synthetic(128, in_dim=6, num_classes=3, seed=2, dtype=np.float64)
    data = Split(x, y, x[:10], y[:10], 3)
    params = []
    for accum, batch in [(1, 64), (2, 32), (4, 16)]:
        config = TrainConfig(lr=1e-2, warmup_steps=0, total_steps=10, seed=1, grad_accum=accum)
        strategy = LocalStrategy(mlp(6, (8,), 3, dtype=np.float64), config)
        await strategy.setup()
        await quiet_fit(strategy, data, config, epochs=1, global_batch_size=batch, eval_train=False)
        params.append(np.concatenate(await strategy.full_params()))
    # same order of rows: order = epoch_order(...), batches are its consecutive slices
    np.testing.assert_allclose(params[1], params[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(params[2], params[0], rtol=1e-12, atol=1e-14)


async def test_callbacks_see_the_state():
    data = small_split()
    strategy, config = await make(data)
    seen = {"steps": [], "epochs": []}

    class Recorder(Callback):
        def on_step_end(self, state: LoopState):
            assert state.result is not None and state.epoch_stats is None
            seen["steps"].append((state.epoch, state.step_in_epoch, state.step))

        def on_epoch_end(self, state: LoopState):
            assert isinstance(state.epoch_stats, EpochStats) and state.history.epochs[-1] is state.epoch_stats
            seen["epochs"].append((state.epoch, state.step))

    class OnlyEpochs:  # duck-typed, one method only
        def __init__(self):
            self.n = 0

        def on_epoch_end(self, state):
            self.n += 1

    only = OnlyEpochs()
    await quiet_fit(strategy, data, config, epochs=2, callbacks=[Recorder(), only])
    assert seen["steps"] == [(e, k, e * 5 + k) for e in range(2) for k in range(1, 6)]
    assert seen["epochs"] == [(0, 5), (1, 10)]
    assert only.n == 2


async def test_stop_from_a_step_callback():
    data = small_split()
    strategy, config = await make(data)

    class StopAt7(Callback):
        def on_step_end(self, state):
            state.stop_training = state.step == 7

    history, err, out = await quiet_fit(strategy, data, config, epochs=5, callbacks=[StopAt7()])
    assert history.steps == 7 and history.stopped_early
    assert [e.steps for e in history.epochs] == [5, 2]  # the interrupted epoch is still evaluated
    assert history.epochs[-1].val_acc is not None
    assert "stopped early" in err and "stopped early" in out


async def test_early_stopping_and_target_accuracy():
    data = small_split()
    strategy, config = await make(data)
    history, _, _ = await quiet_fit(strategy, data, config, epochs=10, callbacks=[StopAtAccuracy(0.0)])
    assert len(history.epochs) == 1 and history.stopped_early

    es = EarlyStopping("val_loss", patience=2)
    state = LoopState(0, 9, 0, 0, 1, 0, 1, None, None)
    for value, stop in [(1.0, False), (0.9, False), (0.95, False), (0.91, True)]:
        state.epoch_stats = EpochStats(0, 1, 0.0, None, value, 0.5, 1.0, 1, 1.0, 1.0)
        state.stop_training = False
        es.on_epoch_end(state)
        assert state.stop_training is stop
    acc = EarlyStopping("val_acc", patience=1)
    for value, stop in [(0.5, False), (0.6, False), (0.6, True)]:
        state.epoch_stats = EpochStats(0, 1, 0.0, None, 1.0, value, 1.0, 1, 1.0, 1.0)
        state.stop_training = False
        acc.on_epoch_end(state)
        assert state.stop_training is stop


async def test_evaluate_chunks_and_empty_sets():
    data = small_split()
    strategy, _ = await make(data)
    whole = await evaluate(strategy, data.x_val, data.y_val)
    strategy.evaluated_rows = 0
    chunked = await evaluate(strategy, data.val, batch_size=5)  # a data set, or (x, y) arrays
    assert strategy.evaluated_rows == len(data.x_val)
    assert chunked["accuracy"] == whole["accuracy"] and chunked["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    empty = await evaluate(strategy, data.x_val[:0], data.y_val[:0])
    assert math.isnan(empty["loss"]) and math.isnan(empty["accuracy"])


async def test_no_validation_set_and_zero_epochs():
    data = small_split()
    data = Split(data.x_train, data.y_train, data.x_val[:0], data.y_val[:0], 3)
    strategy, config = await make(data)
    history, _, out = await quiet_fit(strategy, data, config, epochs=1, eval_train=False)
    assert history.final.val_acc is None and history.final.train_acc is None
    assert "validation accuracy" not in out
    history, _, _ = await quiet_fit(strategy, data, config, epochs=0)
    assert history.epochs == [] and history.steps == 0 and "0 steps" in format_summary(history)


async def test_progress_lines_every_n_steps():
    data = small_split()
    strategy, config = await make(data)
    _, err, _ = await quiet_fit(strategy, data, config, epochs=1, log_every=2)
    lines = [line for line in err.splitlines() if " step " in line]
    assert [line.split(" step ")[1].split()[0] for line in lines] == ["2/5", "4/5", "5/5"]
    _, err, _ = await quiet_fit(strategy, data, config, epochs=1, log_every=0)
    assert " step " not in err and "epoch 1/1:" in err


async def test_bad_arguments():
    data = small_split()
    strategy, config = await make(data)
    with pytest.raises(ValueError, match="global_batch_size"):
        await quiet_fit(strategy, data, config, global_batch_size=0)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        await quiet_fit(strategy, data, config, resume=True)
