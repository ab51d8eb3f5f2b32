"""collectives.kernels.reduce_into: backend choice, overrides and the environment variable."""

import numpy as np
import pytest

import collectives.kernels as kernels
from collectives.kernels import reference


def test_default_is_numba_for_contiguous_and_numpy_otherwise(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    a = np.ones(8, np.float32)
    assert kernels.choose_backend(a, a) == "numba"
    assert kernels.choose_backend(a[::2], a[::2]) == "numpy"


def test_non_contiguous_falls_back_and_is_correct(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    dst, src = np.arange(10, dtype=np.float32), np.arange(20, dtype=np.float32)[::2]
    want = dst + src
    kernels.reduce_into(dst, src, "sum")
    assert (dst == want).all()


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_environment_override(monkeypatch, name):
    monkeypatch.setenv(kernels.ENV_VAR, name)
    a = np.ones(4, np.float32)
    assert kernels.choose_backend(a, a) == name
    assert kernels.choose_backend(a, a, backend="numpy") == "numpy"  # argument beats environment


def test_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "fortran")
    with pytest.raises(ValueError, match="RINGWEAVE_KERNELS.*fortran"):
        kernels.choose_backend(np.ones(1))


def test_backend_argument_validation(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.reduce_into(a, a.copy(), "sum", backend="gpu")
    with pytest.raises(TypeError, match="cannot take host arrays"):
        kernels.reduce_into(a, a.copy(), "sum", backend="cuda")


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("dtype", reference.DTYPES, ids=str)
def test_every_backend_gives_the_closed_form_answer(backend, dtype):
    # four "ranks" contribute r = 0..3: the sum is 6, the average (floor for ints) 1.5 -> 1
    acc = np.zeros(5, dtype)
    for r in range(1, 4):
        kernels.reduce_into(acc, np.full(5, r, dtype), "sum", backend=backend)
    assert (acc.astype(np.float64) == 6).all()
    kernels.divide_into(acc, 4, backend=backend)
    want = 1.5 if dtype in reference.FLOAT_DTYPES else 1
    assert (acc.astype(np.float64) == want).all()
    kernels.scale_into(acc, 2, backend=backend)
    assert (acc.astype(np.float64) == 2 * want).all()
