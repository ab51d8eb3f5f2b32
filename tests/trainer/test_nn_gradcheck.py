"""Every layer, the loss and a whole tiny model against CENTRAL finite differences (float64).

Each check builds the scalar objective L = sum(out * dout) for a fixed random
dout, perturbs one input or one flat parameter by +-h, and compares
(L(+h) - L(-h)) / 2h with the hand-written backward.
"""

import numpy as np
import pytest

from trainer.nn import (
    GELU,
    Context,
    Dropout,
    LayerNorm,
    Linear,
    ReLU,
    Sequential,
    Unit,
    cross_entropy_forward,
    mlp,
    softmax_cross_entropy,
)

H = 1e-6
RTOL, ATOL = 1e-6, 1e-8
CTX = Context(training=True, seed=7, step=3)


def central_diff(f, arr: np.ndarray) -> np.ndarray:
    """d f / d arr by central differences, perturbing arr in place element by element."""
    grad = np.zeros_like(arr)
    flat, gflat = arr.reshape(-1), grad.reshape(-1)
    for k in range(flat.size):
        old = flat[k]
        flat[k] = old + H
        f_plus = f()
        flat[k] = old - H
        f_minus = f()
        flat[k] = old
        gflat[k] = (f_plus - f_minus) / (2 * H)
    return grad


def random_unit_params(unit: Unit, rng) -> np.ndarray:
    """Initialised parameters plus noise, so LayerNorm's w/b are not trivially 1/0."""
    flat = unit.init_params(seed=1)
    flat[: unit.numel] += 0.3 * rng.standard_normal(unit.numel)
    return flat


def check_unit(unit: Unit, x: np.ndarray, ctx: Context = CTX) -> None:
    rng = np.random.default_rng(42)
    params = random_unit_params(unit, rng)
    out, _ = unit.forward(params, x, ctx)
    dout = rng.standard_normal(out.shape)

    def objective():
        return float((unit.forward(params, x, ctx)[0] * dout).sum())

    grad = unit.zeros()
    _, cache = unit.forward(params, x, ctx)
    dx = unit.backward(params, cache, dout, grad)

    np.testing.assert_allclose(dx, central_diff(objective, x), rtol=RTOL, atol=ATOL)
    if unit.numel:
        np.testing.assert_allclose(grad, central_diff(objective, params), rtol=RTOL, atol=ATOL)
    assert not grad[unit.numel :].any(), "padding of the gradient must stay zero"


def x_away_from_zero(shape, seed=0):
    """Inputs with |x| >= 0.1, so ReLU's kink is never inside the +-h window."""
    x = np.random.default_rng(seed).standard_normal(shape)
    return np.where(np.abs(x) < 0.1, np.sign(x) * 0.1 + x, x)


LAYERS = {
    "linear": lambda: [Linear(5, 4)],
    "linear_nobias": lambda: [Linear(5, 4, bias=False)],
    "relu": lambda: [ReLU()],
    "gelu": lambda: [GELU()],
    "layernorm": lambda: [LayerNorm(5)],
    "dropout": lambda: [Dropout(0.4)],
    "block": lambda: [Linear(5, 6), LayerNorm(6), GELU(), Dropout(0.3), Linear(6, 3), ReLU()],
}


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("pad_to", [1, 7])
def test_layer_against_central_differences(name, pad_to):
    unit = Unit(LAYERS[name](), pad_to=pad_to, dtype=np.float64)
    check_unit(unit, x_away_from_zero((6, 5)))


def test_linear_accepts_leading_dimensions():
    unit = Unit([Linear(5, 3), LayerNorm(3)], dtype=np.float64)
    check_unit(unit, x_away_from_zero((2, 3, 5)))


def test_nested_sequential():
    unit = Unit(Sequential(Sequential(Linear(4, 4), GELU()), Sequential(LayerNorm(4), Linear(4, 2))), pad_to=3, dtype=np.float64)
    assert [s.name for s in unit.param_specs][:3] == ["0.0.weight", "0.0.bias", "1.0.weight"]
    check_unit(unit, x_away_from_zero((3, 4)))


@pytest.mark.parametrize("denominator", [None, 11.0])
def test_cross_entropy_against_central_differences(denominator):
    rng = np.random.default_rng(3)
    logits = 3 * rng.standard_normal((6, 4))
    y = rng.integers(0, 4, size=6)
    _, dlogits = softmax_cross_entropy(logits, y, denominator)
    fd = central_diff(lambda: cross_entropy_forward(logits, y, denominator)[0], logits)
    np.testing.assert_allclose(dlogits, fd, rtol=RTOL, atol=ATOL)


def test_cross_entropy_closed_form_and_stability():
    # uniform logits -> loss = log K exactly; huge logits must not overflow
    loss, _ = softmax_cross_entropy(np.zeros((3, 5)), np.array([0, 1, 4]))
    assert loss == pytest.approx(np.log(5), abs=1e-15)
    loss, d = softmax_cross_entropy(np.array([[1000.0, 0.0]]), np.array([1]))
    assert loss == pytest.approx(1000.0) and np.isfinite(d).all()


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_whole_model_against_central_differences(dropout):
    model = mlp(3, (4, 5), 3, dropout=dropout, pad_to=4, dtype=np.float64)
    rng = np.random.default_rng(5)
    params = model.init_params(seed=0)
    x = rng.standard_normal((7, 3))
    y = rng.integers(0, 3, size=7)
    grads = model.zeros()
    model.forward_backward(params, grads, x, y, CTX, loss_denominator=9)

    def loss():
        g = model.zeros()
        return model.forward_backward(params, g, x, y, CTX, loss_denominator=9)

    for i, unit in enumerate(model.units):
        np.testing.assert_allclose(grads[i], central_diff(loss, params[i]), rtol=RTOL, atol=ATOL)
        assert not grads[i][unit.numel :].any()
