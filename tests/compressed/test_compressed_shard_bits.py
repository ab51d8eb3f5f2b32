"""The shard style of the compressed all_reduce, bit for bit against a NumPy model of its steps.

The model (:func:`shard_model`) follows compressed.py's docstring with the codecs' NumPy
reference backend: each rank pads its (compensated) array to W shards and encodes each, the
owner of shard j decode-adds the W payloads in rank order into float32 zeros, divides for
``avg``, re-encodes (with the owner's error feedback) and everyone decodes. Calls run back to
back with sizes that shrink and grow, so scratch kept from one call (dirty) serves the next;
sizes below the world size leave whole shards of padding.
"""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives.compress import get_codec
from collectives.kernels.reference import bits_equal

pytestmark = pytest.mark.timeout(60)

W = 4
SIZES = [3001, 5, 1, 4096, 3001, 2]  # not a multiple of W, whole padding shards (5, 1, 2), exact
CODECS = [("int8", {}), ("int8", {"block": 7, "stochastic": True, "seed": 3}), ("topk", {"ratio": 0.05}),
          ("fp16", {})]


def _input(rank: int, step: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal(n) * (rank + 1)
    x[::17] = 0.0  # zeros for top-k's ties and int8's all-zero blocks
    return x.astype(dtype)


def shard_model(xs: list[np.ndarray], codecs: list, op: str, key) -> np.ndarray:
    """One shard-style call: rank r's input ``xs[r]`` and codec ``codecs[r]`` (NumPy backend,
    with or without error feedback, its state carried between calls like the real one's)."""
    n = xs[0].size
    chunk = -(-n // W)
    payloads = []  # payloads[r][j]: rank r's shard j
    for x, codec in zip(xs, codecs):
        ef = getattr(codec, "codec", None)
        inner = ef or codec
        y = np.zeros(W * chunk, np.float32)
        y[:n] = codec.compensate(x.reshape(-1), key=key) if ef else x
        rows = [inner.encode(y[j * chunk:(j + 1) * chunk]) for j in range(W)]
        if ef:
            decoded = np.concatenate([inner.decode(p, chunk) for p in rows])
            codec.errors[key][...] = (y - decoded)[:n]
        payloads.append(rows)
    out = np.zeros(W * chunk, np.float32)
    for j, codec in enumerate(codecs):  # owner j
        ef = getattr(codec, "codec", None)
        inner = ef or codec
        acc = np.zeros(chunk, np.float32)
        for r in range(W):
            acc += inner.decode(payloads[r][j], chunk)
        if op == "avg":
            acc /= np.float32(W)
        if ef:
            acc = codec.compensate(acc, key=("owner", key))
        mine = inner.encode(acc)
        if ef:
            codec.errors[("owner", key)][...] = acc - inner.decode(mine, chunk)
        out[j * chunk:(j + 1) * chunk] = inner.decode(mine, chunk)
    return out[:n].astype(xs[0].dtype)


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize(("name", "kw"), CODECS, ids=str)
async def test_shard_equals_model_bit_for_bit(ranks, name, kw, error_feedback):
    async def body(g):
        codec = get_codec(name, error_feedback=error_feedback, **kw)
        outs = []
        for step, n in enumerate(SIZES):
            for op, dtype in (("sum", np.float32), ("avg", np.float64)):
                x = _input(g.rank, step, n, dtype)
                await C.all_reduce(x, op=op, compression=codec, algorithm="shard", key=(n, op))
                outs.append(x)
        return outs

    results = await ranks(W, body)
    models = [get_codec(name, error_feedback=error_feedback, backend="numpy", **kw) for _ in range(W)]
    i = 0
    for step, n in enumerate(SIZES):
        for op, dtype in (("sum", np.float32), ("avg", np.float64)):
            want = shard_model([_input(r, step, n, dtype) for r in range(W)], models, op, (n, op))
            for r in range(W):
                assert bits_equal(results[r][i], want), (n, op, r, results[r][i], want)
            i += 1
