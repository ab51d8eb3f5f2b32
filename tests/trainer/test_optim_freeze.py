"""AdamW's frozen variance (``freeze_step``, 1-bit Adam's rule) against a scalar reference, and why
it lets error feedback work under Adam: with v frozen the update is linear in the gradient."""

import math

import numpy as np
import pytest

from trainer.optim import AdamW

N = 29


def scalar_adamw_frozen(p, grads, lr, b1, b2, eps, wd, freeze):
    """AdamW for one scalar whose v (and v's bias correction) stop changing after ``freeze`` steps."""
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        if t <= freeze:
            v = b2 * v + (1 - b2) * g * g
        p = p - (lr / (1 - b1**t)) * m / (math.sqrt(v) / math.sqrt(1 - b2 ** min(t, freeze)) + eps)
    return p


def run(opt, p0, grads, lr):
    p = p0.copy()
    state = opt.init_state(p.size, p.dtype)
    for g in grads:
        opt.step(p, g, state, lr)
    return p, state


@pytest.mark.parametrize("kernel", AdamW.KERNELS)
def test_frozen_variance_against_scalar_reference(kernel):
    rng = np.random.default_rng(3)
    p0, grads = rng.standard_normal(N), [rng.standard_normal(N) * (1 + 5 * (t > 3)) for t in range(8)]
    opt = AdamW(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, kernel=kernel, freeze_step=3)
    p, state = run(opt, p0, grads, 1e-2)
    expected = [scalar_adamw_frozen(p0[i], [g[i] for g in grads], 1e-2, 0.8, 0.95, 1e-6, 0.05, 3) for i in range(N)]
    np.testing.assert_allclose(p, expected, rtol=1e-12, atol=1e-14)
    _, at_freeze = run(opt, p0, grads[:3], 1e-2)  # v as it stood after step 3: kept since
    np.testing.assert_array_equal(state.buffers["exp_avg_sq"], at_freeze.buffers["exp_avg_sq"])
    live, _ = run(AdamW(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, kernel=kernel), p0, grads, 1e-2)
    assert np.abs(p - live).max() > 1e-3  # the larger late gradients would have grown v


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_frozen_variance_kernels_agree_bit_for_bit(dtype):
    rng = np.random.default_rng(4)
    p0 = rng.standard_normal(5001).astype(dtype)
    grads = [(rng.standard_normal(p0.size) * 10.0 ** rng.integers(-4, 2, p0.size)).astype(dtype) for _ in range(6)]
    ref, ref_state = run(AdamW(kernel="numpy", freeze_step=2), p0, grads, 1e-3)
    fused, fused_state = run(AdamW(kernel="numba", freeze_step=2), p0, grads, 1e-3)
    np.testing.assert_array_equal(fused, ref)
    for name in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(fused_state.buffers[name], ref_state.buffers[name])


def test_freeze_step_zero_is_plain_adamw_and_bad_values_are_refused():
    rng = np.random.default_rng(5)
    p0, grads = rng.standard_normal(N), [rng.standard_normal(N) for _ in range(4)]
    np.testing.assert_array_equal(run(AdamW(freeze_step=0), p0, grads, 1e-2)[0], run(AdamW(), p0, grads, 1e-2)[0])
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="freeze_step"):
            AdamW(freeze_step=bad)


def topk_ef(grads, k):
    """Top-k with error feedback, NumPy: what each step sends."""
    err, sent = np.zeros_like(grads[0]), []
    for g in grads:
        y = g + err
        keep = np.argsort(-np.abs(y), kind="stable")[:k]
        out = np.zeros_like(y)
        out[keep] = y[keep]
        err = y - out
        sent.append(out)
    return sent


@pytest.mark.parametrize("kernel", AdamW.KERNELS)
def test_error_feedback_bursts_cost_step_size_unless_the_variance_is_frozen(kernel):
    """Top-k 1/8 with error feedback of a steady gradient: each coordinate goes out in bursts of
    ~8x its gradient once in ~8 steps. Live Adam's v grows with the bursts' squares, so the
    parameters move ~sqrt(1/8) as far as uncompressed Adam's; with v frozen (after an
    uncompressed start) they move as far, up to what error feedback still holds back."""
    rng = np.random.default_rng(6)
    n, start, steps = 64, 8, 200
    g = rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)  # steady, like a loss's slow direction
    noisy = [g + 0.05 * rng.standard_normal(n) for _ in range(steps)]
    sent = noisy[:start] + topk_ef(noisy[start:], n // 8)
    kw = dict(weight_decay=0.0, kernel=kernel)
    p0 = np.zeros(n)
    full = run(AdamW(**kw), p0, noisy, 1e-3)[0]
    live = run(AdamW(**kw), p0, sent, 1e-3)[0]
    frozen = run(AdamW(freeze_step=start, **kw), p0, sent, 1e-3)[0]
    ratio_live = np.linalg.norm(live) / np.linalg.norm(full)
    ratio_frozen = np.linalg.norm(frozen) / np.linalg.norm(full)
    assert ratio_live < 0.6  # ~sqrt(1/8) = 0.35 after the start
    assert abs(ratio_frozen - 1.0) < 0.05
