"""Device-array collectives under the CUDA simulator (run by test_device.py in a subprocess with
NUMBA_ENABLE_CUDASIM=1; on a GPU box, run this file directly with the variable unset)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import collectives as C
from collectives.compress import get_codec

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.int32, "max"), (np.float64, "avg")])
async def test_all_reduce_on_device_equals_host(ranks, dtype, op):
    async def body(g):
        x = (np.arange(37) % 5 + g.rank).astype(dtype)
        host = x.copy()
        dev = cuda.to_device(x)
        await C.all_reduce(dev, op=op)
        await C.all_reduce(host, op=op)
        return dev.copy_to_host(), host

    for dev, host in await ranks(3, body):
        np.testing.assert_array_equal(dev, host)


async def test_all_gather_and_broadcast_on_device(ranks):
    async def body(g):
        x = cuda.to_device(np.full(5, g.rank, np.int32))
        out = cuda.device_array(15, np.int32)
        await C.all_gather(out, x)
        b = cuda.to_device(np.arange(4.0) if g.rank == 1 else np.zeros(4))
        await C.broadcast(b, src=1)
        return out.copy_to_host(), b.copy_to_host()

    for out, b in await ranks(3, body):
        np.testing.assert_array_equal(out, np.repeat(np.arange(3), 5))
        np.testing.assert_array_equal(b, np.arange(4.0))


@pytest.mark.parametrize("name", ["int8", "topk", "fp16", "int8+ef"])
async def test_compressed_all_reduce_on_device_uses_cuda_kernels_and_equals_host(ranks, name):
    ef = name.endswith("+ef")

    async def body(g):
        dev_codec = get_codec(name.removesuffix("+ef"), error_feedback=ef)
        host_codec = get_codec(name.removesuffix("+ef"), error_feedback=ef)
        outs = []
        for step in range(2):  # the second step carries the first one's residual
            x = np.random.default_rng(10 * g.rank + step).standard_normal(300).astype(np.float32)
            dev, host = cuda.to_device(x), x.copy()
            await C.all_reduce(dev, op="avg", compression=dev_codec, key="w", algorithm="shard")
            await C.all_reduce(host, op="avg", compression=host_codec, key="w", algorithm="shard")
            outs.append((dev.copy_to_host(), host))
        return outs

    for outs in await ranks(2, body):
        for dev, host in outs:
            np.testing.assert_array_equal(dev, host)  # the CUDA codec kernels give the host kernels' bits
