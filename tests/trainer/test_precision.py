"""dtype helpers, casting master shards, unscaling, and every DynamicLossScaler transition."""

import ml_dtypes
import numpy as np
import pytest

from trainer.nn import Context, mlp
from trainer.precision import (
    DynamicLossScaler,
    PrecisionPolicy,
    ScalerState,
    cast_to,
    dtype_name,
    has_inf_or_nan,
    next_scaler_state,
    resolve_dtype,
    unscale_,
)


def test_resolve_dtype():
    assert resolve_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    assert resolve_dtype("float16") == resolve_dtype(np.float16) == np.dtype("float16")
    assert dtype_name(ml_dtypes.bfloat16) == "bfloat16" and dtype_name("fp32") == "float32"
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")
    with pytest.raises(ValueError, match="unsupported dtype int32"):
        resolve_dtype(np.int32)


def test_policy():
    assert PrecisionPolicy(compute="float16").needs_loss_scaling
    assert not PrecisionPolicy(compute="bfloat16").needs_loss_scaling
    with pytest.raises(ValueError, match="unknown dtype"):
        PrecisionPolicy(reduce="float8")


def test_cast_rounds_to_nearest_even_and_overflows_to_inf():
    master = np.array([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1e5, -1e5, 3.0], dtype=np.float32)
    bf = cast_to(master, "bfloat16")  # 8 significand bits: 1 + 2^-8 is a tie -> even (1.0)
    assert bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf.astype(np.float32)[:3], [1.0, 1.0, 1.0 + 2.0**-6])
    out = np.empty(6, dtype=np.float16)
    with np.errstate(all="raise"):  # no floating-point warning escapes cast_to
        assert cast_to(master, np.float16, out=out) is out
    assert out[3] == np.inf and out[4] == -np.inf and out[5] == 3.0
    with pytest.raises(ValueError, match="out must be float16"):
        cast_to(master, np.float16, out=np.empty(6, dtype=np.float32))


@pytest.mark.parametrize("compute,activations", [("bfloat16", np.float32), ("float16", np.float16)])
def test_model_runs_on_low_precision_params(compute, activations):
    """float16 stays float16 through the model; bfloat16 operands are promoted to float32
    by ml_dtypes' matmul, so bf16 params give float32 activations (see precision.py)."""
    model = mlp(8, (16,), 4)
    params = model.init_params(0)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    ref = model.forward(params, x)
    low_params = [cast_to(p, compute) for p in params]
    low = model.forward(low_params, cast_to(x, compute))
    assert low.dtype == activations
    np.testing.assert_allclose(low.astype(np.float32), ref, atol=0.1)
    grads = model.zeros()  # float32 gradient buffers accumulate from low-precision compute
    model.forward_backward(low_params, grads, cast_to(x, compute), np.arange(5) % 4, Context())
    assert all(g.dtype == np.float32 and np.isfinite(g).all() and g.any() for g in grads)


def test_unscale_and_found_inf():
    g = np.array([2.0, 4.0, -8.0], dtype=np.float32)
    assert unscale_(g, 4.0) is False
    np.testing.assert_array_equal(g, [0.5, 1.0, -2.0])
    bad = np.array([1.0, np.inf, np.nan], dtype=np.float32)
    assert unscale_(bad, 2.0) is True
    assert has_inf_or_nan(np.ones(2), np.array([np.nan])) and not has_inf_or_nan(np.ones(2))
    with pytest.raises(ValueError, match="scale must be > 0"):
        unscale_(g, 0.0)


def test_transitions():
    s = ScalerState(8.0, 0)
    assert next_scaler_state(s, True) == ScalerState(4.0, 0)
    assert next_scaler_state(s, False, growth_interval=3) == ScalerState(8.0, 1)
    assert next_scaler_state(ScalerState(8.0, 2), False, growth_interval=3) == ScalerState(16.0, 0)
    assert next_scaler_state(ScalerState(8.0, 2), True, growth_interval=3) == ScalerState(4.0, 0)
    assert next_scaler_state(ScalerState(1e308, 0), False, growth_interval=1) == ScalerState(1e308, 0)
    assert next_scaler_state(ScalerState(8.0, 0), False, growth_interval=1) == ScalerState(16.0, 0)


def test_scaler_sequence_matches_hand_trace():
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    found = [False, False, True, False, False, False, False, True, True]
    steps = [scaler.update(f) for f in found]
    scales = []
    scaler2 = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    for f in found:
        scaler2.update(f)
        scales.append(scaler2.scale)
    assert steps == [not f for f in found]
    assert scales == [1024, 1024, 512, 512, 512, 1024, 1024, 512, 256]
    assert scaler.state_dict() == {"scale": 256.0, "good_steps": 0}
    fresh = DynamicLossScaler()
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.state == scaler.state


def test_disabled_scaler_and_arguments():
    off = DynamicLossScaler(enabled=False)
    assert off.scale == 1.0 and off.update(True) and off.scale == 1.0
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


def test_scaled_float16_gradients_recover_small_values():
    """Why loss scaling exists: 1e-8 underflows in float16 unless scaled first."""
    tiny = np.full(4, 1e-8, dtype=np.float32)
    assert not cast_to(tiny, np.float16).any()
    scale = 2.0**16
    half = cast_to(tiny * scale, np.float16).astype(np.float32)
    assert unscale_(half, scale) is False
    np.testing.assert_allclose(half, tiny, rtol=1e-2)
