"""CUDA codec kernels == the NumPy reference, bit for bit: casts, int8 (both roundings), top-k
(the selected set, ties to the lower index, order), decode-add and error feedback.

One set of cases for two places (tests/cudasim.py): a real GPU (``pytest -m gpu``) and the CUDA
simulator (test_compress_cuda.py runs this file in a fresh interpreter). Small sizes under the
simulator (simulated threads are Python threads); on a GPU the sizes cover many tiles and blocks.
"""

import numpy as np
import pytest
from numba import cuda

from collectives.compress import cuda as ccuda
from collectives.compress import get_codec
from collectives.compress import reference as cref
from collectives.kernels.cuda import SIMULATOR
from collectives.kernels.reference import bits_equal

pytestmark = pytest.mark.gpu
BIG = 100 if SIMULATOR else 3_000_017  # several top-k tiles (32 elements each under the simulator)


def sample(n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    x[n // 3 : n // 3 + 4] = 0.5  # ties for top-k
    if n > 10:
        x[n // 2] = np.nan
    x[min(7, n - 1)] = 1e-40
    return x


def words(a):
    """16-bit floats as their uint16 words (how device payloads carry them)."""
    return a.view(np.uint16) if a.dtype.kind == "V" or a.dtype == np.float16 else a


CASES = [("fp16", {}), ("bf16", {}), ("int8", {"block": 64}), ("int8", {"block": 50, "stochastic": True, "seed": 3}),
         ("int8", {}), ("topk", {"ratio": 0.05})] + ([] if SIMULATOR else [("topk", {"ratio": 0.5})])  # fmt: skip


@pytest.mark.parametrize("n", [1, 130] if SIMULATOR else [1, 130, BIG])
@pytest.mark.parametrize(("name", "kw"), CASES, ids=str)
def test_cuda_codec_equals_reference(name, kw, n):
    x = sample(n, n)
    ref, dev = get_codec(name, backend="numpy", **kw), get_codec(name, **kw)
    want = ref.encode(x)
    got = dev.encode(cuda.to_device(x))
    assert all(bits_equal(words(w), g.copy_to_host()) for w, g in zip(want, got))
    assert bits_equal(dev.decode(got, (n,)).copy_to_host(), ref.decode(want, (n,)))


@pytest.mark.parametrize(("name", "kw"), [("int8", {"block": 50}), ("topk", {"ratio": 0.1}), ("bf16", {})], ids=str)
def test_cuda_decode_add_equals_host(name, kw):
    """gather-decode-sum: out += decode(payload), fused on the device (int8: mul.rn then add)."""
    x, acc = sample(BIG, 5), sample(BIG, 6)
    acc[np.isnan(acc)] = 0
    ref, dev = get_codec(name, backend="numba", **kw), get_codec(name, **kw)
    payload = ref.encode(x)
    want = acc.copy()
    ref.decode_add(payload, want)
    out = cuda.to_device(acc)
    dev.decode_add(tuple(cuda.to_device(np.ascontiguousarray(words(p))) for p in payload), out)
    assert bits_equal(out.copy_to_host(), want)


@pytest.mark.parametrize("case", ["mixed", "all_equal", "k_is_n"])
def test_cuda_topk_selected_set_equals_reference(case):
    """The same k entries as the reference (np.partition): by |x| (float32 bits without the sign:
    NaN above inf), ties to the lower index, indices ascending; ties for the k-th place spread
    over several tiles."""
    rng = np.random.default_rng(7)
    n = BIG
    x = np.round(rng.standard_normal(n) * 2).astype(np.float32) / 2  # many equal magnitudes
    k = max(1, n // 5)
    if case == "all_equal":
        x[:] = -2.0
    elif case == "k_is_n":
        k = n
    else:
        x[::7] = -0.0
        x[1::7] = 0.0
        x[[3, n // 2]] = [np.inf, np.nan]
        x[n - 1] = -np.inf
    want_v, want_i = cref.topk_encode(x, k)
    got_v, got_i = ccuda.topk_encode(cuda.to_device(x), k)
    assert np.array_equal(got_i.copy_to_host(), want_i)
    assert bits_equal(got_v.copy_to_host(), want_v)


def test_cuda_int8_block_nan_and_all_zero():
    x = np.zeros(128, np.float32)
    x[70] = np.inf
    q, scale = get_codec("int8", block=64).encode(cuda.to_device(x))
    assert scale.copy_to_host()[0] == 0 and np.isnan(scale.copy_to_host()[1])
    assert (q.copy_to_host() == 0).all()


@pytest.mark.parametrize("name", ["int8", "int8-stochastic", "topk", "fp16", "bf16"])
def test_cuda_error_feedback_equals_host(name):
    """The carried residual after 3 steps is bit-equal to the host's: on a GPU, int8's
    y - q * scale was once contracted into an FMA (24-46 of 90 residuals off by up to 7.5e-6)."""
    kw = {"ratio": 0.1} if name == "topk" else {"stochastic": True, "seed": 1} if name.endswith("stochastic") else {}
    codec = name.split("-")[0]
    dev = get_codec(codec, error_feedback=True, **kw)
    host = get_codec(codec, error_feedback=True, backend="numpy", **kw)
    n = 90 if SIMULATOR else 1_000_003
    for step in range(2 if SIMULATOR and codec == "topk" else 3):  # simulated top-k: ~2 s a step
        x = sample(n, 10 + step)
        x[n // 2] = 0.0  # no NaN here: it would stick in the carried error
        dev.encode(cuda.to_device(x))
        host.encode(x)
    assert bits_equal(dev.errors[None].copy_to_host(), host.errors[None])


def test_cuda_zeros_are_zero():
    assert not ccuda.zeros(1000).copy_to_host().any()
