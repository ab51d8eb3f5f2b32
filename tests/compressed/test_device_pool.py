"""The staging pool of the device collectives (collectives/device_pool.py): kept buffers,
byte accounting, size classes, eviction and the over-limit fallback. Plain NumPy allocators:
the rules do not depend on CUDA."""

import numpy as np
import pytest

from collectives.device_pool import MIN_CLASS, Pool, size_class

KiB, MiB = 1 << 10, 1 << 20


def make(limit):
    made = []

    def allocate(n):
        made.append(n)
        return np.empty(n, np.uint8)

    return Pool(allocate, lambda n: np.empty(n, np.uint8), limit_bytes=limit), made


def test_size_classes_are_powers_of_two_from_64_kib():
    assert size_class(0) == size_class(1) == MIN_CLASS == 64 * KiB
    assert size_class(64 * KiB + 1) == 128 * KiB and size_class(MiB) == MiB and size_class(MiB + 1) == 2 * MiB


def test_a_sweep_of_sizes_reuses_what_was_allocated():
    pool, made = make(64 * MiB)
    for _ in range(3):  # the same sweep three times: buffers come back, nothing new is allocated
        bufs = [pool.take(n) for n in (3 * MiB, 100 * KiB, 4 * MiB, 70 * KiB)]
        assert all(b.nbytes >= n for b, n in zip(bufs, (3 * MiB, 100 * KiB, 4 * MiB, 70 * KiB)))
        pool.give(*bufs)
    assert made == [4 * MiB, 128 * KiB, 4 * MiB, 128 * KiB]
    st = pool.statistics()
    assert (st.allocations, st.reuses, st.in_use_bytes, st.kept_bytes) == (4, 8, 0, 8 * MiB + 256 * KiB)


def test_buffers_in_use_are_never_handed_out_twice():
    pool, _ = make(8 * MiB)
    a, b = pool.take(MiB), pool.take(MiB)
    assert a is not b and not np.shares_memory(a, b)
    assert pool.statistics().in_use_bytes == 2 * MiB


def test_the_limit_evicts_free_buffers_of_other_classes_first():
    pool, made = make(4 * MiB)
    pool.give(pool.take(2 * MiB), pool.take(MiB))  # 3 MiB kept, free
    big = pool.take(3 * MiB)  # a 4 MiB class: both free buffers go
    st = pool.statistics()
    assert st.evictions == 2 and st.kept_bytes == 4 * MiB and st.over_limit == 0 and made[-1] == 4 * MiB
    pool.give(big)


def test_over_the_limit_a_temporary_buffer_that_is_not_kept():
    pool, made = make(MiB)
    held = pool.take(MiB)
    extra = pool.take(MiB)  # the limit is full of buffers in use
    assert extra.nbytes == MiB and len(made) == 1
    pool.give(held, extra)
    st = pool.statistics()
    assert st.over_limit == 1 and st.kept_bytes == MiB and st.in_use_bytes == 0


def test_a_failed_allocation_leaves_the_counts_as_they_were():
    def allocate(n):
        raise MemoryError("pinned memory exhausted")

    pool = Pool(allocate, lambda n: np.empty(n, np.uint8), limit_bytes=8 * MiB)
    with pytest.raises(MemoryError):
        pool.take(MiB)
    st = pool.statistics()
    assert st.kept_bytes == st.in_use_bytes == st.allocations == 0


def test_clear_releases_free_buffers_only():
    pool, _ = make(8 * MiB)
    held = pool.take(MiB)
    pool.give(pool.take(2 * MiB))
    pool.clear()
    assert pool.statistics().kept_bytes == MiB
    pool.give(held)
    assert pool.statistics().kept_bytes == MiB  # a buffer in use when cleared is kept when given back
