"""The compressed reduce_scatter against a NumPy model of its steps.

The model (:func:`rs_model`) follows compressed.py's ``reduce_scatter`` docstring with the codecs'
NumPy reference backend: each rank cuts its (compensated) ``x`` into W blocks of ``m`` and encodes
each (error feedback: the residual of the whole ``x`` under ``key``), the owner of block j
decode-adds the W payloads in rank order into float32 zeros, divides for ``avg`` and casts to the
dtype. Every codec here is deterministic (int8's stochastic rounding is seeded), so the real
collective (default kernel backend) must equal the model bit for bit; int8 is also held to its
documented error bound against the exact sum, and error feedback to its closed form (what was
sent over the calls plus the carried residuals is the exact total).
"""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives import compressed
from collectives.compress import get_codec
from collectives.kernels.reference import bits_equal

pytestmark = pytest.mark.timeout(60)

WORLDS = [1, 2, 3, 4]
COUNTS = [0, 1, 2, 1001, 5, 0, 1001, 1, 64]  # out.size per call: empty, 1, < W at W=3/4, odd; 1001 and 1 again
CODECS = [("int8", {}), ("int8", {"block": 7, "stochastic": True, "seed": 3}), ("topk", {"ratio": 0.05}),
          ("fp16", {}), ("bf16", {})]


def _input(rank: int, step: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal(n) * (rank + 1)
    x[::17] = 0.0  # zeros for top-k's ties and int8's all-zero blocks
    return x.astype(dtype)


def rs_model(xs: list[np.ndarray], codecs: list, op: str, key) -> list[np.ndarray]:
    """One call: rank r's ``x`` is ``xs[r]``, its codec ``codecs[r]`` (state carried between
    calls like the real one's). Returns each rank's ``out``."""
    W, n = len(xs), xs[0].size
    m = n // W
    if n == 0:  # the exact reduce_scatter of nothing: no encode (stochastic int8's counter stays put)
        return [x.copy() for x in xs]
    payloads = []  # payloads[r][j]: rank r's block j
    for x, codec in zip(xs, codecs):
        inner = getattr(codec, "codec", None) or codec
        y = codec.compensate(x, key=key) if inner is not codec else x.astype(np.float32)
        rows = [inner.encode(y[j * m:(j + 1) * m]) for j in range(W)]
        if inner is not codec:
            decoded = np.concatenate([inner.decode(p, m).reshape(-1) for p in rows])
            codec.errors[key][...] = y - decoded
        payloads.append(rows)
    outs = []
    for j, codec in enumerate(codecs):  # owner j
        inner = getattr(codec, "codec", None) or codec
        acc = np.zeros(m, np.float32)
        for r in range(W):
            inner.decode_add(payloads[r][j], acc)
        if op == "avg":
            acc /= np.float32(W)
        outs.append(acc.astype(xs[0].dtype))
    return outs


CALLS = [(m, op, dtype) for m in COUNTS for op, dtype in (("sum", np.float32), ("avg", np.float64))]


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize(("name", "kw"), CODECS, ids=str)
@pytest.mark.parametrize("world", WORLDS)
async def test_reduce_scatter_equals_model_bit_for_bit(ranks, world, name, kw, error_feedback):
    """Many calls on one codec object, keys per (m, op): m = 1001 and 1 come twice, so error
    feedback residuals carry from call to call (and are compared too), scratch buffers as well."""
    async def body(g):
        codec = get_codec(name, error_feedback=error_feedback, **kw)
        outs = []
        for step, (m, op, dtype) in enumerate(CALLS):
            x = _input(g.rank, step, world * m, dtype)
            out = np.full(m, np.nan, dtype)  # every element must be written
            await C.reduce_scatter(out, x, op=op, compression=codec, key=(m, op))
            outs.append(out)
        return outs, getattr(codec, "errors", {})

    results = await ranks(world, body)
    models = [get_codec(name, error_feedback=error_feedback, backend="numpy", **kw) for _ in range(world)]
    for step, (m, op, dtype) in enumerate(CALLS):
        want = rs_model([_input(r, step, world * m, dtype) for r in range(world)], models, op, (m, op))
        for r in range(world):
            got = results[r][0][step]
            assert got.dtype == dtype and got.shape == (m,)
            assert bits_equal(got, want[r]), (m, op, r, got, want[r])
    for r in range(world):  # the residuals each rank carries on
        errors = results[r][1]
        assert errors.keys() == getattr(models[r], "errors", {}).keys()
        for key, err in errors.items():
            assert bits_equal(err, models[r].errors[key]), (key, r)


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_int8_within_its_error_bound_of_the_exact_sum(ranks, world):
    """|out - exact| <= sum over ranks of absmax(that rank's int8 block) / 254 (+1e-4 relative)."""
    m, block = 1001, 64

    async def body(g):
        x = _input(g.rank, 0, world * m, np.float32)
        out, exact = np.empty(m, np.float32), np.empty(m, np.float32)
        await C.reduce_scatter(out, x, compression=get_codec("int8", block=block))
        await C.reduce_scatter(exact, x)
        return out, exact

    results = await ranks(world, body)
    for j, (out, exact) in enumerate(results):
        bound = np.zeros(m)
        for r in range(world):
            mine = _input(r, 0, world * m, np.float32)[j * m:(j + 1) * m].astype(np.float64)
            absmax = np.array([np.abs(mine[b:b + block]).max() for b in range(0, m, block)])
            bound += np.repeat(absmax, block)[:m] / 254 * (1 + 1e-4)
        err = np.abs(out.astype(np.float64) - exact)
        assert np.all(err <= bound + 1e-6), (j, float((err - bound).max()))
        assert err.max() > 0  # it did quantize


async def test_error_feedback_carries_what_was_not_sent(ranks):
    """Sum op, T calls on one key: the sum of the outputs plus the residuals every rank still
    carries (its block j of them) equals the sum of all inputs (up to float32 rounding); without
    the carried state the gap would be T calls' worth of quantization error."""
    W, m, T = 3, 500, 6

    async def body(g):
        codec = get_codec("topk", error_feedback=True, ratio=0.1)
        total_out = np.zeros(m)
        for t in range(T):
            out = np.empty(m, np.float32)
            await C.reduce_scatter(out, _input(g.rank, t, W * m, np.float32), compression=codec, key="g")
            total_out += out
        return total_out, codec.errors["g"].astype(np.float64)

    results = await ranks(W, body)
    for j in range(W):
        total_in = sum(_input(r, t, W * m, np.float32)[j * m:(j + 1) * m].astype(np.float64)
                       for r in range(W) for t in range(T))
        carried = sum(results[r][1][j * m:(j + 1) * m] for r in range(W))
        np.testing.assert_allclose(results[j][0] + carried, total_in, atol=2e-4)
        assert np.abs(carried).max() > 0.1  # top-k 10% does hold much back


async def test_wire_bytes_and_refusals(ranks):
    """The counted bytes are the all_to_all's payload; clear errors for what it cannot do."""
    assert compressed.reduce_scatter_wire_nbytes("int8", 1000, 4) == 3 * (1000 + 4 * 4)  # 1000 B + 4 scales, aligned
    assert compressed.reduce_scatter_wire_nbytes("fp16", 1000, 4) == 3 * 2000
    assert compressed.reduce_scatter_wire_nbytes("int8", 1000, 1) == 0

    async def body(g):
        x, out = np.ones(4, np.float32), np.empty(2, np.float32)
        cases = [
            (dict(op="max", compression="int8"), ValueError, "'max'"),
            (dict(compression="powersgd"), ValueError, "powersgd"),
            (dict(compression="int8", algorithm="ring"), ValueError, "algorithm='ring'"),
        ]
        for kw, exc, text in cases:
            with pytest.raises(exc, match=text):
                await C.reduce_scatter(out, x, **kw)
        with pytest.raises(TypeError, match="int32"):
            await C.reduce_scatter(np.empty(2, np.int32), np.ones(4, np.int32), compression="int8")
        await C.reduce_scatter(out, x, compression="int8")  # the group still works after the refusals
        return out

    for out in await ranks(2, body):
        np.testing.assert_array_equal(out, [2, 2])
