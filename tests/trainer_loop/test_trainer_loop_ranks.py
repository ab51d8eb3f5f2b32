"""trainer.loop across ranks (tasks of one event loop, in-memory transport): exact evaluation
over uneven shards, agreed early stopping, rank-0-only output, the gathered rank table."""

import io

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import collectives
from tests.trainer_loop.local_strategy import LocalStrategy
from trainer.data import Split, make_synthetic
from trainer.loop import Callback, evaluate, fit
from trainer.nn import mlp
from trainer.sharding.base import TrainConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_blas_thread():
    with threadpool_limits(limits=1, user_api="blas"):
        yield


class SummingStrategy(LocalStrategy):
    """LocalStrategy whose gradients (and loss) are summed over the group: the smallest correct
    data-parallel strategy, for loop tests only (trainer.sharding has the real ones)."""

    name = "summing"

    async def train_step(self, micro_batches):
        from trainer.nn import Context

        self.calls.append([(len(x), off, gs) for x, _, off, gs in micro_batches])
        self.model.zero_grads(self.grads)
        denominator = sum(gs for *_, gs in micro_batches)
        loss = np.zeros(1)
        for x, y, off, _ in micro_batches:
            if len(x):
                ctx = Context(seed=self.config.seed, step=self.step, batch_offset=off)
                loss += self.model.forward_backward(self.params, self.grads, x, y, ctx,
                                                    loss_denominator=denominator)
        for g in self.grads:
            await collectives.all_reduce(g, group=self.group)
        await collectives.all_reduce(loss, group=self.group)
        for p, g, s in zip(self.params, self.grads, self.states):
            self.opt.step(p, g, s, self.schedule(self.step))
        self.step += 1
        from trainer.sharding.base import StepResult
        return StepResult(loss=float(loss[0]), comm_bytes=10 * (self.group.rank + 1))


def split(n_train, n_val, dtype=np.float32):
    x, y = make_synthetic(n_train + n_val, in_dim=8, num_classes=3, seed=3, class_sep=2.0, dtype=dtype)
    return Split(x[n_val:], y[n_val:], x[:n_val], y[:n_val], 3)


async def make(group, data, dtype=np.float32, **kw):
    config = TrainConfig(lr=1e-2, warmup_steps=0, total_steps=100, seed=1, **kw)
    strategy = LocalStrategy.__new__(SummingStrategy)
    LocalStrategy.__init__(strategy, mlp(8, (16,), 3, pad_to=group.size, dtype=dtype), config, group)
    await strategy.setup()
    return strategy, config


@pytest.mark.parametrize("world, n_val", [(2, 37), (3, 10), (4, 2), (3, 0)])
async def test_evaluate_is_exact_over_uneven_shards(ranks, world, n_val):
    data = split(20, n_val)

    async def body(group):
        strategy, _ = await make(group, data)
        result = await evaluate(strategy, data.x_val, data.y_val, group=group, batch_size=4)
        return result, strategy.evaluated_rows

    single = await ranks(1, body)
    results = await ranks(world, body)
    assert sum(rows for _, rows in results) == n_val  # every row exactly once
    for result, _ in results:
        loss, acc = result["loss"], result["accuracy"]
        if n_val:
            assert acc == single[0][0]["accuracy"] and loss == pytest.approx(single[0][0]["loss"], rel=1e-6)
        else:
            assert np.isnan(loss) and np.isnan(acc)


async def test_fit_over_ranks_equals_one_process_in_float64(ranks):
    """Losses and validation figures of a 3-rank fit (uneven last batch) equal the 1-rank fit."""
    data = split(70, 11, dtype=np.float64)

    async def body(group):
        strategy, config = await make(group, data, dtype=np.float64, master_dtype="float64")
        err, out = io.StringIO(), io.StringIO()
        history = await fit(strategy, data, config, epochs=2, global_batch_size=16, group=group,
                            progress_stream=err, summary_stream=out)
        return history, err.getvalue(), out.getvalue(), strategy.calls

    (one, _, _, _), = await ranks(1, body)
    results = await ranks(3, body)
    for rank, (history, err, out, calls) in enumerate(results):
        assert [len(c) for c in calls] == [1] * 10  # 5 steps per epoch on every rank
        assert calls[4][0][2] == 6 and calls[4][0][0] == [2, 2, 2][rank]  # 70 = 4 x 16 + 6 rows
        for a, b in zip(history.epochs, one.epochs):
            assert a.train_loss == pytest.approx(b.train_loss, rel=1e-12)
            assert a.val_loss == pytest.approx(b.val_loss, rel=1e-12) and a.val_acc == b.val_acc
            assert a.train_acc == b.train_acc
        assert [r.comm_bytes for r in history.ranks] == [100, 200, 300]  # gathered on every rank
        assert history.comm_bytes == 600
        # output on rank 0 only
        assert (err != "" and out != "") is (rank == 0)
        assert (err == "" and out == "") is (rank != 0)
    assert "rank" in results[0][2] and results[0][2].count("\n") >= 6  # a row per rank


async def test_a_stop_decided_on_one_rank_stops_every_rank(ranks):
    data = split(64, 8)

    class StopOnRank1(Callback):
        def on_step_end(self, state):
            if state.rank == 1 and state.step == 3:
                state.stop_training = True

    async def body(group):
        strategy, config = await make(group, data)
        history = await fit(strategy, data, config, epochs=3, global_batch_size=8, group=group,
                            callbacks=[StopOnRank1()], progress_stream=io.StringIO(),
                            summary_stream=io.StringIO())
        return history.steps, history.stopped_early

    assert await ranks(3, body) == [(3, True)] * 3
