"""The hierarchical all_gather, reduce_scatter and (pipelined) all_reduce on fake hosts (ranks as
tasks of one process, the hosts given by ``runtime.nodes``): every dtype and op against NumPy on 2
hosts x 2 and x 3 ranks, interleaved hosts, hosts of unequal sizes and a rank alone on its host,
arrays in several parts; the bytes each rank sends (a host's share, split among its ranks); what
the table picks; and shared memory off (the table's TCP choice runs)."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import collectives as C
from collectives import registry
from collectives.algorithms.shared_memory import all_gather_hierarchical
from runtime.sharedmem import segments
from runtime.topology import HostTopology

pytestmark = pytest.mark.timeout(120)
SHM_ON = segments.shm_usable()  # the suite also runs with RINGWEAVE_SHM=0: the answers are checked either way

DTYPES = [np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                np.int8, np.int32, np.int64, np.uint8)]
OPS = ["sum", "avg", "prod", "min", "max"]
# 2 hosts x 2 (the launcher's layout), 2 x 3, interleaved, unequal with a lone rank, 3 unequal interleaved
LAYOUTS = ["AABB", "AAABBB", "ABAB", "AAB", "ABCAB"]
FEW = [(DTYPES[2], "sum"), (DTYPES[1], "avg"), (DTYPES[6], "min"), (DTYPES[4], "prod"), (DTYPES[7], "max")]


def x_of(rank: int, count: int, dtype, op: str) -> np.ndarray:
    """Rank ``rank``'s input: small integers, exact in every dtype and in any order of reduction."""
    rng = np.random.default_rng([rank, count, OPS.index(op)])
    if op == "prod":
        v = 1 + (rng.random(count) < 0.3)  # 1 or 2: at most 2**6 over 6 ranks
    else:
        v = rng.integers(0 if op == "avg" or np.dtype(dtype).kind == "u" else -3, 4, count)
    return v.astype(np.float64).astype(dtype)


def reduced(n: int, count: int, dtype, op: str) -> np.ndarray:
    """NumPy's reduction over the n ranks' inputs (avg: floor for integers, as the API)."""
    stack = np.stack([x_of(r, count, dtype, op).astype(np.float64) for r in range(n)])
    if op == "avg":
        total = stack.sum(0)
        v = total // n if np.dtype(dtype).kind in "iu" else total / n
    else:
        v = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](stack, axis=0)
    return v.astype(dtype)


def block(rank: int, count: int, dtype) -> np.ndarray:
    return ((rank * 7 + np.arange(count)) % 97).astype(np.float64).astype(dtype)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))
    assert bad.size == 0, f"{what}: {bad.size} of {got.size} differ, first at {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_against_numpy_on_fake_hosts(ranks, monkeypatch, layout):
    """Blocks of 0, 1 and 7 elements (one part; every dtype and op on 2 x 2 and 2 x 3 ranks, a few
    elsewhere), then of 1001 cut into four parts (the part size made small); all_gather in place
    and not."""
    n = len(layout)
    monkeypatch.setattr(all_gather_hierarchical, "PART_MIN_NBYTES", 64)  # 1001 elements: 4 parts; up to 7: one

    async def body(g):
        g.runtime.nodes = list(layout)
        assert not g.topology.one_host
        for count in (0, 1, 7, 1001):
            every = count == 7 and layout in ("AABB", "AAABBB")
            combos = [(d, op) for d in DTYPES for op in OPS] if every else FEW
            for dtype, op in combos:
                x = x_of(g.rank, n * count, dtype, op)
                before = x.copy()
                out = np.full(count, 99, dtype)
                await C.reduce_scatter(out, x, op=op, group=g, algorithm="hierarchical")
                what = f"{layout} rank {g.rank} {dtype} {op} count {count}"
                want = reduced(n, n * count, dtype, op)[g.rank * count:(g.rank + 1) * count]
                same(out, want, f"reduce_scatter {what}")
                same(x, before, f"input unchanged {what}")
                await C.all_reduce(x, op=op, group=g, algorithm="hierarchical")
                same(x, reduced(n, n * count, dtype, op), f"all_reduce {what}")
            for dtype in DTYPES if every else DTYPES[1:3]:
                want = np.concatenate([block(r, count, dtype) for r in range(n)])
                out = np.zeros(n * count, dtype)
                await C.all_gather(out, block(g.rank, count, dtype), group=g, algorithm="hierarchical")
                same(out, want, f"all_gather {layout} rank {g.rank} {dtype} count {count}")
                inplace = np.zeros(n * count, dtype)  # x is this rank's block of out
                inplace[g.rank * count:(g.rank + 1) * count] = block(g.rank, count, dtype)
                await C.all_gather(inplace, inplace[g.rank * count:(g.rank + 1) * count], group=g,
                                   algorithm="hierarchical")
                same(inplace, want, f"all_gather in place {layout} rank {g.rank} {dtype} count {count}")
    await ranks(n, body, transport="tcp" if layout == "ABAB" else "memory")  # real sockets once


def group_on(nodes: str, shm: bool = True):
    """A stand-in group whose rank i is on host nodes[i] (what registry.choose reads of a group)."""
    return SimpleNamespace(topology=HostTopology.of(nodes), size=len(nodes), shm_enabled=shm)


@pytest.mark.skipif(not SHM_ON, reason="no usable /dev/shm: no hierarchical algorithm")
def test_the_table_picks_them_for_large_calls_on_hosts_with_several_ranks():
    big, small = 1 << 20, 64 << 10  # all_gather: the gathered bytes; reduce_scatter: the input's
    for nodes in ("aabb", "aaabbb", "abab", "aab", "aaaabbbbccccdddd"):
        world = len(nodes)
        assert registry.choose("all_gather", -(-big // world), world, group=group_on(nodes))[0] == "hierarchical"
        assert registry.choose("reduce_scatter", big, world, group=group_on(nodes))[0] == "hierarchical"
        assert registry.choose("all_gather", small // world, world, group=group_on(nodes))[0] != "hierarchical"
        assert registry.choose("reduce_scatter", small, world, group=group_on(nodes))[0] != "hierarchical"
    for group in (group_on("abcd"), group_on("aabb", shm=False)):  # a host each; shm off
        assert registry.choose("all_gather", 16 << 20, 4, group=group)[0] != "hierarchical"
        assert registry.choose("reduce_scatter", 16 << 20, 4, group=group)[0] != "hierarchical"
    # one host: shm's pipeline below 32 MiB (tests/collectives/test_registry_one_host.py: above it)
    assert registry.choose("all_gather", 4 << 20, 4, group=group_on("aaaa"))[0] == "shm"
    assert registry.choose("reduce_scatter", 16 << 20, 4, group=group_on("aaaa"))[0] == "shm"
    assert registry.choose("all_gather", 16 << 20, 4, group=group_on("aabb"), subcall=True)[0] == "ring"
    # only the all_reduce is given the leaders' algorithm
    assert registry.choose("all_gather", 16 << 20, 4, group=group_on("aabb"))[1] is all_gather_hierarchical.run


async def test_shared_memory_off_runs_the_tcp_table(ranks, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "0")

    async def body(g):
        g.runtime.nodes = list("AABB")
        out = np.zeros(4 * 3, np.int64)
        await C.all_gather(out, np.full(3, g.rank, np.int64), group=g, algorithm="hierarchical")
        o = np.zeros(2, np.int64)
        await C.reduce_scatter(o, np.arange(8, dtype=np.int64), group=g, algorithm="hierarchical")
        assert np.array_equal(out, np.repeat(np.arange(4), 3))
        assert np.array_equal(o, 4 * np.arange(2 * g.rank, 2 * g.rank + 2))
    await ranks(4, body)


@pytest.mark.skipif(not SHM_ON, reason="no usable /dev/shm: the table's TCP choice runs instead")
async def test_every_rank_sends_its_share_of_its_hosts_bytes(ranks):
    """2 hosts x 2 ranks, 1 MiB: each host sends (H-1)/H of the data to the other (all_reduce twice
    that), split evenly among its ranks; the flat ring would send 3/4, and the leaders-only
    all_reduce nothing from the second rank of each host."""
    nbytes = 1 << 20
    count = nbytes // 4

    async def body(g):
        g.runtime.nodes = list("AABB")
        x, out = np.ones(count, np.float32), np.empty(count, np.float32)
        calls = {"all_reduce": lambda: C.all_reduce(x, group=g, algorithm="hierarchical"),
                 "all_gather": lambda: C.all_gather(out, x[:count // 4], group=g, algorithm="hierarchical"),
                 "reduce_scatter": lambda: C.reduce_scatter(out[:count // 4], x, group=g, algorithm="hierarchical")}
        sent = {}
        for name, call in calls.items():
            await call()  # the first sets the domain up and grows the slots (messages of their own)
            before = g.runtime.actor.statistics().bytes_sent
            await call()
            sent[name] = g.runtime.actor.statistics().bytes_sent - before
        return sent
    for r, sent in enumerate(await ranks(4, body)):
        for name, share in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5)):
            want = share * nbytes / 2  # a host's bytes: share x nbytes; each of its 2 ranks half
            assert want <= sent[name] <= want * 1.01 + 2048, (r, name, sent[name], want)
