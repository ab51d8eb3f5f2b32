"""CUDA codec cases; run by test_compress_cuda.py in a subprocess under the simulator.

Not collected directly (no ``test_`` prefix): NUMBA_ENABLE_CUDASIM must be set
before numba.cuda is imported. Small sizes: simulated threads are Python threads.
"""

import os

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":  # pragma: no cover - guard for direct runs
    pytest.skip("run through test_compress_cuda.py (needs NUMBA_ENABLE_CUDASIM=1)", allow_module_level=True)

from numba import cuda  # noqa: E402

from collectives.compress import get_codec  # noqa: E402
from collectives.kernels.reference import bits_equal  # noqa: E402


def sample(n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    x[n // 3 : n // 3 + 4] = 0.5  # ties for top-k
    if n > 10:
        x[n // 2] = np.nan
    x[min(7, n - 1)] = 1e-40
    return x


CASES = [("fp16", {}), ("bf16", {}), ("int8", {"block": 64}), ("int8", {"block": 50, "stochastic": True, "seed": 3}),
         ("topk", {"ratio": 0.05}), ("topk", {"ratio": 0.5})]  # fmt: skip


@pytest.mark.parametrize("n", [1, 130])
@pytest.mark.parametrize(("name", "kw"), CASES, ids=str)
def test_cuda_codec_equals_reference(name, kw, n):
    x = sample(n, n)
    ref, dev = get_codec(name, backend="numpy", **kw), get_codec(name, **kw)
    want = ref.encode(x)
    got = dev.encode(cuda.to_device(x))
    host = [g.copy_to_host() for g in got]
    assert all(bits_equal(w.view(np.uint16) if w.dtype.kind == "V" or w.dtype == np.float16 else w, h)
               for w, h in zip(want, host))  # fmt: skip
    assert bits_equal(dev.decode(got, (n,)).copy_to_host(), ref.decode(want, (n,)))


def test_cuda_int8_block_nan_and_all_zero():
    x = np.zeros(128, np.float32)
    x[70] = np.inf
    q, scale = get_codec("int8", block=64).encode(cuda.to_device(x))
    assert scale.copy_to_host()[0] == 0 and np.isnan(scale.copy_to_host()[1])
    assert (q.copy_to_host() == 0).all()


@pytest.mark.parametrize("name", ["int8", "topk", "fp16"])
def test_cuda_error_feedback_equals_host(name):
    kw = {"ratio": 0.1} if name == "topk" else {}
    dev = get_codec(name, error_feedback=True, **kw)
    host = get_codec(name, error_feedback=True, backend="numpy", **kw)
    for step in range(3):
        x = sample(90, 10 + step)
        x[45] = 0.0  # no NaN here: it would stick in the carried error
        dev.encode(cuda.to_device(x))
        host.encode(x)
    assert bits_equal(dev.errors[None].copy_to_host(), host.errors[None])
