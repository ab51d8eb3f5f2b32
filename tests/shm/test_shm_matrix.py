"""The shared-memory collectives over a matrix, ranks as tasks of one process (they map the same
segments; their waits are cooperative): world sizes 1-4 x lengths 0, 1, odd, over the small
slot, over the data slot, ~1e6 x every dtype x op, against closed-form answers. Also: the
hierarchical all_reduce on fake nodes, the fall-backs, segment growth, calls in flight,
bit-identical results across ranks, and names gone from /dev/shm once set up."""

from __future__ import annotations

import asyncio
import os

import ml_dtypes
import numpy as np
import pytest

import collectives as C
from collectives import registry
from runtime.sharedmem import domains, segments

pytestmark = pytest.mark.timeout(120)
# the suite also runs with RINGWEAVE_SHM=0 (calls naming "shm" then run the table's choice): tests
# about the shared memory itself are skipped then, the answers are checked either way
SHM_ON = segments.shm_usable()
needs_shm = pytest.mark.skipif(not SHM_ON, reason="RINGWEAVE_SHM=0: no shared memory to look at")

DTYPES = [np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                np.int8, np.int32, np.int64, np.uint8)]
OPS = ["sum", "avg", "prod", "min", "max"]
WORLDS = [1, 2, 3, 4]
LARGE = 1_000_003
# 16_385 float32 elements are just over the 64 KiB small slot: the data-slot path with few elements
LENGTHS = [0, 1, 7, 16_385]


def contribution(rank: int, n: int, count: int, dtype, op: str) -> np.ndarray:
    """Rank r's input: sum/avg r+1+k, prod 2 on odd ranks else 1, min/max (r+i)%n+k (k = i%7)."""
    i = np.arange(count)
    k = i % 7
    if op in ("sum", "avg"):
        v = rank + 1 + k
    elif op == "prod":
        v = np.full(count, 2 if rank % 2 else 1)
    else:
        v = (rank + i) % n + k
    return v.astype(np.float64).astype(dtype)


def expected(n: int, count: int, dtype, op: str) -> np.ndarray:
    k = np.arange(count) % 7
    total = n * (n + 1) // 2 + n * k
    v = {"sum": total,
         "avg": total // n if np.dtype(dtype).kind in "iu" else total / n,
         "prod": np.full(count, 2 ** (n // 2)),
         "min": k,
         "max": n - 1 + k}[op]
    return np.asarray(v, np.float64).astype(dtype)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
        f"{what}: first difference at {np.flatnonzero(got != want)[:5]}: {got[:8]} != {want[:8]}"


def combos(count: int):
    if count >= LARGE:
        return [(np.dtype(np.float32), "sum"), (DTYPES[1], "avg"), (np.dtype(np.int32), "max"),
                (np.dtype(np.float64), "min"), (np.dtype(np.int8), "prod")]
    return [(d, op) for d in DTYPES for op in OPS]


def _cases():
    for n in WORLDS:
        for count in LENGTHS + [LARGE]:
            yield pytest.param(n, count, id=f"n{n}-c{count}")


CASES = list(_cases())


@pytest.mark.parametrize("n,count", CASES)
async def test_all_reduce(ranks, n, count):
    async def body(g):
        for dtype, op in combos(count):
            x = contribution(g.rank, n, count, dtype, op)
            await C.all_reduce(x, op=op, group=g, algorithm="shm")
            same(x, expected(n, count, dtype, op), f"rank {g.rank} {dtype} {op}")
        return domains.statistics(g)
    stats = await ranks(n, body)
    if n > 1 and SHM_ON:
        assert stats[0]["0d0"]["posts"] > 0  # it did run over shared memory


@pytest.mark.parametrize("n,count", CASES)
async def test_reduce_scatter(ranks, n, count):
    async def body(g):
        for dtype, op in combos(count):
            x = contribution(g.rank, n, n * count, dtype, op)
            before = x.copy()
            out = np.full(count, 99, dtype)
            await C.reduce_scatter(out, x, op=op, group=g, algorithm="shm")
            want = expected(n, n * count, dtype, op)[g.rank * count:(g.rank + 1) * count]
            same(out, want, f"rank {g.rank} {dtype} {op}")
            same(x, before, "input untouched")
    await ranks(n, body)


@pytest.mark.parametrize("n,count", CASES)
async def test_all_gather_broadcast_barrier(ranks, n, count):
    async def body(g):
        for dtype in DTYPES if count < LARGE else DTYPES[1:3]:
            x = ((g.rank * 7 + np.arange(count)) % 97).astype(dtype)
            out = np.zeros(n * count, dtype)
            await C.all_gather(out, x, group=g, algorithm="shm")
            want = np.concatenate([((r * 7 + np.arange(count)) % 97).astype(dtype) for r in range(n)])
            same(out, want, f"all_gather rank {g.rank} {dtype}")
            for root in range(n):
                y = x.copy()
                await C.broadcast(y, src=root, group=g, algorithm="shm")
                same(y, ((root * 7 + np.arange(count)) % 97).astype(dtype), f"broadcast root {root}")
            await C.barrier(group=g, algorithm="shm")
    await ranks(n, body)


async def test_all_gather_into_own_block(ranks):
    async def body(g):
        out = np.zeros((3, 5), np.int64)
        out[g.rank] = g.rank
        await C.all_gather(out, out[g.rank], group=g, algorithm="shm")
        same(out, np.repeat(np.arange(3), 5).reshape(3, 5), "in place")
    await ranks(3, body)


async def test_barrier_waits_for_the_last(ranks):
    async def body(g):
        if g.rank == 2:
            await asyncio.sleep(0.3)
        t = asyncio.get_running_loop().time()
        await C.barrier(group=g, algorithm="shm")
        return asyncio.get_running_loop().time() - t
    waited = await ranks(3, body)
    assert waited[0] > 0.25 and waited[1] > 0.25 and waited[2] < 0.1


async def test_one_phase_way_in_the_data_slot(ranks, monkeypatch):
    from collectives.algorithms.shared_memory import all_reduce_shm
    monkeypatch.setattr(all_reduce_shm, "ONE_PHASE_MAX_NBYTES", 1 << 30)

    async def body(g):
        for dtype, op in [(np.dtype(np.float32), "sum"), (DTYPES[1], "max"), (np.dtype(np.int8), "prod")]:
            x = contribution(g.rank, 3, 100_003, dtype, op)
            await C.all_reduce(x, op=op, group=g, algorithm="shm")
            same(x, expected(3, 100_003, dtype, op), f"{dtype} {op}")
    await ranks(3, body)


async def test_bit_identical_on_every_rank(ranks):
    async def body(g):
        x = np.random.default_rng(g.rank).standard_normal(300_001).astype(np.float32)
        await C.all_reduce(x, group=g, algorithm="shm")
        y = np.random.default_rng(g.rank).standard_normal(1000).astype(np.float16)
        await C.all_reduce(y, group=g, algorithm="shm")
        return x.tobytes() + y.tobytes()
    got = await ranks(4, body)
    assert all(b == got[0] for b in got)


@needs_shm
async def test_segments_grow_and_shrinking_calls_reuse(ranks):
    sizes = [16_385, 100_000, 50_000, 1_000_000, 3, 70_000, 2_000_000]

    async def body(g):
        for count in sizes:
            x = np.full(count, g.rank + 1, np.float64)
            await C.all_reduce(x, group=g, algorithm="shm")
            assert np.all(x == 10), count
        return domains.statistics(g)["0d0"]
    stats = await ranks(4, body)
    assert stats[0]["grows"] == 4  # powers of two: 256 KiB, 1 MiB, 8 MiB, 16 MiB
    assert stats[0]["capacity"] == 16 << 20


@needs_shm
async def test_names_are_gone_once_every_member_mapped_them(ranks):
    async def body(g):
        x = np.ones(100_000, np.float32)
        await C.all_reduce(x, group=g, algorithm="shm")
        dom = domains.domain(g, list(range(g.size)))
        # this domain's names only: every in-process job is "test", so other test processes on
        # the machine (running the suite at the same time) have files under the same prefix
        ours = {t for tokens in dom._tokens for t in tokens.values()}
        return [n for n in os.listdir(segments.SHM_DIR) if n.startswith(dom._prefix) and any(t in n for t in ours)]
    left = await ranks(4, body)
    assert left == [[], [], [], []]


@needs_shm
async def test_every_name_a_member_made_comes_from_the_seed_it_sent(ranks):
    """The peers learn each member's seed at set-up, before any name is made, and every token it
    used (the control segment, each data slot) is one of that seed's: what the clean-up after a
    lost peer matches, so that it never touches another job's names."""
    async def body(g):
        for count in (10, 100_000, 1_000_000):  # the control segment, then two data slots
            await C.all_reduce(np.ones(count, np.float32), group=g, algorithm="shm")
        dom = domains.domain(g, list(range(g.size)))
        assert all(len(s) == domains.SEED_NBYTES for s in dom._seeds) and len(set(dom._seeds)) == g.size
        return [sorted((what, t in segments.member_tokens(dom._seeds[p], what)) for what, t in tokens.items())
                for p, tokens in enumerate(dom._tokens)], dom._seeds
    got = await ranks(3, body)
    for made, seeds in got:
        assert seeds == got[0][1]  # every member holds every member's seed
        assert all([w for w, _ in m] == ["ctl", "v19", "v22"] and all(ok for _, ok in m) for m in made), made


async def test_calls_in_flight(ranks):
    async def body(g):
        xs = [np.full(c, g.rank + 1, np.int64) for c in (5, 100_000, 3, 20_000)]
        out = np.zeros(4 * 7, np.int32)
        await asyncio.gather(*(C.all_reduce(x, group=g, algorithm="shm") for x in xs),
                             C.all_gather(out, np.full(7, g.rank, np.int32), group=g, algorithm="shm"),
                             C.all_reduce(np.zeros(4), group=g))  # a TCP-table call in between
        for x in xs:
            assert np.all(x == 10)
        same(out, np.repeat(np.arange(4), 7).astype(np.int32), "gather in flight")
    await ranks(4, body)


# -- hierarchical: fake nodes inside one process ------------------------------------------------

NODE_LAYOUTS = {2: "AB", 3: "AAB", 4: "ABAB", 5: "AABBB", 6: "ABCABC"}


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("n", sorted(NODE_LAYOUTS))
async def test_hierarchical_on_fake_nodes(ranks, n, transport):
    layout = NODE_LAYOUTS[n]

    async def body(g):
        g.runtime.nodes = list(layout)
        assert not g.topology.one_host
        for count in (0, 1, 7, 100_003):
            for dtype, op in [(np.dtype(np.float32), "sum"), (np.dtype(np.int64), "max"),
                              (DTYPES[1], "avg"), (np.dtype(np.int32), "prod"), (np.dtype(np.float16), "min")]:
                for algo in ("shm", "hierarchical"):  # "shm" needs one host: the table's choice runs
                    x = contribution(g.rank, n, count, dtype, op)
                    await C.all_reduce(x, op=op, group=g, algorithm=algo)
                    same(x, expected(n, count, dtype, op), f"rank {g.rank} {algo} {dtype} {op} {count}")
        return sorted(domains.statistics(g))
    domain_names = await ranks(n, body, transport=transport)
    for r, names in enumerate(domain_names if SHM_ON else []):
        alone = layout.count(layout[r]) == 1
        assert names == ([] if alone else [f"0d{1 + sorted(set(layout), key=layout.index).index(layout[r])}"])


async def test_hierarchical_small_arrays_run_flat_over_tcp(ranks, tmp_path):
    """Up to 64 KiB the table runs its TCP choice over the whole group (no shared-memory phase);
    above it, with shared memory on, the hierarchical algorithm: each host's ranks meet in shared
    memory. The trace names what ran."""
    small = (64 << 10) // 4  # float32: exactly 64 KiB

    async def body(g):
        g.runtime.nodes = list("ABAB")
        g.runtime.tracer.out_dir = str(tmp_path)  # record calls, with their algorithm
        x = contribution(g.rank, 4, small, np.float32, "sum")
        await C.all_reduce(x, group=g)
        same(x, expected(4, small, np.float32, "sum"), "flat")
        flat = sorted(domains.statistics(g))
        x = contribution(g.rank, 4, small + 1, np.float32, "sum")
        await C.all_reduce(x, group=g)
        same(x, expected(4, small + 1, np.float32, "sum"), "hierarchical")
        return flat, sorted(domains.statistics(g)), [e["args"]["algorithm"] for e in g.runtime.tracer.events]
    results = await ranks(4, body, transport="tcp")
    for r, (flat, after, ran) in enumerate(results):
        assert flat == [], (r, flat)
        assert ran == ["recursive_doubling", "hierarchical" if SHM_ON else "recursive_doubling"], ran
        if SHM_ON:
            assert after == [f"0d{1 + r % 2}"], (r, after)


@pytest.mark.skipif(not SHM_ON, reason="no usable /dev/shm: no hierarchical algorithm")
async def test_hierarchical_asks_the_table_for_each_part_by_its_layout(ranks):
    """A small array runs flat with the whole group's layout ("packed": hosts A A B B); the
    leaders' all_reduce of a large one runs the table's choice for theirs, one per host
    ("spread"): halving-doubling for 2 ranks, where the whole group's layout would give the ring."""
    async def body(g):
        g.runtime.nodes = list("AABB")
        assert registry.choose("all_reduce", 64, 4, group=g)[0] == "recursive_doubling"
        name, fn = registry.choose("all_reduce", 1_200_000, 4, group=g)
        assert name == "hierarchical"
        assert fn.keywords["across"] is registry.ALGORITHMS["all_reduce"]["halving_doubling"]
        assert registry.choose("all_reduce", 1_200_000, 4, group=g, subcall=True)[0] == "ring"  # packed
        for count in (16, 300_000):
            x = contribution(g.rank, 4, count, np.float32, "sum")
            await C.all_reduce(x, group=g, algorithm="hierarchical")
            same(x, expected(4, count, np.float32, "sum"), f"rank {g.rank} count {count}")
    await ranks(4, body, transport="tcp")


async def test_hierarchical_on_one_node_is_plain_shm(ranks):
    async def body(g):
        x = contribution(g.rank, 3, 50_000, np.float32, "sum")
        await C.all_reduce(x, group=g, algorithm="hierarchical")
        same(x, expected(3, 50_000, np.float32, "sum"), "one node")
    await ranks(3, body)


# -- fall-backs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["env", "group"])
async def test_switched_off_runs_tcp(ranks, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("RINGWEAVE_SHM", "0")

    async def body(g):
        if how == "group":
            g.shm_enabled = False
        assert registry.choose("barrier", 0, 4, group=g)[0] == "dissemination"
        x = contribution(g.rank, 4, 100_001, np.float32, "sum")
        await C.all_reduce(x, group=g, algorithm="shm")
        same(x, expected(4, 100_001, np.float32, "sum"), "fallback")
        out = np.zeros(4 * 3, np.int8)
        await C.all_gather(out, np.full(3, g.rank, np.int8), group=g, algorithm="shm")
        y = np.full(9, g.rank, np.float64)
        await C.broadcast(y, src=1, group=g, algorithm="shm")
        o = np.zeros(2, np.int64)
        await C.reduce_scatter(o, np.arange(8, dtype=np.int64), group=g, algorithm="shm")
        await C.barrier(group=g, algorithm="shm")
        assert np.all(y == 1) and np.array_equal(o, 4 * np.arange(2 * g.rank, 2 * g.rank + 2))
        return domains.statistics(g)
    assert await ranks(4, body) == [{}] * 4


async def test_default_table_picks_shm(ranks, monkeypatch):
    from collectives import registry
    monkeypatch.delenv("RINGWEAVE_SHM", raising=False)
    assert registry.choose("all_reduce", 1 << 20, 4)[0] == "shm"
    monkeypatch.setenv("RINGWEAVE_SHM", "0")
    assert registry.choose("all_reduce", 1 << 20, 4)[0] != "shm"
