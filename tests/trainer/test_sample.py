"""trainer.sample's decoding: past block_size the context slides (each token predicted from the last
block_size tokens, as nanoGPT does), with and without the KV cache; the arguments it refuses."""

import numpy as np
import pytest

from runtime.testing import run_ranks
from trainer import checkpoint, sample
from trainer.nn import GPT
from trainer.nn.gpt import GPTConfig
from trainer.sample import Decoder, generate, sample_next
from trainer.sharding import TrainConfig, make_strategy

pytestmark = pytest.mark.timeout(30)


def model_and_params():
    """A tiny float64 GPT (vocabulary 7, block 6) with parameters away from their initial 1s and 0s."""
    model = GPT(GPTConfig(vocab_size=7, block_size=6, n_layer=2, n_head=2, n_embd=8), dtype=np.float64)
    params = model.init_params(0)
    rng = np.random.default_rng(5)  # a model whose greedy text past the block differs from restarting at T // 2
    for p in params:
        p += 0.2 * rng.standard_normal(p.shape)
    return model, params


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("prompt_len", [3, 9])  # shorter and longer than the block
def test_the_logits_past_the_block_size_are_a_full_forward_of_the_last_block_size_tokens(use_cache, prompt_len):
    """Before, once the context was full the cache restarted from the last block_size // 2 tokens:
    its logits differed from those of the slid window."""
    model, params = model_and_params()
    T = model.config.block_size
    rng = np.random.default_rng(5)
    ids = rng.integers(0, model.config.vocab_size, size=(2, prompt_len))
    decoder = Decoder(model, params, use_cache=use_cache)
    for _ in range(14):  # well past T: the window slides by one each token
        got = decoder.next_logits(ids)
        want = model.forward(params, ids[:, -T:])[:, -1]  # the cropped context, whole, no cache
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        ids = np.concatenate([ids, rng.integers(0, model.config.vocab_size, size=(2, 1))], axis=1)


def test_greedy_generation_follows_the_slid_context():
    model, params = model_and_params()
    T = model.config.block_size
    prompt = np.array([[1, 2, 3], [4, 4, 0]])
    want = prompt
    for _ in range(12):  # the reference: nanoGPT's loop (crop, full forward, arg-max)
        want = np.concatenate([want, model.forward(params, want[:, -T:])[:, -1].argmax(-1)[:, None]], axis=1)
    for use_cache in (True, False):
        np.testing.assert_array_equal(generate(model, params, prompt, 12, temperature=0, use_cache=use_cache), want)
    drawn = [generate(model, params, prompt, 12, temperature=0.9, top_k=3, seed=4, use_cache=c) for c in (True, False)]
    np.testing.assert_array_equal(drawn[0], drawn[1])
    assert drawn[0].shape == (2, 15) and (drawn[0][:, :3] == prompt).all()


def test_top_k_draws_only_among_the_k_largest_and_a_tiny_temperature_is_the_arg_max():
    logits = np.array([[0.0, 3.0, 1.0, 2.9, -1.0]])
    rng = np.random.default_rng(0)
    assert {int(sample_next(logits, 5.0, 2, rng)[0]) for _ in range(200)} == {1, 3}
    with np.errstate(all="raise"):  # (logits - max) / t: no overflow, no NaN at 1e-300
        assert sample_next(logits * 1e300, 1e-300, None, rng)[0] == 1
    assert sample_next(logits, 0, None, rng)[0] == 1


@pytest.mark.parametrize("kw, message", [
    ({"temperature": -1.0}, "temperature must be > 0, or 0 for greedy decoding (the arg-max), got -1.0"),
    ({"temperature": float("nan")}, "temperature must be > 0"),
    ({"temperature": float("inf")}, "temperature must be > 0"),
    ({"top_k": 0}, "top_k must be an integer in 1..7 (the vocabulary), got 0"),
    ({"top_k": 8}, "top_k must be an integer in 1..7 (the vocabulary), got 8"),
    ({"top_k": 2.5}, "top_k must be an integer in 1..7"),
    ({"top_k": True}, "top_k must be an integer in 1..7"),
])
def test_bad_sampling_arguments_are_one_line_errors(kw, message):
    """Before, a negative temperature silently meant the arg-max and top_k above the vocabulary was ignored."""
    model, params = model_and_params()
    with pytest.raises(ValueError) as info:
        generate(model, params, np.array([[1]]), 2, **kw)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


async def test_the_command_line_refuses_a_top_k_above_the_vocabulary_in_one_line(tmp_path, capsys):
    async def body(group):
        s = make_strategy("ddp", GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4)), TrainConfig(seed=1),
                          group)
        try:
            await s.setup()
            return await checkpoint.save(s, tmp_path / "c")
        finally:
            s.close()

    [ckpt] = await run_ranks(1, body)
    assert sample.main(["--checkpoint", str(ckpt), "--top-k", "257", "--tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "trainer.sample: error: argument --top-k: 257 must be <= the vocabulary size 256\n"
    assert sample.main(["--checkpoint", str(tmp_path / "c"), "--top-k", "256", "--tokens", "9", "--prompt", "ab"]) == 0
    out, err = capsys.readouterr()
    assert err == f"trainer.sample: checkpoint {ckpt} (optimizer step 0)\n"  # which one it read, and its step
    assert out.startswith("ab") and len(out.encode()) >= 3  # 9 bytes past a block of 4: the context slid
