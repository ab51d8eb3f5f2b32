"""Re-partitioning an epoch when the world changes size between steps (trainer/data.py
local_batches_from, repartition, epoch_position): against the plain reference, the epoch's order
cut into global batches, each sample is seen exactly once at its place; and a run whose world
changes trains exactly as an undisturbed one (the gradient is the sum over samples divided by the
global count), to 1e-12 in float64, dropout included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.data import epoch_order, epoch_position, iter_local_batches, local_batches_from, repartition
from trainer.nn import Context, mlp


@pytest.mark.parametrize("n,G,world,drop_last", [(10, 4, 3, False), (10, 4, 3, True), (7, 8, 4, False),
                                                 (64, 16, 5, False), (0, 4, 2, False)])
def test_from_the_start_it_is_iter_local_batches(n, G, world, drop_last):
    order = epoch_order(n, seed=3, epoch=2)
    for r in range(world):
        want = list(iter_local_batches(n, G, world, r, seed=3, epoch=2, drop_last=drop_last))
        got = list(local_batches_from(order, 0, G, world, r, drop_last=drop_last))
        assert [(b.step, b.offset, b.global_size) for b in got] == [(b.step, b.offset, b.global_size) for b in want]
        assert all(np.array_equal(a.indices, b.indices) for a, b in zip(got, want))


def run_disturbed(order, G, drop_last, segments):
    """The epoch as a job whose world changes: segments [(steps, world), ...]; returns, per step
    run, (global step, [block of each rank], [offset of each rank])."""
    ran, consumed = [], 0
    for steps, world in segments:
        plan = repartition(order, consumed, G, world, drop_last=drop_last)
        firsts = [list(local_batches_from(order, consumed, G, world, r, drop_last=drop_last)) for r in range(world)]
        for j, blocks in enumerate(plan[:steps]):
            ran.append((firsts[0][j].step, blocks, [firsts[r][j].offset for r in range(world)]))
            consumed = min(len(order) if not drop_last else len(order) // G * G, consumed + G)
    return ran


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 60), G=st.integers(1, 13), drop_last=st.booleans(),
       segments=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 9)), min_size=1, max_size=8),
       seed=st.integers(0, 5))
def test_each_sample_is_seen_once_at_its_place_whatever_the_world_does(n, G, drop_last, segments, seed):
    order = epoch_order(n, seed=seed, epoch=1)
    steps = n // G if drop_last else -(-n // G)
    segments = segments + [(steps, 3)]  # whatever is left runs at 3 ranks
    ran = run_disturbed(order, G, drop_last, segments)
    assert [k for k, _, _ in ran] == list(range(steps))  # every step once, in order
    seen = []
    for k, blocks, offsets in ran:
        reference = order[k * G: (k + 1) * G]  # the plain reference: global batch k
        assert np.array_equal(np.concatenate(blocks), reference)  # rank blocks in order make it up
        assert sum(len(b) for b in blocks) == len(reference) == min(G, n - k * G)
        assert offsets == list(np.cumsum([0] + [len(b) for b in blocks[:-1]]))
        assert max(len(b) for b in blocks) - min(len(b) for b in blocks) <= 1  # uneven by one at most
        seen.extend(np.concatenate(blocks).tolist())
    assert len(seen) == len(set(seen))  # no sample twice
    assert seen == order[:steps * G if drop_last else n].tolist()  # and none left out


def test_consumed_must_be_a_step_boundary():
    order = epoch_order(10, seed=0, epoch=0)
    assert list(local_batches_from(order, 10, 4, 2)) == []  # the epoch is over (short last batch done)
    assert [b.step for b in local_batches_from(order, 8, 4, 2)] == [2]
    for bad in (3, 11, -4):
        with pytest.raises(ValueError, match="no step boundary"):
            list(local_batches_from(order, bad, 4, 2))
    with pytest.raises(ValueError, match="no step boundary"):
        list(local_batches_from(order, 10, 4, 2, drop_last=True))  # only 8 are used then
    with pytest.raises(ValueError, match="rank=2 of 2"):
        list(local_batches_from(order, 0, 4, 2, 2))


def test_epoch_position_of_a_joiner():
    assert epoch_position(0, 10, 4) == (0, 0)
    assert epoch_position(2, 10, 4) == (0, 8)
    assert epoch_position(3, 10, 4) == (1, 0)  # 3 steps per epoch (the last one of 2 samples)
    assert epoch_position(5, 10, 4, drop_last=True) == (2, 4)
    with pytest.raises(ValueError):
        epoch_position(-1, 10, 4)


@pytest.mark.parametrize("segments", [[(2, 4), (3, 3), (1, 1), (2, 2), (9, 4)], [(1, 5), (1, 2), (9, 7)]])
def test_a_run_whose_world_changes_trains_as_the_undisturbed_one(segments):
    """SGD on an MLP with dropout, float64: every rank's gradient is its block's loss divided by the
    GLOBAL batch size (the sum over samples / the global count), the blocks' gradients are summed,
    and each block keeps its offset in the global batch (dropout masks). Step for step, the
    parameters equal the one-process run's to 1e-12 whatever the world size does."""
    n, G, lr = 50, 8, 0.1
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((n, 5)), rng.integers(0, 3, n)
    model = mlp(5, (16,), 3, dropout=0.25, dtype=np.float64)
    order = epoch_order(n, seed=9, epoch=0)

    def step(params, k, blocks, offsets):
        summed = model.zeros()
        for block, offset in zip(blocks, offsets):
            local = model.zeros()
            model.forward_backward(params, local, x[block], y[block], Context(seed=7, step=k, batch_offset=offset),
                                   loss_denominator=sum(len(b) for b in blocks))
            for s, g in zip(summed, local):
                s += g
        for p, g in zip(params, summed):
            p -= lr * g

    undisturbed, disturbed = model.init_params(0), model.init_params(0)
    ran = run_disturbed(order, G, False, segments)
    one = [(b.step, [b.indices], [b.offset]) for b in iter_local_batches(n, G, seed=9, epoch=0)]
    assert len(ran) == len(one) == 7
    for (k, blocks, offsets), (k1, block1, offset1) in zip(ran, one):
        assert k == k1
        step(undisturbed, k1, block1, offset1)
        step(disturbed, k, blocks, offsets)
        for a, b in zip(disturbed, undisturbed):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    mean_of_means = model.init_params(0)  # the rule that fails: each rank's mean, averaged
    k, blocks = 2, repartition(order, 2 * G, G, 3)[0]  # step 2 at 3 ranks: blocks of 3, 3 and 2 rows
    offsets = [0, 3, 6]
    assert [len(b) for b in blocks] == [3, 3, 2]
    grads = []
    for block, offset in zip(blocks, offsets):
        local = model.zeros()
        model.forward_backward(mean_of_means, local, x[block], y[block], Context(seed=7, step=k, batch_offset=offset),
                               loss_denominator=len(block))
        grads.append(local)
    right = model.zeros()
    model.forward_backward(mean_of_means, right, x[np.concatenate(blocks)], y[np.concatenate(blocks)],
                           Context(seed=7, step=k), loss_denominator=G)
    averaged = [sum(g[i] for g in grads) / len(grads) for i in range(len(right))]
    assert max(np.abs(a - r).max() for a, r in zip(averaged, right)) > 1e-6
