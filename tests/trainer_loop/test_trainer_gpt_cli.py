"""The GPT as users run it: `python -m trainer --model gpt` through the launcher with a
checkpoint, `python -m trainer.sample` on that checkpoint, the GPT's flags, the text data,
and a GPT resumed from a checkpoint on another world size and strategy."""

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.cli import build_model, make_config, parse_args
from trainer.loop import fit
from trainer.nn import GPT, GPTConfig
from trainer.sharding import TrainConfig, make_strategy
from trainer.text import RandomWindows, TextSplit, Windows, decode, encode, load_text_split, unigram_loss

ROOT = Path(__file__).resolve().parents[2]


def test_gpt_flags_and_their_defaults():
    args = parse_args(["--model", "gpt"])
    assert (args.epochs, args.batch_size, args.lr, args.eval_train, args.eval_batch_size) == (8, 64, 2e-3, False, 64)
    assert (args.n_layer, args.n_head, args.n_embd, args.block_size, args.gelu) == (4, 4, 128, 64, "tanh")
    assert parse_args([]).eval_train and parse_args([]).epochs == 5  # the MLP's stay
    args = parse_args(["--model", "gpt", "--n-layer", "2", "--n-embd", "12", "--n-head", "3", "--block-size", "8",
                       "--gelu", "erf", "--activation-checkpointing", "--decay", "all", "--kernel", "reference"])
    config = make_config(args, steps_per_epoch=10)
    assert config.activation_checkpointing and config.decay == "all"
    model = build_model(args, load_text_split(8))
    assert isinstance(model, GPT) and model.config == GPTConfig(block_size=8, n_layer=2, n_head=3, n_embd=12,
                                                                 gelu="none", kernel="reference")
    with pytest.raises(SystemExit):
        parse_args(["--model", "gpt", "--n-embd", "10", "--n-head", "4"])


def test_text_split_windows_and_tokenizer():
    split = load_text_split(16, seed=3)
    n = len(split.train.tokens) + len(split.val.tokens)
    assert n == len(encode(decode(np.concatenate([split.train.tokens, split.val.tokens]))))  # bytes round-trip
    assert len(split.val.tokens) == round(0.1 * n) and "assert" in decode(split.train.tokens[:200])
    x, y = split.train.get(np.arange(5), epoch=2)
    assert x.shape == y.shape == (5, 16) and x.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    starts = split.train.starts(2)
    np.testing.assert_array_equal(x[0], split.train.tokens[starts[0] : starts[0] + 16])
    assert not np.array_equal(starts, split.train.starts(3))  # a new draw every epoch, the same on every rank
    np.testing.assert_array_equal(starts, RandomWindows(split.train.tokens, 16, seed=3).starts(2))
    vx, vy = split.val.get(np.array([0, 1]))
    np.testing.assert_array_equal(vx.reshape(-1), split.val.tokens[:32])  # consecutive, not overlapping
    assert len(split.val) == (len(split.val.tokens) - 1) // 16
    # the unigram baseline: the cross-entropy of a byte-frequency model, here about 3.2 nats (4.7 bits)
    assert 3.0 < split.unigram_loss < 3.4
    assert unigram_loss(np.array([0, 1]), np.array([0])) == pytest.approx(-np.log(2 / 258))


@pytest.mark.timeout(120)
def test_gpt_main_job_then_sample_from_its_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ckpt = tmp_path / "ckpt"
    train = [sys.executable, "-m", "runtime.launch", "-n", "2", "-m", "trainer", "--model", "gpt", "--strategy",
             "zero2", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--epochs", "1",
             "--windows-per-epoch", "256", "--batch-size", "32", "--checkpoint-dir", str(ckpt), "--log-every", "0"]
    proc = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unigram baseline" in proc.stderr and "bits per byte" in proc.stderr and "activations peak" in proc.stdout
    sample = [sys.executable, "-m", "trainer.sample", "--checkpoint", str(ckpt), "--prompt", "The ", "--tokens",
              "30", "--temperature", "0.8", "--seed", "0", "--top-k", "20"]
    out = subprocess.run(sample, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("The ") and len(out.stdout.encode()) >= 4 + 30 * 0.5
    again = subprocess.run(sample, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert again.stdout == out.stdout  # the seed fixes the text
    bad = subprocess.run([sys.executable, "-m", "trainer.sample", "--checkpoint", str(tmp_path / "none")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no committed checkpoint" in bad.stderr


def tiny_text() -> TextSplit:
    tokens = encode("the cat sat on the mat. " * 40)
    return TextSplit(RandomWindows(tokens[:800], 8, num_windows=40, seed=1), Windows(tokens[800:], 8))


def gpt_body(name: str, data, *, epochs=2, ckpt=None, resume=False, stop_at=None):
    config = TrainConfig(lr=5e-3, seed=4, master_dtype="float64", param_dtype="float64", reduce_dtype="float64",
                         adam_kernel="numpy", warmup_steps=2, total_steps=epochs * 5, activation_checkpointing=True)

    class Stop:
        def on_step_end(self, state):
            state.stop_training = stop_at is not None and state.step >= stop_at

    async def body(group):
        model = GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.1),
                    dtype=np.float64)
        strategy = make_strategy(name, model, config, group)
        try:
            await strategy.setup()
            history = await fit(strategy, data, config, epochs=epochs, global_batch_size=8, checkpoint_dir=ckpt,
                                resume=resume, callbacks=[Stop()], group=group, progress_stream=io.StringIO(),
                                summary_stream=io.StringIO())
            return history, await strategy.full_params()
        finally:
            strategy.close()

    return body


@pytest.mark.timeout(60)
async def test_gpt_resumes_on_another_world_size_and_strategy(ranks, tmp_path):
    data = tiny_text()
    (full, full_params), = await ranks(1, gpt_body("ddp", data))
    ckpt = str(tmp_path / "ckpt")
    await ranks(3, gpt_body("fsdp", data, ckpt=ckpt, stop_at=7))
    (res, res_params), *_ = await ranks(2, gpt_body("zero1", data, ckpt=ckpt, resume=True))
    assert res.resumed_from == (1, 2)
    for got, want in zip(res_params, full_params):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert res.final.val_loss == pytest.approx(full.final.val_loss, rel=1e-10)
    assert res.final.val_bits_per_byte == pytest.approx(full.final.val_loss / np.log(2), rel=1e-12)
