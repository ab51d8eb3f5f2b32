"""CUDA reduction cases; run by test_kernels_cuda.py in a subprocess under the simulator.

Not collected directly (no ``test_`` prefix in the file name): numba.cuda must
see NUMBA_ENABLE_CUDASIM=1 before it is first imported, which a shared pytest
process cannot promise. Sizes are small because simulated threads are Python
threads.
"""

import os

import numpy as np
import pytest

from collectives.kernels import reference

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":  # pragma: no cover - guard for direct runs
    pytest.skip("run through test_kernels_cuda.py (needs NUMBA_ENABLE_CUDASIM=1)", allow_module_level=True)

from numba import cuda  # noqa: E402

import collectives.kernels as kernels  # noqa: E402


same = reference.bits_equal  # bit-equal, or both NaN


def sample(dtype, n, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.int64:  # the simulator raises on int64 overflow (hardware wraps)
        return rng.integers(-(2**31), 2**31, n, dtype=dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)
    x[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40]
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", reference.DTYPES, ids=str)
@pytest.mark.parametrize("op", reference.OPS)
def test_cuda_reduce_matches_reference(op, dtype):
    n = 45  # > THREADS under the simulator, odd: exercises the grid-stride tail
    dst, src = sample(dtype, n, 1), sample(dtype, n, 2)
    want = reference.reduce_into(dst.copy(), src, op)
    d = cuda.to_device(dst)
    assert kernels.choose_backend(d, d) == "cuda"
    kernels.reduce_into(d, cuda.to_device(src), op)
    assert same(d.copy_to_host(), want), (op, dtype)


@pytest.mark.parametrize("n", [0, 1])
def test_cuda_tiny_lengths(n):
    d = cuda.to_device(np.full(n, 2.0, np.float32))
    kernels.reduce_into(d, cuda.to_device(np.full(n, 3.0, np.float32)), "prod")
    assert d.copy_to_host().tolist() == [6.0] * n


def test_bfloat16_as_uint16_view_with_logical_dtype():
    from collectives.kernels import cuda as kcuda

    dst, src = sample(reference.BFLOAT16, 40, 3), sample(reference.BFLOAT16, 40, 4)
    want = reference.reduce_into(dst.copy(), src, "sum")
    d = cuda.to_device(dst.view(np.uint16))
    kcuda.reduce_into(d, cuda.to_device(src.view(np.uint16)), "sum", logical_dtype="bfloat16")
    assert same(d.copy_to_host().view(reference.BFLOAT16), want)


def test_host_backend_refuses_device_arrays():
    d = cuda.to_device(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="cannot take device arrays"):
        kernels.reduce_into(d, d, "sum", backend="numba")
    with pytest.raises(TypeError, match="mixing device and host"):
        kernels.reduce_into(d, np.ones(3, np.float32), "sum")
