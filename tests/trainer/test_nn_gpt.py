"""The transformer's layers and the whole GPT against CENTRAL finite differences (float64),
both kernels against each other, activation checkpointing bit for bit, the losses, and the
KV-cached sampler against recomputing the context.

The objective of a layer check is L = sum(out * dout) for a fixed random dout; every
input and every parameter is perturbed by +-h (tests/trainer/test_nn_gradcheck.py's
central_diff). Sizes are tiny on purpose: a check costs two forwards per parameter.
"""

import numpy as np
import pytest

from test_nn_gradcheck import ATOL, RTOL, central_diff, check_unit
from trainer.nn import (
    GELU,
    GPT,
    MLP,
    ActivationMeter,
    Block,
    CausalSelfAttention,
    Context,
    CrossEntropyLoss,
    Embedding,
    GPTConfig,
    LayerNorm,
    MSELoss,
    PositionalEmbedding,
    Unit,
)

CTX = Context(training=True, seed=7, step=3, batch_offset=2)
KERNELS = ["fast", "reference"]


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=7, block_size=5, n_layer=2, n_head=2, n_embd=4, dropout=0.0)
    base.update(kw)
    return GPTConfig(**base)


def noisy_params(model, seed=1):
    params = model.init_params(0)
    rng = np.random.default_rng(seed)
    for p in params:
        p += 0.2 * rng.standard_normal(p.shape)  # LayerNorm's 1/0 and the 0 biases are not special points
    return params


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name, layer, shape", [
    ("layernorm", lambda k: LayerNorm(6, kernel=k), (2, 3, 6)),
    ("gelu-tanh", lambda k: GELU("tanh", kernel=k), (3, 5)),
    ("gelu-erf", lambda k: GELU("none", kernel=k), (3, 5)),
    ("positions", lambda k: PositionalEmbedding(5, 3), (2, 4, 3)),
    ("attention", lambda k: CausalSelfAttention(6, 3, dropout=0.3, kernel=k), (2, 4, 6)),
    ("attention-head-size-1", lambda k: CausalSelfAttention(3, 3, kernel=k), (2, 3, 3)),
    ("attention-one-position", lambda k: CausalSelfAttention(4, 2, kernel=k), (1, 1, 4)),
    ("mlp", lambda k: MLP(4, 8, dropout=0.2, kernel=k), (2, 3, 4)),
    ("block", lambda k: Block(tiny(n_embd=6, n_head=3, dropout=0.2, kernel=k)), (2, 4, 6)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_layer_against_central_differences(name, layer, shape, kernel):
    x = np.random.default_rng(3).standard_normal(shape)
    check_unit(Unit([layer(kernel)], pad_to=5, dtype=np.float64), x, CTX)


@pytest.mark.parametrize("kernel", KERNELS)
def test_embedding_scatter_adds_repeated_tokens(kernel):
    unit = Unit([Embedding(5, 3, kernel=kernel)], pad_to=4, dtype=np.float64)
    idx = np.array([[1, 1, 4], [1, 0, 1]])  # token 1 four times, 2 and 3 never
    params = unit.init_params(0)
    dout = np.random.default_rng(0).standard_normal((2, 3, 3))
    grad = unit.zeros()
    _, cache = unit.forward(params, idx, CTX)
    assert unit.backward(params, cache, dout, grad) is None  # no gradient into integer ids
    dw = grad[:15].reshape(5, 3)
    np.testing.assert_allclose(dw[1], dout[0, 0] + dout[0, 1] + dout[1, 0] + dout[1, 2], rtol=1e-15)
    assert not dw[2:4].any()

    def objective():
        return float((unit.forward(params, idx, CTX)[0] * dout).sum())

    np.testing.assert_allclose(grad, central_diff(objective, params), rtol=RTOL, atol=ATOL)


def test_bad_token_ids_are_refused():
    unit = Unit([Embedding(5, 3)], dtype=np.float64)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 5\), got range \[0, 5\]"):
        unit.forward(unit.init_params(0), np.array([[0, 5]]), CTX)
    with pytest.raises(TypeError, match="integer token ids"):
        unit.forward(unit.init_params(0), np.zeros((1, 2)), CTX)
    with pytest.raises(ValueError, match="longer than the block size 5"):
        GPT(tiny()).forward(GPT(tiny()).init_params(0), np.zeros((1, 6), dtype=np.int64))


@pytest.mark.parametrize("case, kernel", [("repeats-dropout", "fast"), ("batch-1-block-1-head-size-1", "fast"),
                                          ("batch-1-block-1-head-size-1", "reference")])
def test_whole_gpt_against_central_differences(case, kernel):
    """Every parameter of every unit, the tied matrix included (both uses' gradients summed)."""
    if case == "repeats-dropout":
        config, x = tiny(dropout=0.1, kernel=kernel), np.array([[1, 2, 1, 1, 3], [4, 4, 4, 0, 1]])
    else:
        config, x = tiny(block_size=1, n_head=2, n_embd=2, kernel=kernel), np.array([[3]])
    model = GPT(config, dtype=np.float64, pad_to=3)
    params = noisy_params(model)
    y = np.random.default_rng(2).integers(0, config.vocab_size, size=x.shape)
    grads = model.zeros()
    model.forward_backward(params, grads, x, y, CTX, loss_denominator=3)

    def loss():
        return model.forward_backward(params, model.zeros(), x, y, CTX, loss_denominator=3)

    for i, unit in enumerate(model.units):
        np.testing.assert_allclose(grads[i], central_diff(loss, params[i]), rtol=RTOL, atol=ATOL, err_msg=f"unit {i}")
        assert not grads[i][unit.numel :].any()


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-4)])
def test_fast_kernels_equal_the_reference(dtype, rtol):
    x = np.random.default_rng(0).integers(0, 7, size=(3, 5))
    y = np.roll(x, -1, axis=1)
    out = {}
    for kernel in KERNELS:
        for gelu in ("tanh", "none"):
            model = GPT(tiny(dropout=0.2, kernel=kernel, gelu=gelu), dtype=dtype)
            params, grads = [p.astype(dtype) for p in noisy_params(model)], model.zeros()
            loss = model.forward_backward(params, grads, x, y, CTX)
            out[kernel, gelu] = loss, grads
    for gelu in ("tanh", "none"):
        (la, ga), (lb, gb) = out["fast", gelu], out["reference", gelu]
        assert la == pytest.approx(lb, rel=rtol)
        for a, b in zip(ga, gb):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


@pytest.mark.parametrize("kernel", KERNELS)
def test_activation_checkpointing_gives_the_same_bits_and_holds_less(kernel):
    model = GPT(tiny(n_layer=4, n_embd=8, dropout=0.3, kernel=kernel), dtype=np.float64)
    params = noisy_params(model)
    x = np.random.default_rng(5).integers(0, 7, size=(4, 5))
    y = np.roll(x, -1, axis=1)
    results = {}
    for checkpoint in (False, True):
        meter, grads = ActivationMeter(), model.zeros()
        loss = model.forward_backward(params, grads, x, y, CTX, checkpoint=checkpoint, meter=meter, grads_zero=True)
        assert meter.live == 0  # everything held was given back
        results[checkpoint] = loss, [g.tobytes() for g in grads], meter.peak
    assert results[True][:2] == results[False][:2]
    # one block's activations plus every block's input, instead of every block's activations
    assert results[True][2] < 0.5 * results[False][2]


def test_cross_entropy_per_position_and_mse_against_central_differences():
    rng = np.random.default_rng(4)
    logits, y = rng.standard_normal((3, 4, 6)), rng.integers(0, 6, size=(3, 4))
    for kernel in KERNELS:
        loss_fn = CrossEntropyLoss(kernel)
        loss, d = loss_fn.forward_backward(logits, y, 5.0, dloss=2.0)
        np.testing.assert_allclose(d, 2.0 * central_diff(lambda: loss_fn.forward(logits, y, 5.0)[0], logits),
                                   rtol=RTOL, atol=ATOL)
        # the mean over positions of each sample, summed over samples, over the denominator
        per_sample = [CrossEntropyLoss("reference").forward(logits[n], y[n])[0] for n in range(3)]
        assert loss == pytest.approx(sum(per_sample) / 5.0, rel=1e-12)
    metrics = CrossEntropyLoss().metrics(logits, y)
    assert metrics["loss"] == pytest.approx(3 * CrossEntropyLoss().forward(logits, y)[0], rel=1e-12)
    assert metrics["accuracy"] == pytest.approx((logits.argmax(-1) == y).mean(axis=1).sum(), rel=1e-12)
    out, target = rng.standard_normal((5, 2)), rng.standard_normal((5, 2))
    loss, d = MSELoss().forward_backward(out, target, 4.0)
    assert loss == pytest.approx(((out - target) ** 2).mean(axis=1).sum() / 4.0, rel=1e-12)
    np.testing.assert_allclose(d, central_diff(lambda: MSELoss().forward(out, target, 4.0)[0], out),
                               rtol=RTOL, atol=ATOL)
    assert MSELoss().metrics(out, target)["loss"] == pytest.approx(((out - target) ** 2).mean(axis=1).sum())


def test_kv_cache_logits_equal_recomputing_the_context():
    """The cache's logits, fed in two pieces, equal a forward over the whole context (decoding past
    the block size is trainer.sample's, tests/trainer/test_sample.py)."""
    model = GPT(tiny(block_size=6, n_layer=2, n_embd=8), dtype=np.float64)
    params = noisy_params(model, seed=3)
    prompt = np.array([[1, 2, 3], [4, 4, 0]])
    caches = model.new_caches(2, np.float64)
    cached = np.concatenate([model.logits_cached(params, prompt[:, :2], caches),
                             model.logits_cached(params, prompt[:, 2:], caches)], axis=1)
    np.testing.assert_allclose(cached, model.forward(params, prompt), rtol=1e-12, atol=1e-12)


def test_weight_decay_groups_are_the_matrices():
    model = GPT(tiny())
    decayed = {s.name for u in model.units for s in u.param_specs if s.decay}
    assert decayed == {"attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"}
    ends = model.units[0]
    assert ends.decay_segments(0, ends.numel + 3) == [(0, ends.numel + 3, False)]  # embeddings, ln_f, padding
    block = model.units[1]
    qkv = next(s for s in block.param_specs if s.name == "attn.qkv.weight")
    assert block.decay_segments(qkv.offset + 2, qkv.end + 1) == [(0, qkv.numel - 2, True), (qkv.numel - 2,
                                                                                            qkv.numel - 1, False)]


def test_the_kernels_cache_in_the_users_cache_folder_not_the_package():
    import os

    from collectives.kernels import jitcache
    from trainer.nn import layer_kernels

    layer_kernels.layernorm_forward(np.ones((1, 2)), np.ones(2), np.zeros(2), 1e-5, np.empty((1, 2)), np.empty(1),
                              np.empty(1))
    where = layer_kernels.layernorm_forward._cache._cache_path
    want = os.environ.get("NUMBA_CACHE_DIR") or jitcache.cache_root()
    assert where.startswith(want) and not where.startswith(os.path.dirname(layer_kernels.__file__)), where
