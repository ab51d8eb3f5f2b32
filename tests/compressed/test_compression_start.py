"""``--compression-start N`` on the default model (digits MLP, 2 in-process ranks, 23 steps an
epoch): the first N steps' gradients go uncompressed, bit for bit as an uncompressed run's, under
ddp and fsdp; after them the codec is on, and top-k 1% with error feedback (no DGC warm-up) then
trains like uncompressed. ``--freeze-variance`` freezes AdamW's variance at N (1-bit Adam)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.compressed.trainer_runs import train
from trainer.cli import make_config, parse_args
from trainer.sharding.data_parallel import make_optimizer

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
async def test_the_steps_before_compression_start_are_uncompressed(strategy):
    args = ["--strategy", strategy, "--epochs", "1", "--compression-start", "23"]
    plain = await train(args)
    started = await train(args + ["--compression", "topk+ef", "--compression-warmup-steps", "0"])
    for a, b in zip(started["params"], plain["params"]):
        np.testing.assert_array_equal(a, b)
    assert started["comm_bytes"] == plain["comm_bytes"]


@pytest.mark.parametrize("freeze", [[], ["--freeze-variance"]])
async def test_topk_after_an_uncompressed_start_trains_like_uncompressed(freeze):
    base = await train([])
    topk = await train(["--compression", "topk+ef", "--compression-warmup-steps", "0", "--compression-start", "23",
                        *freeze])
    print(f"none {base['val_acc']:.4f}  topk+ef start 23 {freeze} {topk['val_acc']:.4f} "
          f"({topk['comm_bytes'] / base['comm_bytes']:.1%} of the bytes)")
    assert topk["val_acc"] >= base["val_acc"] - 0.01
    assert topk["comm_bytes"] <= 0.25 * base["comm_bytes"]  # 23 of 115 steps whole, then 1%


def test_freeze_variance_freezes_adamw_at_the_compression_start():
    args = parse_args(["--compression", "topk+ef", "--compression-start", "7", "--freeze-variance"])
    assert make_optimizer(make_config(args, 23)).freeze_step == 7
    assert make_optimizer(make_config(parse_args(["--compression-start", "7"]), 23)).freeze_step == 0
    with pytest.raises(ValueError, match="compression_start"):
        make_optimizer(make_config(parse_args(["--freeze-variance"]), 23))
