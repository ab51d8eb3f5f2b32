"""The fused reduce-and-publish kernel equals the obvious one (``reduce_into`` per source, then a
copy), bit for bit, for every dtype, op and number of sources, NaNs included."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from collectives.shm.kernels import reduce_publish, reduce_publish_reference

DTYPES = [np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                np.int8, np.int32, np.int64, np.uint8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_fused_equals_reference(dtype, op):
    rng = np.random.default_rng(7)
    for nsrc in range(0, 8):
        for count in (0, 1, 5, 1031):
            def draw():
                if dtype.kind == "f" or dtype == DTYPES[1]:  # bfloat16 has kind "V"
                    a = (rng.standard_normal(count) * 100).astype(dtype)
                    if count > 3:
                        a[rng.integers(count)] = np.nan
                        a[rng.integers(count)] = -0.0
                    return a
                info = np.iinfo(dtype)
                return rng.integers(info.min, info.max, count, endpoint=True).astype(dtype)
            srcs = [draw() for _ in range(nsrc)]
            dst = draw()
            dst2 = dst.copy()
            pub = np.zeros_like(dst)
            pub2 = np.zeros_like(dst)
            reduce_publish(dst, srcs, pub, op)
            reduce_publish_reference(dst2, srcs, pub2, op)
            what = f"{dtype} {op} {nsrc} sources, {count} elements"
            assert np.array_equal(dst.view(np.uint8), dst2.view(np.uint8)), what
            assert np.array_equal(pub.view(np.uint8), pub2.view(np.uint8)), what
