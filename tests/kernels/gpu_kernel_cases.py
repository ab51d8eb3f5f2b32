"""CUDA reduction kernels == the NumPy reference, bit for bit, for every op and dtype.

One set of cases for two places (tests/cudasim.py): a real GPU (``pytest -m gpu``, collected
where numba.cuda finds a device) and the CUDA simulator (test_kernels_cuda.py runs this file in a
fresh interpreter with NUMBA_ENABLE_CUDASIM=1). Sizes are small because simulated threads are
Python threads; on a GPU the long case also runs a grid-stride loop over many blocks.
"""

import numpy as np
import pytest
from numba import cuda

from collectives import kernels
from collectives.kernels import cuda as kcuda
from collectives.kernels import reference
from tests.devarrays import to_device, to_host

pytestmark = pytest.mark.gpu
same = reference.bits_equal  # bit-equal, or both NaN
N = 75 if kcuda.SIMULATOR else 1_000_003  # > THREADS x blocks under the simulator, odd: the grid-stride tail


def sample(dtype, n, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.int64:  # the simulator warns on int64 overflow (hardware wraps)
        return rng.integers(-(2**31), 2**31, n, dtype=dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)
    x[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 65520.0, -6e-8]  # overflow / underflow in fp16
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@pytest.mark.parametrize("dtype", reference.DTYPES, ids=str)
@pytest.mark.parametrize("op", reference.OPS)
def test_cuda_reduce_matches_reference(op, dtype):
    dst, src = sample(dtype, N, 1), sample(dtype, N, 2)
    want = reference.reduce_into(dst.copy(), src, op)
    d = to_device(dst)
    assert kernels.choose_backend(d, d) == "cuda"
    kernels.reduce_into(d, to_device(src), op)
    assert same(to_host(d), want), (op, dtype)


@pytest.mark.parametrize("dtype", reference.DTYPES, ids=str)
@pytest.mark.parametrize("op", [*reference.OPS, "avg"])
def test_cuda_fold_equals_reduce_steps_in_block_order(op, dtype):
    """fold_into == world - 1 reduce_into calls (block order) then divide_into for avg."""
    world, m = 3, N // 3
    blocks = np.concatenate([sample(dtype, m, 10 + j) for j in range(world)])
    want = blocks[:m].copy()
    for j in range(1, world):
        reference.reduce_into(want, blocks[j * m:(j + 1) * m], "sum" if op == "avg" else op)
    if op == "avg":
        reference.divide_into(want, world)
    out = to_device(np.zeros(m, dtype))
    kcuda.fold_into(out, to_device(blocks), world, "sum" if op == "avg" else op, world if op == "avg" else 0)
    assert same(to_host(out), want), (op, dtype)


@pytest.mark.parametrize("n", [0, 1])
def test_cuda_tiny_lengths(n):
    d = cuda.to_device(np.full(n, 2.0, np.float32))
    kernels.reduce_into(d, cuda.to_device(np.full(n, 3.0, np.float32)), "prod")
    assert d.copy_to_host().tolist() == [6.0] * n


def test_bfloat16_as_words_with_logical_dtype():
    dst, src = sample(reference.BFLOAT16, 40, 3), sample(reference.BFLOAT16, 40, 4)
    want = reference.reduce_into(dst.copy(), src, "sum")
    d = cuda.to_device(dst.view(np.uint16))
    kcuda.reduce_into(d, cuda.to_device(src.view(np.uint16)), "sum", logical_dtype="bfloat16")
    assert same(d.copy_to_host().view(reference.BFLOAT16), want)
    wrapped = kcuda.as_bfloat16(cuda.to_device(dst.view(np.uint16)))  # the same through Bits16
    kernels.reduce_into(wrapped, kcuda.as_bfloat16(cuda.to_device(src.view(np.uint16))), "sum")
    assert same(to_host(wrapped), want) and kcuda.logical_dtype(wrapped) == reference.BFLOAT16


def test_bits16_refuses_other_widths_and_dtypes():
    with pytest.raises(TypeError, match="16-bit words"):
        kcuda.as_bfloat16(cuda.to_device(np.zeros(3, np.float32)))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        kcuda.Bits16(cuda.to_device(np.zeros(3, np.uint16)), np.int16)


def test_host_backend_refuses_device_arrays():
    d = cuda.to_device(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="cannot take device arrays"):
        kernels.reduce_into(d, d, "sum", backend="numba")
    with pytest.raises(TypeError, match="mixing device and host"):
        kernels.reduce_into(d, np.ones(3, np.float32), "sum")


def test_kernels_on_a_stream_without_sync():
    s = cuda.stream()
    a, b = to_device(np.arange(5, dtype=np.float32)), to_device(np.ones(5, np.float32))
    kcuda.reduce_into(a, b, "sum", stream=s, sync=False)
    s.synchronize()
    assert to_host(a).tolist() == [1, 2, 3, 4, 5]
