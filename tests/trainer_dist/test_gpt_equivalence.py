"""The GPT under every strategy equals single-process training: float64, world sizes 1-4,
with and without gradient accumulation, clipping and activation checkpointing, to 1e-12;
and each rank holds the bytes the ZeRO formulas say.

The reference is the plain model + AdamW loop in one process on the same global batches
of random windows (trainer.text.RandomWindows, the sampler every strategy shares),
weight decay on the matrices only. Dropout is on; at 4 ranks a micro-batch of 3 windows
leaves one rank with none. The model is built unpadded (pad_to=1): padding to the world
size is the strategy's business.

The matrix is not the full cross product (5 strategies x 4 world sizes x 4 variants
would cost a minute): each (strategy, world) pair runs one variant, chosen so that every
strategy meets every variant and every world size meets every variant.
"""

import functools
import math

import numpy as np
import pytest

from runtime.testing import run_ranks
from trainer.data import iter_local_batches
from trainer.nn import GPT, Context, GPTConfig
from trainer.optim import AdamW
from trainer.sharding import TrainConfig, make_strategy
from trainer.text import RandomWindows

CONFIG = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=2, n_embd=8, dropout=0.1)
TOKENS = np.random.default_rng(8).integers(0, 11, size=300)
WINDOWS = RandomWindows(TOKENS, CONFIG.block_size, num_windows=18, seed=3)
GLOBAL_BATCH, STEPS, LR = 6, 3, 2e-2
F64 = dict(param_dtype="float64", reduce_dtype="float64", master_dtype="float64", adam_kernel="numpy")
STRATEGY_NAMES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
VARIANTS = [
    {},
    {"grad_accum": 2, "activation_checkpointing": True},
    {"clip_norm": 0.3},
    {"grad_accum": 2, "clip_norm": 0.3, "activation_checkpointing": True},
]
MATRIX = [(name, world, i_variant) for s, name in enumerate(STRATEGY_NAMES) for world in (1, 2, 3, 4)
          for i_variant in [(s + world) % len(VARIANTS)]]
EXPECTED_BYTES = {  # bytes per padded parameter: (params, grads, optim), float64 Adam
    "ddp": lambda n: (8, 8, 16), "zero1": lambda n: (8, 8, 16 / n), "zero2": lambda n: (8, 8 / n, 16 / n),
    "zero3": lambda n: (8 / n, 8 / n, 16 / n), "fsdp": lambda n: (8 / n, 8 / n, 16 / n),
}


def make_config(**kw) -> TrainConfig:
    return TrainConfig(**F64, lr=LR, seed=5, weight_decay=0.1, **kw)


@functools.cache
def reference(i_variant: int):
    """Single-process training on the global batches: unpadded params per unit, losses, grad norms."""
    config = make_config(**VARIANTS[i_variant])
    model = GPT(CONFIG, dtype=np.float64)
    params = model.init_params(config.seed)
    opt = AdamW(weight_decay=config.weight_decay, kernel="numpy")
    states = [opt.init_state(p.size, p.dtype) for p in params]
    batches = list(iter_local_batches(len(WINDOWS), GLOBAL_BATCH, seed=config.seed, epoch=0))
    losses, norms = [], []
    for step in range(STEPS):
        x, y = WINDOWS.get(batches[step].indices, 0)
        grads = model.zeros()
        losses.append(model.forward_backward(params, grads, x, y, Context(seed=config.seed, step=step)))
        norm = math.sqrt(sum(float(np.dot(g, g)) for g in grads))
        norms.append(norm)
        if config.clip_norm:
            for g in grads:
                g *= min(1.0, config.clip_norm / (norm + 1e-6))
        for p, g, s, u in zip(params, grads, states, model.units):
            opt.step(p, g, s, config.lr, segments=u.decay_segments(0, len(p)))
    return [p[: u.numel] for p, u in zip(params, model.units)], losses, norms


def step_batches(world: int, rank: int, accum: int):
    micro = GLOBAL_BATCH // accum
    local = list(iter_local_batches(len(WINDOWS), micro, world, rank, seed=5, epoch=0))
    steps = [local[k : k + accum] for k in range(0, len(local), accum)]
    return [[(*WINDOWS.get(b.indices, 0), b.offset, b.global_size) for b in mbs] for mbs in steps]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, world, i_variant", MATRIX,
                         ids=[f"{n}-{w}-{'+'.join(VARIANTS[v]) or 'plain'}" for n, w, v in MATRIX])
async def test_gpt_under_every_strategy_equals_single_process(name, world, i_variant):
    config = make_config(**VARIANTS[i_variant])
    want_params, want_losses, want_norms = reference(i_variant)

    async def body(group):
        model = GPT(CONFIG, dtype=np.float64)  # unpadded: the strategy pads
        strategy = make_strategy(name, model, config, group)
        try:
            await strategy.setup()
            results = [await strategy.train_step(mbs)
                       for mbs in step_batches(group.size, group.rank, config.grad_accum)[:STEPS]]
            lengths = [u.padded_length(group.size) for u in model.units]
            return await strategy.full_params(), results, strategy.memory_bytes(), lengths
        finally:
            strategy.close()

    for params, results, mem, lengths in await run_ranks(world, body):
        for i, (got, want) in enumerate(zip(params, want_params)):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"unit {i}")
        np.testing.assert_allclose([r.loss for r in results], want_losses, rtol=1e-12)
        np.testing.assert_allclose([r.grad_norm for r in results], want_norms, rtol=1e-12)
        P = sum(lengths)
        assert (mem["params"], mem["grads"], mem["optim"]) == tuple(
            int(round(k * P)) for k in EXPECTED_BYTES[name](world)), mem
        assert mem["transient_now"] == 0
    if "clip_norm" in config.__dict__ and config.clip_norm:  # the clip must have bitten
        assert all(n > config.clip_norm for n in want_norms)


@pytest.mark.timeout(60)
async def test_checkpointing_under_fsdp_gives_the_same_bits_with_less_activation_memory():
    async def run(checkpointing: bool):
        async def body(group):
            strategy = make_strategy("fsdp", GPT(CONFIG, dtype=np.float64),
                                     make_config(activation_checkpointing=checkpointing), group)
            try:
                await strategy.setup()
                losses = [(await strategy.train_step(mbs)).loss for mbs in step_batches(2, group.rank, 1)[:2]]
                return losses, [p.tobytes() for p in await strategy.full_params()], strategy.memory_bytes()
            finally:
                strategy.close()

        return await run_ranks(2, body)

    for (l0, p0, m0), (l1, p1, m1) in zip(await run(False), await run(True)):
        assert l0 == l1 and p0 == p1
        assert 0 < m1["activations_peak"] < m0["activations_peak"]
