"""Model-level properties the sharding strategies rely on: layout, init, dropout keys, hooks,
and the global-batch loss denominator (split batches sum to the full-batch gradient)."""

import numpy as np
import pytest

from trainer.nn import EVAL, GELU, Context, Dropout, LayerNorm, Linear, Unit, mlp


def test_layout_is_contiguous_and_padded():
    model = mlp(64, (256, 256), 10, pad_to=4)
    u0, u1, head = model.units
    assert (u0.numel, u1.numel, head.numel) == (16640 + 512, 65792 + 512, 2570)
    assert head.padded_numel == 2572 and all(u.padded_numel % 4 == 0 for u in model.units)
    for unit in model.units:
        ends = [0] + [s.end for s in unit.param_specs]
        assert [s.offset for s in unit.param_specs] == ends[:-1]
        assert ends[-1] == unit.numel
    assert [s.name for s in u0.param_specs] == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_shard_slices_tile_the_padded_buffer():
    model = mlp(5, (7,), 3, pad_to=4)
    for unit in model.units:
        parts = [unit.shard_slice(r, 4) for r in range(4)]
        assert parts[0].start == 0 and parts[-1].stop == unit.padded_numel
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        assert len({p.stop - p.start for p in parts}) == 1
    assert model.units[0].shard_slice(1, 2) == slice(28, 56)  # padded_numel 56 = 5*7 + 7 + 2*7
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        model.units[0].shard_slice(0, 3)


def test_views_alias_the_flat_buffer_and_check_length():
    unit = Unit([Linear(3, 2)], pad_to=4)
    flat = unit.zeros()
    unit.views(flat)["0.weight"][1, 0] = 5.0
    assert flat[2] == 5.0  # row-major (in, out): element (1, 0) is at 1 * 2 + 0
    with pytest.raises(ValueError, match="padded_numel=8"):
        unit.views(np.zeros(7, dtype=np.float32))


def test_init_is_deterministic_padding_free_and_dtype_independent():
    a = mlp(8, (16,), 3, pad_to=1, dtype=np.float64).init_params(seed=3)
    b = mlp(8, (16,), 3, pad_to=5, dtype=np.float32).init_params(seed=3)
    c = mlp(8, (16,), 3, pad_to=1, dtype=np.float64).init_params(seed=4)
    for ua, ub, uc in zip(a, b, c):
        n = ua.size
        np.testing.assert_array_equal(ua.astype(np.float32), ub[:n])
        assert not ub[n:].any() and ub.dtype == np.float32
        assert not np.array_equal(ua, uc)
    # torch.nn.Linear bound 1/sqrt(in); LayerNorm starts at w=1, b=0
    w = a[0][: 8 * 16]
    assert np.abs(w).max() <= 1 / np.sqrt(8) and np.abs(w).max() > 0.3
    np.testing.assert_array_equal(a[0][8 * 16 + 16 : 8 * 16 + 32], 1.0)


def test_float32_model_stays_float32():
    model = mlp(6, (8,), 3, dropout=0.5)
    params, grads = model.init_params(0), model.zeros()
    x = np.ones((4, 6), dtype=np.float32)
    assert model.forward(params, x).dtype == np.float32
    loss = model.forward_backward(params, grads, x, np.array([0, 1, 2, 0]), Context())
    assert isinstance(loss, float) and all(g.dtype == np.float32 for g in grads)


def test_backward_accumulates():
    model = mlp(5, (4,), 3, dtype=np.float64)
    params = model.init_params(0)
    x, y = np.random.default_rng(0).standard_normal((6, 5)), np.arange(6) % 3
    once, twice = model.zeros(), model.zeros()
    model.forward_backward(params, once, x, y, Context())
    model.forward_backward(params, twice, x, y, Context())
    model.forward_backward(params, twice, x, y, Context())
    for g1, g2 in zip(once, twice):
        np.testing.assert_allclose(g2, 2 * g1, rtol=1e-15)
    model.zero_grads(twice)
    assert not any(g.any() for g in twice)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()  # -0.0 and +0.0 differ here, unlike in assert_array_equal


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("rows", [0, 1, 2, 7])
def test_linear_grads_zero_writes_the_same_bits_as_accumulating(dtype, rows):
    """grads_zero=True writes x^T dy straight into the buffer; the bits must be those of
    0 + x^T dy, also where every product is -0.0 (a dead input times a negative dy), in a
    (2, rows, in) input and in an empty batch."""
    layer = Linear(6, 5)
    rng = np.random.default_rng(rows)
    params = {"weight": rng.standard_normal((6, 5)).astype(dtype), "bias": np.zeros(5, dtype)}
    x = np.abs(rng.standard_normal((2, rows, 6))).astype(dtype)
    x[..., ::2] = 0  # dead inputs: their weight-gradient rows are sums of -0.0 products below
    dout = -np.abs(rng.standard_normal((2, rows, 5))).astype(dtype)
    _, cache = layer.forward(params, x, Context())
    added = {k: np.zeros_like(v) for k, v in params.items()}
    written = {k: np.zeros_like(v) for k, v in params.items()}
    dx_added = layer.backward(params, cache, dout, added)
    dx_written = layer.backward(params, cache, dout, written, grads_zero=True)
    assert bits(dx_written) == bits(dx_added)
    for k in params:
        assert bits(written[k]) == bits(added[k]), k
    # a second micro-batch (grads_zero=False) still accumulates on top
    layer.backward(params, cache, dout, written)
    np.testing.assert_array_equal(written["weight"], added["weight"] + added["weight"])


def test_model_grads_zero_gives_the_same_bits_and_falls_back_on_a_dtype_mismatch():
    model = mlp(5, (4, 3), 3, dropout=0.3, dtype=np.float32)
    params = model.init_params(0)
    x, y = np.random.default_rng(1).standard_normal((6, 5)).astype(np.float32), np.arange(6) % 3
    ctx = Context(training=True, seed=2, step=1)
    for grad_dtype in (np.float32, np.float64):  # float64 buffers: the float32 product cannot be written as is
        want, got = model.zeros(grad_dtype), model.zeros(grad_dtype)
        assert model.forward_backward(params, want, x, y, ctx) == model.forward_backward(params, got, x, y, ctx,
                                                                                        grads_zero=True)
        assert [bits(g) for g in got] == [bits(g) for g in want]
        assert all(g.any() for g in got)


# ---- dropout ---------------------------------------------------------------


def dropout_mask(ctx, stream=(0, 3), shape=(64, 32)):
    layer = Dropout(0.5)
    layer.bind(stream)
    return layer.forward({}, np.ones(shape), ctx)[0]


def test_dropout_mask_depends_only_on_seed_step_and_stream():
    ctx = Context(seed=1, step=5)
    m = dropout_mask(ctx)
    np.random.seed(123)  # global RNG state must not matter
    np.random.random(10)
    np.testing.assert_array_equal(dropout_mask(ctx), m)
    assert set(np.unique(m)) == {0.0, 2.0}  # inverted dropout: kept values scaled by 1 / (1 - p)
    assert 0.4 < (m > 0).mean() < 0.6
    for other in (Context(seed=2, step=5), Context(seed=1, step=6)):
        assert not np.array_equal(dropout_mask(other), m)
    assert not np.array_equal(dropout_mask(ctx, stream=(1, 3)), m)


def test_dropout_eval_is_identity_and_offset_slices_the_global_mask():
    x = np.random.default_rng(0).standard_normal((10, 4))
    layer = Dropout(0.3)
    np.testing.assert_array_equal(layer.forward({}, x, EVAL)[0], x)
    full = dropout_mask(Context(seed=9), shape=(10, 4))
    part = dropout_mask(Context(seed=9, batch_offset=6), shape=(4, 4))
    np.testing.assert_array_equal(part, full[6:])


def test_units_get_distinct_dropout_streams():
    model = mlp(4, (32, 32), 2, dropout=0.5, layernorm=False)
    streams = [u.module.layers[-1].stream for u in model.units[:2]]
    assert streams == [(0, 2), (1, 2)]


# ---- data parallel contract --------------------------------------------------


@pytest.mark.parametrize("splits", [[0, 8, 16], [0, 5, 11, 16], [0, 0, 7, 16]])
def test_split_batches_with_global_denominator_sum_to_full_batch(splits):
    """What DDP relies on: per-rank gradients (denominator = global batch, batch_offset =
    first global row) SUM to the single-process gradient, dropout included, to 1e-12."""
    model = mlp(6, (12, 12), 4, dropout=0.3, pad_to=len(splits) - 1, dtype=np.float64)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 6)), rng.integers(0, 4, 16)
    params = model.init_params(seed=2)
    ctx = Context(seed=11, step=4)

    full = model.zeros()
    full_loss = model.forward_backward(params, full, x, y, ctx)
    summed, summed_loss = model.zeros(), 0.0
    for lo, hi in zip(splits[:-1], splits[1:]):
        local = model.zeros()
        summed_loss += model.forward_backward(
            params, local, x[lo:hi], y[lo:hi], ctx.replace(batch_offset=lo), loss_denominator=16
        )
        for s, g in zip(summed, local):
            s += g
    assert summed_loss == pytest.approx(full_loss, rel=1e-12)
    for s, f in zip(summed, full):
        np.testing.assert_allclose(s, f, rtol=1e-12, atol=1e-14)


def test_hooks_run_in_order_and_may_install_buffers():
    """An FSDP-like strategy: params are None until gathered, freed after use."""
    model = mlp(3, (4, 4), 2, dtype=np.float64)
    full = model.init_params(0)
    params, grads, events = [None] * 3, model.zeros(), []

    def gather(i):
        events.append(("gather", i))
        params[i] = full[i].copy()

    def free(i):
        events.append(("free", i))
        params[i] = None

    x, y = np.ones((2, 3)), np.array([0, 1])
    loss = model.forward_backward(
        params, grads, x, y, EVAL,
        before_unit_forward=gather, after_unit_forward=free,
        before_unit_backward=gather, after_unit_backward=lambda i: events.append(("reduce", i)),
    )
    fwd = [e for i in range(3) for e in (("gather", i), ("free", i))]
    bwd = [e for i in (2, 1, 0) for e in (("gather", i), ("reduce", i))]
    assert events == fwd + bwd
    reference = model.zeros()
    assert loss == model.forward_backward(full, reference, x, y, EVAL)
    for g, r in zip(grads, reference):
        np.testing.assert_array_equal(g, r)


def test_layer_argument_errors():
    with pytest.raises(ValueError, match="p must be in"):
        Dropout(1.0)
    with pytest.raises(ValueError, match="activation"):
        mlp(2, (2,), 2, activation="tanh")
    model = mlp(2, (2,), 2)
    with pytest.raises(ValueError, match="labels must be in"):
        model.forward_backward(model.init_params(0), model.zeros(), np.ones((1, 2), np.float32), np.array([2]), EVAL)
    with pytest.raises(ValueError, match="pad_to must be >= 1"):
        Unit([LayerNorm(2), GELU()], pad_to=0)
