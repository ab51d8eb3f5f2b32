"""DistributedSampler properties, the global/local batch ordering contract, and the data sets."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer.data import (
    DistributedSampler,
    epoch_order,
    iter_local_batches,
    load_digits_split,
    make_synthetic,
    num_global_batches,
    split_bounds,
)


def all_ranks(n, world, **kw):
    return [DistributedSampler(n, world, r, **kw).indices() for r in range(world)]


@given(n=st.integers(1, 60), world=st.integers(1, 9), shuffle=st.booleans(), seed=st.integers(0, 5))
def test_sampler_without_drop_last_pads_to_equal_lengths_and_covers(n, world, shuffle, seed):
    parts = all_ranks(n, world, shuffle=shuffle, seed=seed)
    per_rank = math.ceil(n / world)
    assert all(len(p) == per_rank for p in parts)
    merged = np.concatenate(parts)
    assert set(merged.tolist()) == set(range(n))  # covers everything
    counts = np.bincount(merged, minlength=n)
    assert counts.sum() == per_rank * world
    if n >= world:
        assert counts.max() <= 2 and (counts == 2).sum() == per_rank * world - n  # the head repeats once
    if n % world == 0:
        assert counts.max() == 1  # disjoint


@given(n=st.integers(0, 60), world=st.integers(1, 9), seed=st.integers(0, 5))
def test_sampler_drop_last_is_disjoint_and_cuts_the_tail(n, world, seed):
    parts = all_ranks(n, world, seed=seed, drop_last=True)
    assert all(len(p) == n // world for p in parts)
    merged = np.concatenate(parts)
    assert len(set(merged.tolist())) == len(merged) == (n // world) * world


def test_sampler_torch_layout_without_shuffle():
    # torch: indices = [0..9] + [0, 1] padding, rank r takes indices[r::4]
    assert [p.tolist() for p in all_ranks(10, 4, shuffle=False)] == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert [p.tolist() for p in all_ranks(10, 4, shuffle=False, drop_last=True)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [p.tolist() for p in all_ranks(2, 5, shuffle=False)] == [[0], [1], [0], [1], [0]]
    sampler = DistributedSampler(10, 4, 2, shuffle=False)
    assert list(sampler) == [2, 6, 0] and len(sampler) == 3


def test_set_epoch_reshuffles_deterministically():
    s = DistributedSampler(100, 2, 1, seed=3)
    first = s.indices()
    np.testing.assert_array_equal(DistributedSampler(100, 2, 1, seed=3).indices(), first)
    s.set_epoch(1)
    second = s.indices()
    assert not np.array_equal(first, second)
    s.set_epoch(0)
    np.testing.assert_array_equal(s.indices(), first)
    assert not np.array_equal(DistributedSampler(100, 2, 1, seed=4).indices(), first)
    np.testing.assert_array_equal(np.sort(epoch_order(100, seed=3, epoch=1)), np.arange(100))


def test_sampler_errors():
    with pytest.raises(ValueError, match="rank=2 of 2"):
        DistributedSampler(10, 2, 2)


def test_split_bounds_follow_array_split():
    for size in range(0, 12):
        for world in range(1, 6):
            sizes = np.diff(split_bounds(size, world)).tolist()
            assert sizes == [len(a) for a in np.array_split(np.arange(size), world)]


@pytest.mark.parametrize("n,G,world,drop_last", [(100, 16, 4, False), (100, 16, 3, False), (50, 7, 8, False),
                                                  (100, 16, 4, True), (5, 64, 2, False)])
def test_local_batches_concatenate_to_the_single_process_global_batches(n, G, world, drop_last):
    kw = dict(seed=9, epoch=2, drop_last=drop_last)
    single = list(iter_local_batches(n, G, **kw))
    per_rank = [list(iter_local_batches(n, G, world, r, **kw)) for r in range(world)]
    assert len(single) == num_global_batches(n, G, drop_last)
    assert all(len(batches) == len(single) for batches in per_rank)
    order = epoch_order(n, seed=9, epoch=2)
    for k, whole in enumerate(single):
        np.testing.assert_array_equal(whole.indices, order[k * G : (k + 1) * G])
        parts = [per_rank[r][k] for r in range(world)]
        np.testing.assert_array_equal(np.concatenate([p.indices for p in parts]), whole.indices)
        assert [p.offset for p in parts] == split_bounds(len(whole.indices), world)[:-1]
        assert all(p.global_size == len(whole.indices) and p.step == k for p in parts)
    seen = np.concatenate([b.indices for b in single])
    assert len(seen) == (n // G * G if drop_last else n) and len(set(seen.tolist())) == len(seen)


def test_digits_split_is_standardized_and_fixed_by_seed():
    a, b, c = load_digits_split(seed=0), load_digits_split(seed=0), load_digits_split(seed=1)
    assert a.x_train.shape == (1438, 64) and a.x_val.shape == (359, 64) and a.in_dim == 64
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int64 and a.num_classes == 10
    np.testing.assert_array_equal(a.x_val, b.x_val)
    assert not np.array_equal(a.y_val, c.y_val)
    mean, std = a.x_train.mean(axis=0), a.x_train.std(axis=0)
    assert np.abs(mean).max() < 1e-5
    varying = std > 0
    np.testing.assert_allclose(std[varying], 1.0, rtol=1e-4)
    assert set(np.unique(a.y_train)) == set(range(10))


def test_synthetic_is_deterministic_and_any_size():
    x, y = make_synthetic(5000, in_dim=16, num_classes=4, seed=1)
    x2, y2 = make_synthetic(5000, in_dim=16, num_classes=4, seed=1)
    assert x.shape == (5000, 16) and x.dtype == np.float32 and set(np.unique(y)) == {0, 1, 2, 3}
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert make_synthetic(0)[0].shape == (0, 64)
    # the clusters are there: nearest class mean classifies far above chance (0.25)
    means = np.stack([x[y == k].mean(axis=0) for k in range(4)])
    nearest = ((x[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (nearest == y).mean() > 0.6
