"""Each codec: Numba == NumPy reference (bit-exact), stated error bounds, wire sizes."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from collectives.compress import CODECS, ErrorFeedback, get_codec, reference
from collectives.compress.topk import topk_count
from collectives.kernels.reference import bits_equal

LENGTHS = [0, 1, 2, 255, 256, 257, 1001, 4099]
BIT_EXACT = [("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"block": 7}),
             ("int8", {"stochastic": True, "seed": 5}), ("topk", {}), ("topk", {"ratio": 0.3}),
             ("none", {})]  # fmt: skip


def sample(n, seed, specials=True):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4, n)).astype(np.float32)
    if specials and n > 10:
        x[rng.integers(0, n, 3)] = [0.0, -0.0, 1e-40]
        x[n // 2 : n // 2 + 5] = 0.25  # exact ties for top-k
    return x


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("name", "kw"), BIT_EXACT, ids=lambda v: str(v))
def test_numba_encode_decode_equals_numpy(name, kw, n):
    x = sample(n, n)
    ref, fast = get_codec(name, backend="numpy", **kw), get_codec(name, backend="numba", **kw)
    want, got = ref.encode(x), fast.encode(x)
    assert len(want) == len(got) and all(bits_equal(w, g) for w, g in zip(want, got))
    assert bits_equal(ref.decode(want, (n,)), fast.decode(got, (n,)))
    assert sum(a.nbytes for a in got) == fast.wire_nbytes(n)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "topk"])
def test_non_finite_inputs_agree(name):
    x = sample(600, 1)
    x[[3, 300, 301]] = [np.nan, np.inf, -np.inf]
    want = get_codec(name, backend="numpy").encode(x)
    got = get_codec(name, backend="numba").encode(x)
    assert all(bits_equal(w, g) for w, g in zip(want, got))


def test_int8_block_with_nan_or_inf_decodes_to_nan_and_others_survive():
    x = np.ones(512, np.float32)
    x[3] = np.inf
    for backend in ("numpy", "numba"):
        codec = get_codec("int8", backend=backend)
        out = codec.decode(codec.encode(x), x.shape)
        assert np.isnan(out[:256]).all() and (out[256:] == 1.0).all()


finite32 = hnp.arrays(np.float32, st.integers(1, 700),
                      elements=st.floats(-2.0**100, 2.0**100, width=32, allow_subnormal=True))  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(x=finite32, block=st.sampled_from([1, 3, 64, 256]), stochastic=st.booleans())
def test_int8_error_bound(x, block, stochastic):
    codec = get_codec("int8", block=block, stochastic=stochastic, seed=1)
    q, scale = codec.encode(x)
    err = np.abs(codec.decode((q, scale), x.shape).astype(np.float64) - x)
    step = np.repeat(scale.astype(np.float64), block)[: x.size]
    bound = step * ((1.0 if stochastic else 0.5) + 1e-4)
    flushed = np.repeat(scale == 0, block)[: x.size]  # absmax < 2**-100: sent as zeros
    bound[flushed] = 2.0**-100
    assert (err <= bound).all(), (err - bound).max()
    assert bits_equal(q, get_codec("int8", block=block, stochastic=stochastic, seed=1, backend="numpy").encode(x)[0])


@settings(max_examples=40, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 500), elements=st.floats(-65504.0, 65504.0, width=32)))
def test_cast_error_bounds(x):
    for name, rel, tiny in (("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 2.0**-134)):
        codec = get_codec(name)
        err = np.abs(codec.decode(codec.encode(x), x.shape).astype(np.float64) - x)
        assert (err <= np.maximum(rel * np.abs(x), tiny)).all(), name


@settings(max_examples=40, deadline=None)
@given(x=finite32, ratio=st.sampled_from([0.01, 0.1, 0.5, 1.0]))
def test_topk_bound_and_equality(x, ratio):
    codec = get_codec("topk", ratio=ratio)
    values, indices = codec.encode(x)
    k = topk_count(x.size, ratio)
    assert values.size == k and (np.diff(indices) > 0).all()
    dropped = np.delete(np.abs(x), indices)
    if dropped.size:
        assert dropped.max() <= np.abs(values).min()
    assert bits_equal(indices, get_codec("topk", ratio=ratio, backend="numpy").encode(x)[1])
    residual = x - codec.decode((values, indices), x.shape)
    # equality when all magnitudes tie (e.g. all ones): allow rounding of the bound itself
    assert np.sum(residual.astype(np.float64) ** 2) <= (1 - k / x.size) * np.sum(x.astype(np.float64) ** 2) * (1 + 1e-12) + 1e-30


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_topk_ties_go_to_lower_index_and_nan_beats_inf(backend):
    x = np.array([1.0, -3.0, 3.0, 2.0, -3.0, 0.5], np.float32)
    codec = get_codec("topk", ratio=0.5, backend=backend)  # k = 3
    values, indices = codec.encode(x)
    assert indices.tolist() == [1, 2, 4] and values.tolist() == [-3.0, 3.0, -3.0]
    codec = get_codec("topk", ratio=0.34, backend=backend)  # k = 2: the first two of the three 3s
    assert codec.encode(x)[1].tolist() == [1, 2]
    y = np.array([np.inf, 1.0, np.nan, -np.inf], np.float32)
    assert get_codec("topk", ratio=0.25, backend=backend).encode(y)[1].tolist() == [2]


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = np.full(4096, 0.3, np.float32)
    x[0] = 1.0  # absmax 1: 0.3 * 127 = 38.1 sits between two codes
    a, b = get_codec("int8", block=4096, stochastic=True, seed=7), get_codec("int8", block=4096, stochastic=True, seed=7)
    first = a.encode(x)[0]
    assert bits_equal(first, b.encode(x)[0])  # same seed, same call number: same codes
    assert not bits_equal(first, a.encode(x)[0])  # next call: a new stream
    assert set(np.unique(first[1:])) == {38, 39}
    mean = np.mean([a.decode(a.encode(x), x.shape)[1:].mean() for _ in range(20)])
    assert abs(mean - 0.3) < 1e-3  # nearest rounding would be off by 0.1 / 127 * 127 ... = 0.0008
    nearest = get_codec("int8", block=4096)
    assert abs(nearest.decode(nearest.encode(x), x.shape)[1] - 0.3) > 5e-4


def test_uniform_hash_matches_between_numpy_and_numba():
    from collectives.compress import cpu

    key = reference.stream_key(123, 4)
    u = reference.uniform(key, 1000)
    assert ((u >= 0) & (u < 1)).all() and abs(u.mean() - 0.5) < 0.05
    assert all(np.float32(cpu.uniform_at(np.uint64(key), i)) == u[i] for i in (0, 1, 999))


@pytest.mark.parametrize(("name", "kw", "limit"), [("int8", {}, 0.27), ("topk", {}, 0.025),
                                                   ("fp16", {}, 0.5), ("bf16", {}, 0.5)])  # fmt: skip
def test_wire_ratio(name, kw, limit):
    n = 1 << 20
    codec = get_codec(name, **kw)
    assert codec.wire_nbytes(n) <= limit * 4 * n
    assert sum(a.nbytes for a in codec.encode(np.ones(n, np.float32))) == codec.wire_nbytes(n)


def test_registry():
    assert set(CODECS) == {"none", "fp16", "bf16", "int8", "topk", "powersgd"}
    assert get_codec("int8", block=128).block == 128
    codec = get_codec("topk")
    assert get_codec(codec) is codec
    wrapped = get_codec("topk", error_feedback=True, ratio=0.1)
    assert isinstance(wrapped, ErrorFeedback) and wrapped.codec.ratio == 0.1
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        get_codec("zip")
    with pytest.raises(ValueError, match="lossy"):
        get_codec("none", error_feedback=True)
    with pytest.raises(ValueError, match="options"):
        get_codec(codec, ratio=0.5)
    with pytest.raises(TypeError):
        get_codec("fp16", block=3)
    with pytest.raises(TypeError, match="floating-point"):
        get_codec("int8").encode(np.ones(3, np.int32))
    with pytest.raises(ValueError, match="ratio"):
        get_codec("topk", ratio=0.0)


def test_codecs_accept_other_float_dtypes_and_shapes():
    x = sample(60, 3).reshape(6, 10)
    for name in ("fp16", "bf16", "int8", "topk"):
        codec = get_codec(name)
        out = codec.decode(codec.encode(x.astype(np.float64)), x.shape)
        assert out.shape == (6, 10) and out.dtype == np.float32
        assert math.isclose(codec.wire_nbytes((6, 10)), codec.wire_nbytes(60))


@pytest.mark.parametrize("n", [1, 255, 257, 4099])
@pytest.mark.parametrize(("name", "kw"), BIT_EXACT + [("powersgd", {"rank": 2})], ids=lambda v: str(v))
def test_payload_nbytes_is_what_encode_returns_array_by_array(name, kw, n):
    """compressed.py sizes its packed messages from payload_nbytes without encoding, so each
    array's size, in order, must be what encode returns (with and without error feedback)."""
    shape = (n,) if name != "powersgd" else (n, 3)
    codecs = [get_codec(name, **kw)]
    if codecs[0].lossy:  # error feedback wraps lossy codecs only
        codecs.append(ErrorFeedback(get_codec(name, **kw)))
    for codec in codecs:
        payload = codec.encode(sample(int(np.prod(shape)), n).reshape(shape))
        assert [a.nbytes for a in payload] == list(codec.payload_nbytes(shape)), codec
        assert sum(codec.payload_nbytes(shape)) == codec.wire_nbytes(shape)
