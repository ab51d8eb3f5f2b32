"""The fused reduce-and-publish kernel equals the obvious one (``reduce_into`` per source, then a
copy), bit for bit, for every dtype, op and number of sources, NaNs included."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from collectives.slots.memops import reduce_publish, reduce_publish_reference, stream_copy

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


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint8, np.float16])
@pytest.mark.parametrize("count", [0, 1, 31, 33, 1000, 100_003])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 0), (0, 3), (5, 7)])
def test_stream_copy_equals_copyto(dtype, count, offsets):
    """The non-temporal copy (aligned middle, plain head and tail) gives np.copyto's bytes, and
    writes nothing outside ``dst``."""
    rng = np.random.default_rng(count)
    src_base = rng.integers(0, 255, (count + 16) * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    dst_base = np.zeros(count + 16, dtype)
    do, so = offsets
    src, dst = src_base[so:so + count], dst_base[do:do + count]
    want = dst_base.copy()
    want[do:do + count] = src
    stream_copy(dst, src)
    assert dst_base.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
