"""Compressed all_reduce: error within each codec's stated bound against the exact NumPy sum,
error feedback tracking the true sum over 100 steps, wire bytes as stated, state keys,
and calls of different kinds in flight together."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import collectives as C
from collectives import compressed
from collectives.compress import get_codec, reference
from collectives.compress.topk import topk_count

pytestmark = pytest.mark.timeout(60)

W = 4
N = 3001  # not a multiple of the world size, nor of the int8 block


def _inputs(world: int, n: int = N, seed: int = 0) -> list[np.ndarray]:
    return [np.random.default_rng(seed * 100 + r).standard_normal(n).astype(np.float32) * (r + 1)
            for r in range(world)]


async def _reduce(ranks, world, xs, codec, algorithm=None, op="sum"):
    async def body(g):
        x = xs[g.rank].copy()
        await C.all_reduce(x, op=op, compression=codec, algorithm=algorithm)
        return x
    outs = await ranks(world, body)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # every rank the same bits
    return outs[0]


def _shards(v: np.ndarray, world: int) -> np.ndarray:
    chunk = -(-v.size // world)
    p = np.zeros(world * chunk, np.float32)
    p[:v.size] = v
    return p.reshape(world, chunk)


def _block_absmax(v: np.ndarray, world: int | None, block: int = 256) -> np.ndarray:
    """Per element: absmax of its int8 block (blocks start at each shard, or at 0 when world is None)."""
    rows = _shards(v, world) if world else v.reshape(1, -1)
    out = np.empty_like(rows)
    for j in range(rows.shape[0]):
        for s in range(0, rows.shape[1], block):
            out[j, s:s + block] = np.abs(rows[j, s:s + block]).max()
    return out.reshape(-1)[:v.size]


@pytest.mark.parametrize("name,unit", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
@pytest.mark.parametrize("algorithm", [None, "gather", "shard"])  # None: the default, ring
async def test_cast_codecs_within_bound(ranks, name, unit, algorithm):
    xs = _inputs(W)
    exact = np.sum(xs, axis=0, dtype=np.float64)
    out = await _reduce(ranks, W, xs, name, algorithm)
    abs_sum = np.sum(np.abs(xs), axis=0, dtype=np.float64)
    tiny = W * 2.0**-24  # subnormal / float32 rounding slack
    if algorithm is None:  # ring: every partial sum rounded again: W roundings of at most sum |x_r|
        bound = unit * (abs_sum + W * abs_sum) * 1.01 + tiny
    elif algorithm == "gather":  # only each rank's cast
        bound = unit * abs_sum * 1.01 + tiny
    else:  # each rank's cast + one cast of the float32 sum
        bound = unit * (abs_sum + np.abs(exact) + unit * abs_sum) * 1.01 + tiny
    err = np.abs(out - exact)
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > 0  # it did compress


@pytest.mark.parametrize("algorithm", [None, "gather"])
async def test_int8_within_bound(ranks, algorithm):
    xs = _inputs(W)
    exact = np.sum(xs, axis=0, dtype=np.float64)
    out = await _reduce(ranks, W, xs, "int8", algorithm)
    world = None if algorithm == "gather" else W
    per_rank = sum(_block_absmax(x, world) for x in xs) / 254 * (1 + 1e-3)  # scale / 2 each
    bound = per_rank
    if algorithm is None:  # plus one re-quantization of the float32 sum (its absmax <= |exact| + per_rank)
        bound = per_rank + (_block_absmax(np.abs(exact).astype(np.float32), W) + _block_absmax(per_rank, W)) / 254 \
            * (1 + 1e-3)
    err = np.abs(out - exact)
    assert (err <= bound + 1e-6).all(), (err - bound).max()
    assert err.max() > 0


@pytest.mark.parametrize("algorithm", [None, "gather"])
async def test_topk_within_bound(ranks, algorithm):
    xs = _inputs(W)
    exact = np.sum(xs, axis=0, dtype=np.float64)
    out = await _reduce(ranks, W, xs, "topk", algorithm)
    if algorithm == "gather":
        # kept entries exact, dropped ones at most the k-th magnitude of each rank
        k = topk_count(N, 0.01)
        bound = sum(np.sort(np.abs(x))[-k] for x in xs)
        decoded = sum(reference.topk_decode(*reference.topk_encode(x, k), N) for x in xs)
        np.testing.assert_allclose(out, decoded, rtol=1e-6, atol=1e-6)
    else:
        # per shard: each rank's k-th magnitude, then the k-th of the decoded float32 sum
        chunk = -(-N // W)
        k = topk_count(chunk, 0.01)
        decoded = np.zeros((W, chunk), np.float32)
        for x in xs:
            for j, row in enumerate(_shards(x, W)):
                decoded[j] += reference.topk_decode(*reference.topk_encode(row, k), chunk)
        bound = sum(max(np.sort(np.abs(row))[-k] for row in _shards(x, W)) for x in xs) + \
            max(np.sort(np.abs(row))[-k] for row in decoded)
        resent = np.concatenate([reference.topk_decode(*reference.topk_encode(row, k), chunk) for row in decoded])
        np.testing.assert_allclose(out, resent[:N], rtol=1e-6, atol=1e-6)
    assert np.abs(out - exact).max() <= bound * (1 + 1e-6)


async def test_powersgd_exact_on_low_rank_and_projection_bound(ranks):
    # rank(mean) == r exactly (below r, Gram-Schmidt normalizes rounding noise: see the report)
    u = np.random.default_rng(1).standard_normal((40, 2)).astype(np.float32)
    low = [u @ np.random.default_rng(10 + r).standard_normal((2, 30)).astype(np.float32) for r in range(W)]
    full = [np.random.default_rng(20 + r).standard_normal((40, 30)).astype(np.float32) for r in range(W)]

    async def body(g):
        codec = get_codec("powersgd", rank=2)
        a, b, bias = low[g.rank].copy(), full[g.rank].copy(), np.full(30, g.rank, np.float32)
        await C.all_reduce(a, op="avg", compression=codec, key="a")
        await C.all_reduce(b, op="avg", compression=codec, key="b")
        await C.all_reduce(bias, op="sum", compression=codec, key="bias")  # 1-D: sent as is
        return a, b, bias

    for a, b, bias in await ranks(W, body):
        np.testing.assert_allclose(a, np.mean(low, axis=0), rtol=1e-3, atol=1e-4)  # rank r: exact
        mean = np.mean(full, axis=0)
        assert np.linalg.norm(b - mean) <= np.linalg.norm(mean) * (1 + 1e-5)  # a projection
        assert np.linalg.norm(b - mean) > 0
        assert (bias == W * (W - 1) / 2).all()


@pytest.mark.parametrize("name,kw,tol", [("int8", {}, 0.02), ("topk", {"ratio": 0.1}, 0.25)])
@pytest.mark.parametrize("algorithm", [None, "gather"])
async def test_error_feedback_tracks_the_true_sum_over_100_steps(ranks, name, kw, tol, algorithm):
    world, n, steps = 2, 600, 100

    async def body(g):
        ef, plain = get_codec(name, error_feedback=True, **kw), get_codec(name, **kw)
        rng = np.random.default_rng(g.rank)
        sums = {"true": np.zeros(n), "ef": np.zeros(n), "plain": np.zeros(n)}
        for t in range(steps):
            # a persistent mean under noise: small entries that the codec alone keeps dropping
            grad = (0.05 * np.sin(np.arange(n) + t) + rng.standard_normal(n) * 0.01 + 0.01).astype(np.float32)
            a, b = grad.copy(), grad.copy()
            await C.all_reduce(a, compression=ef, algorithm=algorithm, key="w")
            await C.all_reduce(b, compression=plain, algorithm=algorithm, key="w")
            sums["true"] += grad
            sums["ef"] += a
            sums["plain"] += b
        return sums, {k: np.asarray(v, np.float64) for k, v in ef.errors.items()}

    results = await ranks(world, body)
    true = sum(r[0]["true"] for r in results)
    got, plain = results[0][0]["ef"], results[0][0]["plain"]
    # the identity: sum of outputs = sum of true gradients - what is still carried: every rank's
    # residual (and with "shard", every owner's residual of its shard), bounded by one step's dropping
    carried = sum(r[1]["w"] for r in results)
    if algorithm is None:
        carried = carried + np.concatenate([r[1][("owner", "w")] for r in results])[:n]
    np.testing.assert_allclose(got + carried, true, atol=1e-4 * steps)
    ef_err, plain_err = np.abs(got - true).max(), np.abs(plain - true).max()
    assert ef_err <= tol * np.abs(true).max(), (ef_err, np.abs(true).max())
    assert plain_err > 3 * ef_err, (plain_err, ef_err)  # without feedback the dropped parts pile up


async def test_wire_bytes_as_stated(ranks, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "0")  # count TCP-path frames, not shared memory
    n = 1 << 18  # 1 MiB of float32

    async def body(g):
        x = np.random.default_rng(g.rank).standard_normal(n).astype(np.float32)
        sent = {}
        for name in [None, "fp16", "int8", "topk", ("int8", "gather")]:
            codec, algorithm = (name, None) if not isinstance(name, tuple) else name
            before = g.runtime.actor.statistics().bytes_sent
            await C.all_reduce(x.copy(), compression=codec, algorithm=algorithm)
            sent[name] = g.runtime.actor.statistics().bytes_sent - before
        return sent

    for sent in await ranks(W, body):
        base = sent[None]
        assert base >= 2 * (W - 1) / W * 4 * n  # the uncompressed all_reduce: at least a ring's bytes
        assert sent["int8"] <= 0.27 * base, sent["int8"] / base
        assert sent["topk"] <= 0.025 * base, sent["topk"] / base
        assert sent["fp16"] <= 0.51 * base
        for name in ("int8", "topk"):  # payload as predicted, plus a few hundred bytes of headers
            predicted = compressed.wire_nbytes(name, n, W)
            assert predicted <= sent[name] <= predicted + 2000, (name, predicted, sent[name])
        assert sent[("int8", "gather")] == pytest.approx(compressed.wire_nbytes("int8", n, W, "gather"), abs=2000)


async def test_compressed_and_plain_calls_in_flight_together(ranks):
    async def body(g):
        codec = get_codec("int8", error_feedback=True)
        a, b, c = (np.full(1000, g.rank + 1.0, np.float32) for _ in range(3))
        if g.rank == 1:
            await asyncio.sleep(0.01)
        await asyncio.gather(C.all_reduce(a, compression=codec, key=0), C.all_reduce(b),
                             C.all_reduce(c, compression="topk", key=1))
        return a, b, c

    for a, b, c in await ranks(3, body):
        np.testing.assert_allclose(a, 6.0, rtol=1e-2)
        assert (b == 6.0).all()
        assert np.count_nonzero(c) == 9 and set(c[c != 0]) == {6.0}  # k = 3 of each 334-element shard


async def test_bucketer_with_codecs(ranks):
    from collectives.bucket import GradBucketer

    async def body(g):
        out = {}
        for comp in ["int8", get_codec("topk", ratio=1.0, error_feedback=True), get_codec("powersgd", rank=1)]:
            b = GradBucketer(bucket_cap_mb=2000 / 2**20, first_bucket_mb=400 / 2**20, op="avg", compression=comp)
            u = np.linspace(1, 2, 20, dtype=np.float32)[:, None]
            grads = {"w": u @ np.full((1, 30), g.rank + 1.0, np.float32), "b": np.full(30, g.rank + 1.0),
                     "i": np.full(4, g.rank + 1, np.int32)}
            for name, a in grads.items():
                b.add(name, a)
            await b.wait()
            out[getattr(comp, "name", comp)] = grads
        return out

    for out in await ranks(2, body):
        for name, grads in out.items():
            np.testing.assert_allclose(grads["w"], np.linspace(1, 2, 20)[:, None] * np.full((1, 30), 1.5),
                                       rtol=2e-2, err_msg=name)
            np.testing.assert_allclose(grads["b"], 1.5, rtol=2e-2, err_msg=name)
            assert (grads["i"] == 1).all()  # integers never compressed: exact (floor of avg 1.5)


def test_blocking_form():
    from tests.collectives.test_coll_blocking import _free_port, _run_threads
    port = _free_port()
    comms = _run_threads([lambda r=r: C.Communicator(rank=r, world_size=2, master_addr="127.0.0.1",
                                                     master_port=port, timeout=30) for r in range(2)])
    try:
        xs = _run_threads([lambda c=c: c.all_reduce(np.full(500, c.rank + 1.0, np.float32), compression="int8")
                           for c in comms])
        hs = [c.all_reduce_async(np.full(500, 2.0, np.float32), op="avg", compression="fp16") for c in comms]
        for x in xs:
            np.testing.assert_allclose(x, 3.0, rtol=1e-2)
        for h in hs:
            assert (h.wait(30) == 2.0).all()
    finally:
        _run_threads([c.close for c in comms])


def test_topk_warmup_schedule():
    codec = get_codec("topk", ratio=0.01, warmup_steps=8)  # 4 stages of 2 calls
    assert [codec.ratio_at(s) for s in range(10)] == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                                                      0.01, 0.01, 0.01, 0.01]
    assert codec.at_step(8) is codec and codec.at_step(0).ratio == 0.25 and codec.at_step(0).warmup_steps == 0
    assert [get_codec("topk", ratio=0.1, warmup_steps=4).ratio_at(s) for s in range(3)] == [0.25, 0.1, 0.1]
    with pytest.raises(ValueError, match="warmup_steps"):
        get_codec("topk", warmup_steps=-1)


async def test_topk_warmup_counts_calls_per_key_and_keeps_the_residual(ranks):
    n, steps = 1000, 6

    async def body(g):
        codec = get_codec("topk", ratio=0.01, warmup_steps=4, error_feedback=True)
        plain = get_codec("topk", ratio=0.01, error_feedback=True)
        kept, sums = [], {"true": np.zeros(n), "out": np.zeros(n)}
        for t in range(steps):
            grad = np.random.default_rng(10 * t + g.rank).standard_normal(n).astype(np.float32)
            predicted = compressed.wire_nbytes(compressed.codec_at(codec, "w"), n, 2)
            x = grad.copy()
            await C.all_reduce(x, compression=codec, key="w")
            kept.append((np.count_nonzero(x), predicted))
            sums["true"] += grad
            sums["out"] += x
        assert codec.codec.steps == {"w": steps}
        y = np.ones(n, np.float32)
        await C.all_reduce(y, compression=plain, key="w")  # another codec object: its own stream
        return kept, sums, {k: v.astype(np.float64) for k, v in codec.errors.items()}

    results = await ranks(2, body)
    kept = results[0][0]
    # 2 ranks, shard style: each rank's shard of 500 keeps k = 125, 31, 8, 5, 5, 5 per rank; the owner
    # re-encodes the sum with the same k, so the result has that many non-zeros per shard
    assert [c for c, _ in kept] == [2 * k for k in (125, 31, 8, 5, 5, 5)], kept
    assert [b for _, b in kept] == [compressed.wire_nbytes(get_codec("topk", ratio=r), n, 2)
                                    for r in (0.25, 0.0625, 0.015625, 0.01, 0.01, 0.01)]
    true = sum(r[1]["true"] for r in results)
    carried = sum(r[2]["w"] for r in results) + np.concatenate([r[2][("owner", "w")] for r in results])
    np.testing.assert_allclose(results[0][1]["out"] + carried, true, atol=1e-4 * steps)  # one residual throughout


async def test_powersgd_rank_deficient_average_is_exact(ranks):
    """r = 4, 2 ranks: a rank-1 average and an all-zero one come back exact (dependent columns
    of P are zeroed, not normalised rounding noise), and a rank-4 one after them too."""
    u, v = (np.random.default_rng(s).standard_normal(k).astype(np.float32) for s, k in ((1, 48), (2, 40)))
    full = (np.random.default_rng(3).standard_normal((48, 4)) @ np.random.default_rng(4).standard_normal((4, 40)))

    async def body(g):
        codec = get_codec("powersgd", rank=4, error_feedback=True)
        outs = []
        for m in (np.outer(u, v) * (g.rank + 1), np.zeros((48, 40)), full * (g.rank + 1)):
            x = m.astype(np.float32)
            await C.all_reduce(x, op="avg", compression=codec, key="w")
            outs.append(x)
        return outs

    for rank1, zero, rank4 in await ranks(2, body):
        np.testing.assert_allclose(rank1, 1.5 * np.outer(u, v), rtol=0, atol=1e-5 * np.abs(np.outer(u, v)).max())
        assert np.abs(zero).max() <= 1e-5 * np.abs(np.outer(u, v)).max()  # only the carried rounding of step 1
        np.testing.assert_allclose(rank4, 1.5 * full, rtol=0, atol=1e-4 * np.abs(full).max())


@pytest.mark.parametrize("shm", ["1", "0"])
def test_sub_calls_use_the_tcp_table_whatever_the_shm_setting(monkeypatch, shm):
    """The sub-calls of compressed and device collectives (registry.choose(subcall=True)): the
    table's first rule that applies once the shared-memory ones are left out, whatever
    RINGWEAVE_SHM and RINGWEAVE_ALGO_* say (figures: registry.py)."""
    from collectives import registry
    monkeypatch.setenv("RINGWEAVE_SHM", shm)
    monkeypatch.setenv("RINGWEAVE_ALGO_ALL_REDUCE", "ring")  # not for sub-calls
    for (collective, nbytes, world), want in {("all_reduce", 4, 4): "recursive_doubling",
                                              ("all_reduce", 2 << 20, 4): "halving_doubling",
                                              ("all_reduce", 2 << 20, 3): "ring",
                                              ("all_to_all", 1 << 20, 4): "direct",
                                              ("all_gather", 64, 2): "recursive_doubling",
                                              ("all_gather", 64, 3): "direct",
                                              ("all_gather", 64, 5): "direct",
                                              ("all_gather", 64, 16): "bruck",
                                              ("all_gather", 1 << 20, 16): "ring"}.items():
        name, fn = registry.choose(collective, nbytes, world, subcall=True)
        assert (name, fn) == (want, registry.ALGORITHMS[collective][want])


async def test_sub_calls_take_the_rules_for_the_groups_hosts(ranks, tmp_path):
    """A compressed all_reduce of a group that spans hosts opens its sub-call with the table's
    rules for that layout: fp16's all_reduce of 256 KiB at 4 ranks, two per host in runs
    ("packed"), is the ring (on one host: recursive doubling); the call's fingerprint names it."""
    async def body(g):
        g.runtime.nodes = ["a", "a", "b", "b"]
        g.runtime.tracer.out_dir = str(tmp_path)  # record calls, with their fingerprints
        x = np.full(128 << 10, g.rank + 1.0, np.float32)
        await C.all_reduce(x, compression="fp16", group=g)
        np.testing.assert_array_equal(x, 10.0)
        return [e["args"]["op"] for e in g.runtime.tracer.events]
    for ops in await ranks(4, body):
        assert len(ops) == 1 and ops[0].startswith("all_reduce ") and ops[0].endswith(" algo=ring"), ops
