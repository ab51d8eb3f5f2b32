"""``--compression-start N`` on the default model (digits MLP, 2 in-process ranks, 23 steps an
epoch): the first N steps' gradients go uncompressed, bit for bit as an uncompressed run's, under
ddp and fsdp; after them the codec is on, and top-k 1% with error feedback (no DGC warm-up) then
trains like uncompressed. ``--freeze-variance`` freezes AdamW's variance at N (1-bit Adam)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from tests.compressed.trainer_runs import train
from trainer.cli import make_config, parse_args
from trainer.data import Split, make_synthetic
from trainer.loop import Callback, fit
from trainer.nn import mlp
from trainer.sharding import make_strategy
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


class _Bytes(Callback):
    """Each step's bytes sent (this rank), and a stop after step ``stop_at``."""

    def __init__(self, stop_at=None):
        self.sent, self.stop_at = {}, stop_at

    def on_step_end(self, state):
        self.sent[state.step] = int(state.result.comm_bytes)
        state.stop_training = state.step == self.stop_at


async def _bytes_per_step_stopped_and_resumed(ranks, tmp_path, flags: list[str], stop_at: int):
    """Each step's bytes (rank 0) of an uninterrupted 14-step ddp run with ``flags``, and of the
    same run stopped after step ``stop_at`` and resumed from its checkpoint (steps 1.. and the rest)."""
    args = parse_args(["--quiet", "--strategy", "ddp", *flags])
    x, y = make_synthetic(120, in_dim=32, num_classes=4, seed=3, class_sep=1.0, dtype=np.float32)
    split = Split(x[20:], y[20:], x[:20], y[:20], 4)

    def body(stop_at=None, ckpt=None, resume=False):
        async def run(group):
            config = make_config(args, 7)
            strategy = make_strategy("ddp", mlp(32, (32, 32), 4, pad_to=group.size, dtype=np.float32), config, group)
            await strategy.setup()
            rec = _Bytes(stop_at)
            try:
                await fit(strategy, split, config, epochs=2, global_batch_size=16, callbacks=[rec], group=group,
                          checkpoint_dir=ckpt, resume=resume, progress_stream=io.StringIO(),
                          summary_stream=io.StringIO())
            finally:
                strategy.close()
            return rec.sent
        return run

    ckpt = str(tmp_path / "ckpt")
    with threadpool_limits(limits=1, user_api="blas"):
        whole, _ = await ranks(2, body())
        first, _ = await ranks(2, body(stop_at=stop_at, ckpt=ckpt))
        rest, _ = await ranks(2, body(ckpt=ckpt, resume=True))
    assert sorted(first) == list(range(1, stop_at + 1)) and sorted(rest) == list(range(stop_at + 1, 15))
    return whole, first, rest


async def test_powersgd_warmup_steps_are_not_sent_again_after_a_resume(ranks, tmp_path):
    """``--compression powersgd+ef --compression-warmup-steps 3``: steps 1-3 uncompressed, then
    PowerSGD; a run stopped at step 5 and resumed sends steps 6.. compressed, as the uninterrupted
    run does (the warm-up is counted in the strategy's steps, which the checkpoint restores; a count
    of the codec's calls would start again at the resume and send 3 more steps whole)."""
    whole, _, rest = await _bytes_per_step_stopped_and_resumed(
        ranks, tmp_path, ["--compression", "powersgd+ef:rank=2", "--compression-warmup-steps", "3"], 5)
    assert whole[1] == whole[3] > 4 * whole[4] > 0  # the uncompressed start, then rank-2 factors
    assert {s: whole[s] for s in rest} == rest


@pytest.mark.parametrize("start", [0, 2])
async def test_topk_warmup_goes_on_from_its_step_after_a_resume(ranks, tmp_path, start):
    """top-k's DGC ramp of 8 steps (25% of the entries for two steps, 6.25%, 1.56%, then 1%), after
    an uncompressed start of ``start`` steps: a run stopped at step start + 3 and resumed sends each
    later step's bytes as the uninterrupted run does (the ramp counted in the strategy's steps; a
    count of the codec's calls would start the ramp again: 25% at the first resumed step)."""
    whole, _, rest = await _bytes_per_step_stopped_and_resumed(
        ranks, tmp_path, ["--compression", "topk+ef", "--compression-warmup-steps", "8",
                          "--compression-start", str(start)], start + 3)
    ramp = [whole[s] for s in range(start + 1, start + 10)]
    assert ramp[0] == ramp[1] > ramp[2] == ramp[3] > ramp[4] == ramp[5] > ramp[7] == ramp[8] > 0
    assert {s: whole[s] for s in rest} == rest
