"""Numba CPU reductions == NumPy reference, for every (op, dtype) and awkward lengths.

Equality is bit-exact; the only freedom is NaN payloads (both NaN counts as
equal), which the reference docstring leaves out of the contract.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.kernels import cpu, reference

LENGTHS = [0, 1, 2, 7, 33, 1001]


same = reference.bits_equal  # bit-equal, or both NaN


def sample(dtype, n, seed):
    """Values that exercise rounding, wrap-around, NaN, inf and signed zeros."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 3e38, 65504.0, 1e-40])
    pick = rng.random(n) < 0.2
    x[pick] = rng.choice(specials, pick.sum())
    with np.errstate(all="ignore"):
        return x.astype(dtype)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", reference.DTYPES, ids=str)
@pytest.mark.parametrize("op", reference.OPS)
def test_reduce_matches_reference(op, dtype, length):
    dst, src = sample(dtype, length, 1), sample(dtype, length, 2)
    want = reference.reduce_into(dst.copy(), src, op)
    got = dst.copy()
    assert cpu.reduce_into(got, src, op) is got
    assert same(got, want), (op, dtype, dst, src, got, want)


@pytest.mark.parametrize("dtype", reference.DTYPES, ids=str)
def test_reduce_keeps_shape_and_works_on_2d(dtype):
    dst, src = sample(dtype, 24, 3).reshape(4, 6), sample(dtype, 24, 4).reshape(4, 6)
    want = reference.reduce_into(dst.copy(), src, "sum")
    got = cpu.reduce_into(dst.copy(), src, "sum")
    assert got.shape == (4, 6) and same(got, want)


@pytest.mark.parametrize("op", ["min", "max"])
def test_min_max_nan_and_signed_zero_rule(op):
    a = np.array([np.nan, 1.0, 0.0, -0.0, np.nan], np.float32)
    b = np.array([1.0, np.nan, -0.0, 0.0, -np.nan], np.float32)
    got = cpu.reduce_into(a.copy(), b, op)
    assert np.isnan(got[:2]).all() and not np.signbit(got[0]) and np.signbit(got[4]) is np.False_
    # equal operands (including -0.0 vs +0.0) give src
    assert list(np.signbit(got[2:4])) == [True, False]
    assert same(got, reference.reduce_into(a.copy(), b, op))


def test_integer_wraps_without_warning():
    a = np.array([127, -128, 100], np.int8)
    with np.errstate(all="raise"):
        got = cpu.reduce_into(a.copy(), np.array([1, -1, 100], np.int8), "sum")
    assert got.tolist() == [-128, 127, -56]
    big = np.array([2**62], np.int64)
    assert cpu.reduce_into(big.copy(), np.array([4], np.int64), "prod").tolist() == [0]


@pytest.mark.parametrize("dtype", reference.DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 300])
def test_divide_matches_reference(dtype, n):
    x = sample(dtype, 101, 5)
    want = reference.divide_into(x.copy(), n)
    assert same(cpu.divide_into(x.copy(), n), want)


def test_divide_integer_floors():
    x = np.array([-7, 7, -1, 0], np.int32)
    assert cpu.divide_into(x.copy(), 2).tolist() == [-4, 3, -1, 0]
    assert reference.divide_into(x.copy(), 2).tolist() == [-4, 3, -1, 0]
    assert cpu.divide_into(np.array([-100, 100], np.int8), 200).tolist() == [-1, 0]


@pytest.mark.parametrize("dtype", reference.DTYPES, ids=str)
@pytest.mark.parametrize("factor", [0, 1, 3, -2, 1000])
def test_scale_matches_reference(dtype, factor):
    x = sample(dtype, 101, 6)
    want = reference.scale_into(x.copy(), factor)
    assert same(cpu.scale_into(x.copy(), factor), want)


@pytest.mark.parametrize("dtype", reference.FLOAT_DTYPES, ids=str)
def test_scale_by_fraction_matches_reference(dtype):
    x = sample(dtype, 101, 7)
    assert same(cpu.scale_into(x.copy(), 0.1), reference.scale_into(x.copy(), 0.1))


def test_integer_scale_needs_integer_factor():
    for impl in (cpu, reference):
        with pytest.raises(TypeError, match="integer factor"):
            impl.scale_into(np.ones(3, np.int32), 0.5)


@pytest.mark.parametrize("impl", [cpu, reference], ids=["numba", "numpy"])
def test_bad_operands_are_named(impl):
    a = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="avg is sum then divide_into"):
        impl.reduce_into(a, a.copy(), "avg")
    with pytest.raises(TypeError, match="dtype mismatch"):
        impl.reduce_into(a, np.ones(3, np.float64), "sum")
    with pytest.raises(ValueError, match="shape mismatch"):
        impl.reduce_into(a, np.ones(4, np.float32), "sum")
    with pytest.raises(TypeError, match="unsupported dtype"):
        impl.reduce_into(np.ones(3, np.complex64), np.ones(3, np.complex64), "sum")
    with pytest.raises(ValueError, match="positive integer"):
        impl.divide_into(a, 0)
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        impl.reduce_into(ro, a, "sum")


def test_non_contiguous_is_refused_by_numba():
    a = np.ones(10, np.float32)[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu.reduce_into(a, a.copy(), "sum")


@settings(max_examples=60, deadline=None)
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=40), op=st.sampled_from(reference.OPS))
def test_any_float32_bit_patterns(bits, op):
    x = np.array(bits, np.uint32).view(np.float32)
    dst, src = x[: len(x) // 2].copy(), x[len(x) // 2 : 2 * (len(x) // 2)].copy()
    assert same(cpu.reduce_into(dst.copy(), src, op), reference.reduce_into(dst.copy(), src, op))


def test_warmup_compiles_everything():
    assert cpu.warmup() >= 0.0
    assert cpu.warmup() < 0.5  # second call: nothing left to compile


def test_bits_equal_is_the_contracts_equality():
    """reference.bits_equal: equal bits, or both NaN (any payload); -0.0 is not +0.0; dtype and
    shape must match."""
    import ml_dtypes
    eq = reference.bits_equal
    quiet, payload = np.array([np.nan], np.float32), np.array([0x7FC00001], np.uint32).view(np.float32)
    assert eq(quiet, payload) and not eq(quiet, np.array([1.0], np.float32))
    assert not eq(np.array([-0.0]), np.array([0.0]))
    assert not eq(np.ones(2, np.float32), np.ones(2, np.float64))
    assert not eq(np.ones(2), np.ones((2, 1)))
    bf = np.array([np.nan, 1.5], ml_dtypes.bfloat16)
    assert eq(bf, bf.copy()) and not eq(bf, np.array([np.nan, 2.0], ml_dtypes.bfloat16))
    assert eq(np.array([3, -1], np.int8), np.array([3, -1], np.int8))
    assert not eq(np.array([3, -1], np.int8), np.array([3, 1], np.int8))
