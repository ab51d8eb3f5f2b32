"""The hierarchical compressed all_reduce (float32 inside a host, the codec across hosts) on 2
emulated hosts x 2 ranks over real loopback sockets: the same bits on every rank, near the exact
sum, half the bytes across the hosts of the flat shard style; and DDP taking it for compressed
gradients."""

from __future__ import annotations

import numpy as np
import pytest

from collectives import compressed
from collectives.compress import get_codec
from trainer.cli import make_config, parse_args
from trainer.nn import mlp
from trainer.sharding import make_strategy

pytestmark = pytest.mark.timeout(120)

N = 1 << 16  # elements: payloads large beside frame headers


def _data(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(N).astype(np.float32)


def _cross_bytes(g) -> int:
    """Bytes this rank has sent to the ranks of the other host."""
    mine = g.topology.node_of(g.rank)
    conns = g.runtime.actor.peers.conns
    return sum(c.statistics().bytes_sent for peer, c in conns.items() if g.topology.node_of(peer) != mine)


async def _reduce(hier: bool):
    async def body(g):
        g.runtime.nodes = list("AABB")
        groups = compressed.host_groups(g)
        assert [sorted(x.ranks) for x in groups] == [[0, 1] if g.rank < 2 else [2, 3], [g.rank % 2, g.rank % 2 + 2]]
        x = _data(g.rank)
        before = _cross_bytes(g)
        if hier:
            await compressed.hierarchical(x, get_codec("int8"), op="sum", local=groups[0], cross=groups[1])
        else:
            await compressed.all_reduce(x, get_codec("int8"), op="sum", group=g)
        return x, _cross_bytes(g) - before

    from runtime.testing import run_ranks
    return await run_ranks(4, body, transport="tcp", timeout_s=60)


async def test_hierarchical_int8_is_the_same_everywhere_near_the_sum_with_half_the_bytes_across_hosts():
    hier, flat = await _reduce(True), await _reduce(False)
    exact = sum(_data(r).astype(np.float64) for r in range(4))
    for x, _ in hier[1:]:
        np.testing.assert_array_equal(x, hier[0][0])
    # int8 blocks of 256: the two hosts' sums each encoded once, their sum re-encoded once by its owner
    host_max = max(np.abs(_data(0) + _data(1)).max(), np.abs(_data(2) + _data(3)).max())
    err = np.abs(hier[0][0] - exact).max()
    assert err <= (2 * host_max + np.abs(exact).max()) / 127 * 0.5 * 1.01
    assert err > 0  # the codec was used
    payload = N + 4 * N // 256  # int8 of the whole array: codes and scales
    hier_out = sum(b for _, b in hier[:2])  # what host A sent to host B
    flat_out = sum(b for _, b in flat[:2])
    assert payload <= hier_out < 1.1 * payload  # about one payload(n) out of each host
    assert 2 * payload <= flat_out < 2.2 * payload  # the flat shard style: two
    assert hier_out < 0.55 * flat_out


async def test_ddp_reduces_compressed_gradients_host_first_on_several_hosts():
    from runtime.testing import run_ranks
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((16, 12)).astype(np.float32), rng.integers(0, 6, 16)

    async def body(g, flat=False):
        g.runtime.nodes = list("AABB")
        model = mlp(12, (32,), 6, pad_to=g.size, dtype=np.float32)
        argv = ["--compression", "int8+ef"] + (["--compression-flat"] if flat else [])
        strategy = make_strategy("ddp", model, make_config(parse_args(argv), 1), g)
        try:
            await strategy.setup()
            assert (strategy.collectives.hierarchy is None) == flat
            for _ in range(3):
                lo = 4 * g.rank
                await strategy.train_step([(x[lo:lo + 4], y[lo:lo + 4], lo, 16)])
            return await strategy.full_params()
        finally:
            strategy.close()

    def body_flat(g):
        return body(g, flat=True)

    params = await run_ranks(4, body, transport="tcp", timeout_s=60)
    for p in params[1:]:
        for a, b in zip(p, params[0]):
            np.testing.assert_array_equal(a, b)
    flat = await run_ranks(4, body_flat, transport="tcp", timeout_s=60)
    assert not all(np.array_equal(a, b) for a, b in zip(flat[0], params[0]))  # another reduction: other bits



async def test_a_reused_scratch_gives_the_bits_of_fresh_buffers():
    """Calls that reuse one scratch (as DDP's buckets under the accounting's lock) end with the bits of
    calls that allocate afresh, over several steps of error feedback, at a size with padding."""
    from runtime.testing import run_ranks

    async def body(g):
        g.runtime.nodes = list("AABB")
        local, cross = compressed.host_groups(g)
        fresh, reused = get_codec("int8", error_feedback=True), get_codec("int8", error_feedback=True)
        scratch, out = {}, []
        rng = np.random.default_rng(g.rank)
        for _ in range(3):
            a = rng.standard_normal(1001).astype(np.float32)  # 1001 = 2 x 501 - 1: one element of padding
            b = a.copy()
            await compressed.hierarchical(a, fresh, op="sum", local=local, cross=cross, key=0)
            await compressed.hierarchical(b, reused, op="sum", local=local, cross=cross, key=0, scratch=scratch)
            out.append((a, b))
        return out, len(scratch)

    for out, kept in await run_ranks(4, body, transport="tcp", timeout_s=60):
        assert kept == 1
        for a, b in out:
            np.testing.assert_array_equal(a, b)
