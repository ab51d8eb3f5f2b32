"""SGD and AdamW against closed forms and a scalar step-by-step reference; Numba == NumPy; schedules."""

import math

import numpy as np
import pytest

from trainer.optim import SGD, AdamW, Constant, OptimState, WarmupCosine, state_nbytes

N = 37


def run(opt, p0, grads, lrs):
    p = p0.copy()
    state = opt.init_state(p.size, p.dtype)
    for g, lr in zip(grads, lrs):
        opt.step(p, g, state, lr)
    return p, state


def scalar_sgd(p, grads, lr, mu, damp, nesterov, wd):
    """torch.optim.SGD for one scalar, written as plainly as possible."""
    buf = None
    for g in grads:
        d = g + wd * p
        if mu:
            buf = d if buf is None else mu * buf + (1 - damp) * d
            d = d + mu * buf if nesterov else buf
        p = p - lr * d
    return p


def scalar_adamw(p, grads, lr, b1, b2, eps, wd):
    """torch.optim.AdamW for one scalar."""
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - (lr / (1 - b1**t)) * m / (math.sqrt(v) / math.sqrt(1 - b2**t) + eps)
    return p


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    return rng.standard_normal(N), [rng.standard_normal(N) for _ in range(6)]


# ---- SGD -------------------------------------------------------------------


def test_sgd_constant_gradient_closed_form():
    # b_t = g (1 - mu^t) / (1 - mu);  p_T = p0 - lr g sum_t b_t / g
    p0, g, lr, mu, T = np.full(4, 2.0), np.array([1.0, -2.0, 0.5, 0.0]), 0.1, 0.9, 5
    plain, _ = run(SGD(), p0, [g] * T, [lr] * T)
    np.testing.assert_allclose(plain, p0 - T * lr * g, rtol=1e-15)
    heavy, _ = run(SGD(momentum=mu), p0, [g] * T, [lr] * T)
    coef = sum((1 - mu**t) / (1 - mu) for t in range(1, T + 1))
    np.testing.assert_allclose(heavy, p0 - lr * coef * g, rtol=1e-14)
    nest, _ = run(SGD(momentum=mu, nesterov=True), p0, [g] * T, [lr] * T)
    coef_n = sum(1 + mu * (1 - mu**t) / (1 - mu) for t in range(1, T + 1))
    np.testing.assert_allclose(nest, p0 - lr * coef_n * g, rtol=1e-14)


@pytest.mark.parametrize(
    "mu,damp,nesterov,wd", [(0, 0, False, 0.1), (0.9, 0, False, 0), (0.9, 0.3, False, 0.05), (0.8, 0, True, 0.01)]
)
def test_sgd_against_scalar_reference(problem, mu, damp, nesterov, wd):
    p0, grads = problem
    lr = 0.05
    p, state = run(SGD(momentum=mu, dampening=damp, nesterov=nesterov, weight_decay=wd), p0, grads, [lr] * 6)
    expected = [scalar_sgd(p0[i], [g[i] for g in grads], lr, mu, damp, nesterov, wd) for i in range(N)]
    np.testing.assert_allclose(p, expected, rtol=1e-13, atol=1e-15)
    assert state.step == 6 and state_nbytes(state) == (N * 8 if mu else 0)


def test_sgd_does_not_modify_grad():
    g = np.ones(3)
    run(SGD(momentum=0.9, weight_decay=0.1), np.ones(3), [g, g], [0.1, 0.1])
    np.testing.assert_array_equal(g, 1.0)


# ---- AdamW -----------------------------------------------------------------


@pytest.mark.parametrize("kernel", AdamW.KERNELS)
def test_adamw_constant_gradient_closed_form(kernel):
    # bias correction makes m_hat = g, v_hat = g^2 exactly, so each step moves
    # by u = lr g / (|g| + eps), and p_t = p_{t-1} (1 - lr wd) - u.
    p0, g, lr, wd, T = np.array([1.0, -3.0, 0.25]), np.array([0.5, -2.0, 1e-3]), 1e-2, 0.1, 7
    p, state = run(AdamW(weight_decay=wd, kernel=kernel), p0, [g] * T, [lr] * T)
    a, u = 1 - lr * wd, lr * g / (np.abs(g) + 1e-8)
    expected = p0 * a**T - u * sum(a**k for k in range(T))
    np.testing.assert_allclose(p, expected, rtol=1e-10)
    assert state.step == T


@pytest.mark.parametrize("kernel", AdamW.KERNELS)
def test_adamw_against_scalar_reference(problem, kernel):
    p0, grads = problem
    lrs = [1e-2, 2e-2, 3e-2, 3e-2, 1e-2, 5e-3]
    opt = AdamW(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, kernel=kernel)
    p, state = run(opt, p0, grads, lrs)
    expected = [scalar_adamw_lrs(p0[i], [g[i] for g in grads], lrs) for i in range(N)]
    np.testing.assert_allclose(p, expected, rtol=1e-12, atol=1e-14)
    assert state_nbytes(state) == 2 * N * 8


def scalar_adamw_lrs(p, grads, lrs, b1=0.8, b2=0.95, eps=1e-6, wd=0.05):
    m = v = 0.0
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - (lr / (1 - b1**t)) * m / (math.sqrt(v) / math.sqrt(1 - b2**t) + eps)
    return p


def test_scalar_references_agree():
    grads = [0.3, -1.0, 2.0]
    assert scalar_adamw(1.0, grads, 0.01, 0.8, 0.95, 1e-6, 0.05) == scalar_adamw_lrs(1.0, grads, [0.01] * 3)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_adamw_numba_equals_numpy(dtype, rtol):
    """Both kernels do float64 arithmetic and store once per array, so they agree to
    rounding (today bit for bit); gradients span 1e-4 .. 10 to exercise eps and scale."""
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(10_001).astype(dtype)
    grads = [(rng.standard_normal(p0.size) * 10.0 ** rng.integers(-4, 2, p0.size)).astype(dtype) for _ in range(8)]
    ref, ref_state = run(AdamW(kernel="numpy"), p0, grads, [1e-3] * 8)
    fused, fused_state = run(AdamW(kernel="numba"), p0, grads, [1e-3] * 8)
    assert fused.dtype == dtype and fused_state.buffers["exp_avg"].dtype == dtype
    np.testing.assert_allclose(fused, ref, rtol=rtol, atol=0)
    for name in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_allclose(fused_state.buffers[name], ref_state.buffers[name], rtol=rtol, atol=0)
    assert not np.array_equal(fused, p0)


@pytest.mark.parametrize("opt", [SGD(momentum=0.9, weight_decay=0.1), AdamW(kernel="numpy"), AdamW(kernel="numba")])
def test_zero_padding_stays_zero_and_shards_are_independent(opt):
    """Stepping two halves of a shard separately equals stepping the whole (elementwise)."""
    rng = np.random.default_rng(2)
    p0 = np.concatenate([rng.standard_normal(10), np.zeros(2)])
    grads = [np.concatenate([rng.standard_normal(10), np.zeros(2)]) for _ in range(3)]
    whole, _ = run(opt, p0, grads, [0.1] * 3)
    assert not whole[10:].any()
    lo, _ = run(opt, p0[:6], [g[:6] for g in grads], [0.1] * 3)
    hi, _ = run(opt, p0[6:], [g[6:] for g in grads], [0.1] * 3)
    np.testing.assert_array_equal(np.concatenate([lo, hi]), whole)


def test_optimizer_argument_errors():
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(nesterov=True)
    with pytest.raises(ValueError, match="kernel"):
        AdamW(kernel="cuda")
    with pytest.raises(ValueError, match="1-D of one length"):
        SGD().step(np.zeros(3), np.zeros(4), OptimState(0), 0.1)
    with pytest.raises(ValueError, match="exp_avg"):
        opt = AdamW()
        opt.step(np.zeros(3), np.zeros(3), opt.init_state(4), 0.1)


# ---- schedules ---------------------------------------------------------------


def test_schedules():
    assert Constant(0.1)(0) == Constant(0.1)(10**6) == 0.1
    s = WarmupCosine(peak_lr=1.0, warmup_steps=4, total_steps=14, min_lr=0.1)
    assert [s(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0
    assert s(9) == pytest.approx(0.55)  # half-way: min + (peak - min) / 2
    assert s(13) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert s(14) == s(10**6) == 0.1
    lrs = [s(k) for k in range(4, 15)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert WarmupCosine(1.0, 0, 10)(0) == 1.0
    with pytest.raises(ValueError, match="warmup_steps <= total_steps"):
        WarmupCosine(1.0, 5, 4)


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
def test_weight_decay_applies_to_the_decayed_segments_only(kernel):
    """Parameter groups as segments of a flat shard: zero gradients, so only decay moves a parameter."""
    segments = [(0, 2, True), (2, 5, False), (5, 6, True)]
    adam, sgd = AdamW(weight_decay=0.1, kernel=kernel), SGD(weight_decay=0.1)
    for opt, want in [(adam, 1.0 - 0.1 * 0.1), (sgd, 1.0 - 0.1 * 0.1)]:
        p = np.ones(6)
        opt.step(p, np.zeros(6), opt.init_state(6, np.float64), 0.1, segments=segments)
        np.testing.assert_allclose(p, [want, want, 1, 1, 1, want], rtol=1e-15)
    with pytest.raises(ValueError, match="tile"):
        adam.step(np.ones(6), np.zeros(6), adam.init_state(6, np.float64), 0.1, segments=[(0, 2, True), (3, 6, False)])


# ---- --betas through the command line and a strategy -----------------------


def numpy_adamw_run(model, x, y, steps, lr, b1, b2, eps=1e-8):
    """Plain AdamW (no weight decay) on the whole model's flat buffers, written out in NumPy."""
    from trainer.nn import Context

    params, grads = model.init_params(1), model.zeros()
    moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    for t in range(1, steps + 1):
        model.zero_grads(grads)
        model.forward_backward(params, grads, x, y, Context(seed=1, step=t - 1))
        for p, g, (m, v) in zip(params, grads, moments):
            m[...] = b1 * m + (1 - b1) * g
            v[...] = b2 * v + (1 - b2) * g * g
            p -= lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return np.concatenate([p[: u.numel] for p, u in zip(params, model.units)])


async def test_betas_given_on_the_command_line_drive_the_strategys_adamw():
    """Before, AdamW's betas were fixed at (0.9, 0.999) whatever a run asked for."""
    from runtime.testing import run_ranks
    from trainer.cli import make_config, parse_args
    from trainer.data import make_synthetic
    from trainer.nn import mlp
    from trainer.sharding import make_strategy

    args = parse_args(["--betas", "0.8,0.95", "--epochs", "1", "--weight-decay", "0", "--master-dtype", "float64",
                       "--param-dtype", "float64", "--reduce-dtype", "float64", "--seed", "1"])
    config = make_config(args, steps_per_epoch=1)  # one step in all: a constant learning rate
    assert config.betas == (0.8, 0.95) and parse_args([]).betas == (0.9, 0.999)
    x, y = make_synthetic(12, in_dim=4, num_classes=3, seed=2, dtype=np.float64)

    async def body(group):
        strategy = make_strategy("ddp", mlp(4, (5,), 3, dtype=np.float64), config, group)
        await strategy.setup()
        try:
            for _ in range(4):
                await strategy.train_step([(x, y, 0, len(x))])
            return np.concatenate(await strategy.full_params())
        finally:
            strategy.close()

    [trained] = await run_ranks(1, body)
    model = mlp(4, (5,), 3, dtype=np.float64)
    np.testing.assert_allclose(trained, numpy_adamw_run(model, x, y, 4, args.lr, 0.8, 0.95), rtol=1e-12, atol=1e-14)
    assert not np.allclose(trained, numpy_adamw_run(model, x, y, 4, args.lr, 0.9, 0.999), rtol=1e-6, atol=0)
