"""Device-array collectives (collectives/device.py) == NumPy, on a GPU and under the simulator.

One set of cases for two places (tests/cudasim.py): a real GPU (``pytest -m gpu``) and the CUDA
simulator (test_device.py runs this file in a fresh interpreter). Every rank contributes small
integers, which every dtype holds exactly, so the answers are closed forms whatever the order of
the reduction. Tiny segments (``RINGWEAVE_DEVICE_SEGMENT_KIB``) put several segments in flight.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import collectives as C
from collectives import device
from collectives.compress import get_codec
from collectives.device_pool import PINNED
from collectives.kernels import reference
from collectives.kernels.cuda import SIMULATOR, as_bfloat16
from runtime.errors import CollectiveError
from tests.devarrays import to_device, to_host

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(150)]
N = 37 if SIMULATOR else 3_000_001  # odd, not a multiple of the world size
COMPRESSED_N = 66 if SIMULATOR else 300_001  # simulated top-k costs ~1 s per 100 elements


@pytest.fixture
def segmented(monkeypatch):
    """Segments of 4 KiB and no host reduce: the pipelined path even for small arrays."""
    monkeypatch.setenv("RINGWEAVE_DEVICE_SEGMENT_KIB", "4" if SIMULATOR else "256")
    monkeypatch.setenv("RINGWEAVE_DEVICE_HOST_REDUCE_KIB", "0")


@pytest.fixture
def staged(monkeypatch):
    """Every call staged whole through the host collectives."""
    monkeypatch.setenv("RINGWEAVE_DEVICE_HOST_REDUCE_KIB", str(1 << 20))


@pytest.fixture
def pipelined_whole(monkeypatch):
    """The pipelined path with one segment: no host staging, default segments."""
    monkeypatch.setenv("RINGWEAVE_DEVICE_HOST_REDUCE_KIB", "0")


def contribution(rank: int, n: int, dtype) -> np.ndarray:
    """Rank r: (i % 5) + r + 1 (prod: 1 or 2), small integers that every dtype holds exactly."""
    return ((np.arange(n) % 5) + rank + 1).astype(dtype)


def closed_form(world: int, n: int, dtype, op: str) -> np.ndarray:
    k = (np.arange(n) % 5).astype(np.float64)
    ranks = np.arange(world)[:, None]
    v = k + ranks + 1
    want = {"sum": v.sum(0), "prod": v.prod(0), "min": v.min(0), "max": v.max(0),
            "avg": np.floor(v.sum(0) / world) if np.dtype(dtype).kind in "iu" else v.sum(0) / world}[op]
    return want.astype(dtype) if np.dtype(dtype).kind in "iu" or op != "avg" else \
        reference.divide_into(v.sum(0).astype(dtype), world)  # the float avg: divided in the compute dtype


CASES = [(np.float32, "sum"), (np.float16, "sum"), (reference.BFLOAT16, "avg"), (np.int32, "max"),
         (np.int8, "avg"), (np.float64, "avg"), (np.uint8, "min"), (np.int64, "prod")]  # fmt: skip


@pytest.mark.parametrize("path", ["staged", "pipelined"])
@pytest.mark.parametrize("dtype,op", CASES, ids=str)
async def test_all_reduce_on_device_equals_closed_form(ranks, request, path, dtype, op):
    request.getfixturevalue("segmented" if path == "pipelined" else "staged")
    n = N if op != "prod" else 40  # prod of 3 ranks: at most 7**3

    async def body(g):
        x = to_device(contribution(g.rank, n, dtype))
        await C.all_reduce(x, op=op)
        return to_host(x)

    want = closed_form(3, n, dtype, op)
    for got in await ranks(3, body):
        assert reference.bits_equal(got, want), (dtype, op)
    assert PINNED.statistics().in_use_bytes == 0


@pytest.mark.parametrize("path", ["staged", "pipelined"])
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (reference.BFLOAT16, "max"), (np.int32, "avg")], ids=str)
async def test_reduce_scatter_on_device_equals_closed_form(ranks, request, path, dtype, op):
    request.getfixturevalue("segmented" if path == "pipelined" else "staged")
    m = N

    async def body(g):
        x = to_device(contribution(g.rank, 3 * m, dtype))
        out = to_device(np.zeros(m, dtype))
        await C.reduce_scatter(out, x, op=op)
        return to_host(out)

    full = closed_form(3, 3 * m, dtype, op)
    for r, got in enumerate(await ranks(3, body)):
        assert reference.bits_equal(got, full[r * m:(r + 1) * m])


@pytest.mark.parametrize("path", ["staged", "one segment", "segmented"])
async def test_all_gather_and_broadcast_on_device(ranks, request, path):
    request.getfixturevalue({"staged": "staged", "one segment": "pipelined_whole",
                             "segmented": "segmented"}[path])

    async def body(g):
        x = cuda.to_device(np.arange(N, dtype=np.int32) + 1000 * g.rank)
        out = cuda.device_array(3 * N, np.int32)
        await C.all_gather(out, x)
        b = to_device(np.arange(N).astype(reference.BFLOAT16) if g.rank == 1 else np.zeros(N, reference.BFLOAT16))
        await C.broadcast(b, src=1)
        return out.copy_to_host(), to_host(b)

    for out, b in await ranks(3, body):
        np.testing.assert_array_equal(out, np.concatenate([np.arange(N) + 1000 * r for r in range(3)]))
        assert reference.bits_equal(b, np.arange(N).astype(reference.BFLOAT16))


def test_segments_cover_the_array_in_multiples_of_the_world():
    segs = device.segments(1000, 4, 3, segment_bytes=400)  # 100 elements -> 99, a multiple of 3
    assert segs[0] == (0, 99) and segs[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    assert device.segments(0, 4, 3) == [(0, 0)]
    assert device.segments(2, 8, 3, segment_bytes=4096) == [(0, 2)]


async def test_pool_keeps_its_buffers_across_a_sweep_of_sizes(ranks, segmented):
    """A second sweep of sizes allocates nothing: every buffer comes from the pool."""

    async def sweep(g):
        for n in (N, 2 * N, N // 2, 3 * N):
            x = to_device(contribution(g.rank, n, np.float32))
            await C.all_reduce(x)

    await ranks(3, sweep)
    before = PINNED.statistics()
    await ranks(3, sweep)
    after = PINNED.statistics()
    assert after.allocations == before.allocations and after.reuses > before.reuses
    assert after.in_use_bytes == 0 and after.kept_bytes <= after.limit_bytes


async def test_mismatched_lengths_fail_on_every_rank_and_return_the_buffers(ranks, segmented):
    async def body(g):
        x = to_device(contribution(g.rank, N + g.rank, np.float32))  # each rank a different length
        await C.all_reduce(x)

    results = await ranks(3, body, return_exceptions=True, timeout_s=20)
    assert all(isinstance(r, CollectiveError) for r in results), results
    assert PINNED.statistics().in_use_bytes == 0


async def test_bad_arguments_are_refused_before_any_message(ranks):
    async def body(g):
        x = cuda.to_device(np.zeros(6, np.float32))
        with pytest.raises(ValueError, match="expected group size 2"):
            await C.all_gather(cuda.device_array(5, np.float32), x)
        with pytest.raises(TypeError, match="must match"):
            await C.reduce_scatter(cuda.device_array(3, np.int32), x)
        with pytest.raises(TypeError, match="supported"):
            await C.all_reduce(cuda.to_device(np.zeros(4, np.uint16)))
        with pytest.raises(TypeError, match="16-bit words"):
            as_bfloat16(x)
        with pytest.raises(ValueError, match=r"x must be a C-contiguous device array .*shape \(3,\)"):
            await C.all_gather(cuda.device_array(6, np.float32), x[::2])

    await ranks(2, body)


@pytest.mark.parametrize("name", ["int8", "topk", "fp16", "int8+ef", "fp16-ring"])
async def test_compressed_all_reduce_on_device_uses_cuda_kernels_and_equals_host(ranks, name):
    """shard style: the codecs' CUDA kernels; fp16's default ring style: staged, the host's."""
    ef = name.endswith("+ef")
    style = "ring" if name.endswith("-ring") else "shard"
    name = name.removesuffix("-ring")

    async def body(g):
        dev_codec = get_codec(name.removesuffix("+ef"), error_feedback=ef)
        host_codec = get_codec(name.removesuffix("+ef"), error_feedback=ef)
        outs = []
        for step in range(2 if ef else 1):  # the second step carries the first one's residual
            x = np.random.default_rng(10 * g.rank + step).standard_normal(COMPRESSED_N).astype(np.float32)
            dev, host = cuda.to_device(x), x.copy()
            await C.all_reduce(dev, op="avg", compression=dev_codec, key="w", algorithm=style)
            await C.all_reduce(host, op="avg", compression=host_codec, key="w", algorithm=style)
            outs.append((dev.copy_to_host(), host))
        return outs

    for outs in await ranks(2, body):
        for dev, host in outs:
            assert reference.bits_equal(dev, host)  # the CUDA codec kernels give the host kernels' bits


def _producers():
    """Device arrays from every library at hand: ``__cuda_array_interface__`` objects are read
    through numba (zero copy); the simulator has numba's own arrays only."""
    makers = {"numba": cuda.to_device}
    if not SIMULATOR:
        class Interface:  # a bare __cuda_array_interface__ object, as an unknown library would give
            def __init__(self, host):
                self.keep = cuda.to_device(host)
                self.__cuda_array_interface__ = self.keep.__cuda_array_interface__

        makers["cuda_array_interface"] = Interface
        try:
            import cupy
            makers["cupy"] = cupy.asarray
        except ImportError:
            pass
        try:
            import torch
            if torch.cuda.is_available():
                makers["torch"] = lambda h: torch.from_numpy(h).cuda()
        except ImportError:
            pass
    return makers


@pytest.mark.parametrize("producer", sorted(_producers()))
async def test_all_reduce_takes_every_producer(ranks, producer):
    make = _producers()[producer]

    async def body(g):
        x = make(contribution(g.rank, N, np.float32))
        await C.all_reduce(x)
        return cuda.as_cuda_array(x).copy_to_host() if producer != "numba" else x.copy_to_host()

    for got in await ranks(2, body):
        np.testing.assert_array_equal(got, closed_form(2, N, np.float32, "sum"))
