"""Shared pieces of the distributed trainer tests: the tiny float64 problem, the
single-process reference (the plain model + optimizer loop) and a strategy runner.

The data: 70 synthetic rows, global batches of 16 (the 5th step's batch has 6
rows, so at 4 ranks two ranks hold 1 row), dropout 0.2 (masks must follow
Context.batch_offset), AdamW or SGD. With accumulation, micro-batches of 8 rows
x 2 make the same global batches of 16, so the reference is the same run.
"""

from __future__ import annotations

import math

import numpy as np

from runtime.testing import run_ranks
from trainer.data import iter_local_batches, make_synthetic
from trainer.nn import Context, mlp
from trainer.optim import SGD, AdamW
from trainer.sharding import TrainConfig, make_strategy

N_ROWS, IN, HIDDEN, OUT, GLOBAL_BATCH, STEPS = 70, 10, (12, 12), 3, 16, 5
DATA_SEED, INIT_SEED, LR = 6, 5, 2e-2
X, Y = make_synthetic(N_ROWS, in_dim=IN, num_classes=OUT, seed=4, dtype=np.float64)

F64 = dict(param_dtype="float64", reduce_dtype="float64", master_dtype="float64", adam_kernel="numpy")


def tiny_model(pad_to: int = 1, dtype=np.float64):
    return mlp(IN, HIDDEN, OUT, dropout=0.2, pad_to=pad_to, dtype=dtype)


def make_config(**kw) -> TrainConfig:
    base = dict(F64, lr=LR, seed=INIT_SEED, weight_decay=0.01)
    base.update(kw)
    return TrainConfig(**base)


def reference_run(config: TrainConfig, steps: int = STEPS) -> tuple[list[np.ndarray], list[float]]:
    """Single-process training on the global batches: unpadded params per unit, and losses."""
    model = tiny_model()
    params = model.init_params(config.seed)
    if config.optimizer == "sgd":
        opt = SGD(momentum=config.momentum, nesterov=config.nesterov, weight_decay=config.weight_decay)
    else:
        opt = AdamW(weight_decay=config.weight_decay, kernel="numpy")
    states = [opt.init_state(p.size, p.dtype) for p in params]
    batches = list(iter_local_batches(N_ROWS, GLOBAL_BATCH, seed=DATA_SEED, epoch=0))
    losses = []
    for step in range(steps):
        b = batches[step]
        grads = model.zeros()
        losses.append(model.forward_backward(params, grads, X[b.indices], Y[b.indices],
                                             Context(seed=config.seed, step=step), loss_denominator=b.global_size))
        if config.clip_norm:
            norm = math.sqrt(sum(float(np.dot(g, g)) for g in grads))
            coef = min(1.0, config.clip_norm / (norm + 1e-6))
            for g in grads:
                g *= coef
        for p, g, s, u in zip(params, grads, states, model.units):
            segments = u.decay_segments(0, len(p)) if config.decay == "matrices" else None
            opt.step(p, g, s, config.lr, segments=segments)
    return [p[: u.numel] for p, u in zip(params, model.units)], losses


def step_batches(world: int, rank: int, accum: int) -> list[list[tuple]]:
    """This rank's micro-batches of each step: (x, y, offset, global_size)."""
    micro = GLOBAL_BATCH // accum
    local = list(iter_local_batches(N_ROWS, micro, world, rank, seed=DATA_SEED, epoch=0))
    steps = [local[k : k + accum] for k in range(0, len(local), accum)]
    return [[(X[b.indices], Y[b.indices], b.offset, b.global_size) for b in mbs] for mbs in steps]


async def train_under(name: str, world: int, config: TrainConfig, steps: int = STEPS, *, setup_hook=None,
                      transport: str = "memory"):
    """Runs ``steps`` steps of ``name`` on ``world`` ranks; per rank: (full params, results, strategy)."""

    async def body(group):
        strategy = make_strategy(name, tiny_model(pad_to=group.size), config, group)
        try:
            await strategy.setup()
            if setup_hook is not None:
                setup_hook(strategy)
            results = []
            for mbs in step_batches(group.size, group.rank, config.grad_accum)[:steps]:
                results.append(await strategy.train_step(mbs))
            return await strategy.full_params(), results, strategy
        finally:
            strategy.close()

    return await run_ranks(world, body, transport=transport)


def assert_params_close(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-12) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol, err_msg=f"unit {i}")
