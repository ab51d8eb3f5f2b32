"""Every strategy equals single-process training: float64, 5 steps, world sizes 1-4,
with and without gradient accumulation and global-norm clipping, to a relative 1e-12.

The reference is the plain model + optimizer loop in one process on the same global
batches (dist_helpers.reference_run); dropout is on and the last step's batch is
split unevenly (ranks with 1 row at world size 4).
"""

import functools

import numpy as np
import pytest

from dist_helpers import assert_params_close, make_config, reference_run, train_under

STRATEGY_NAMES = ["ddp", "zero1", "zero2", "zero3"]
VARIANTS = {
    "plain": {},
    "accum2": {"grad_accum": 2},
    "clip": {"clip_norm": 0.05},
    "accum2-clip": {"grad_accum": 2, "clip_norm": 0.05},
}


@functools.cache
def reference(variant: str):
    return reference_run(make_config(**VARIANTS[variant]))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", STRATEGY_NAMES)
async def test_strategy_equals_single_process(name, world, variant):
    config = make_config(**VARIANTS[variant])
    want_params, want_losses = reference(variant)
    per_rank = await train_under(name, world, config)
    for rank, (params, results, _) in enumerate(per_rank):
        assert_params_close(params, want_params)
        np.testing.assert_allclose([r.loss for r in results], want_losses, rtol=1e-12)
        assert not any(r.skipped for r in results)
    if "clip" in variant:  # the clip must actually have bitten, or the test proves nothing
        assert all(r.grad_norm > config.clip_norm for r in per_rank[0][1])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("options", [
    {"reshard_after_forward": False}, {"prefetch": False}, {"reshard_after_forward": False, "prefetch": False},
], ids=["no-reshard", "no-prefetch", "neither"])
async def test_fsdp_options_equal_single_process(world, options):
    config = make_config(**options, grad_accum=2)
    want, _ = reference("accum2")
    for params, _, _ in await train_under("fsdp", world, config):
        assert_params_close(params, want)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", STRATEGY_NAMES)
async def test_sgd_nesterov_equals_single_process(name):
    config = make_config(optimizer="sgd", momentum=0.9, nesterov=True, weight_decay=1e-3, clip_norm=0.05)
    want, _ = reference_run(config)
    for params, _, _ in await train_under(name, 3, config):
        assert_params_close(params, want)


@pytest.mark.timeout(30)
async def test_ddp_small_buckets_equal_single_process():
    """One bucket per unit (cap below a unit's size): three all_reduces overlap the backward."""
    config = make_config(bucket_cap_mb=1e-4)
    want, _ = reference("plain")
    per_rank = await train_under("ddp", 2, config)
    assert len(per_rank[0][2].buckets) == 3
    for params, _, _ in per_rank:
        assert_params_close(params, want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["ddp", "zero3"])
async def test_equivalence_over_tcp(name):
    """The same numbers over real loopback sockets (the transport real jobs use)."""
    config = make_config(grad_accum=2, clip_norm=0.05)
    want, _ = reference("accum2-clip")
    for params, _, _ in await train_under(name, 3, config, transport="tcp"):
        assert_params_close(params, want)
