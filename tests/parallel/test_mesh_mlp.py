"""Tensor and pipeline parallelism for a model other than the GPT: the MLP, cut by its layers'
declarations (column/row pairs, the LayerNorm and dropout between them on the cut features), equals
single-process training in float64 to 1e-12 under tp=2, pp=2 and tp2 x pp2, with ddp and zero3/fsdp
(and zero1/2) on dp: parameters after 3 steps, losses and gradient norms, on every rank; evaluation
and checkpoints too. Declarations that do not pair are refused, naming the layer.

Models: mlp(10, (12, 12), 3) (Linears column, row, whole head; units of 156, 180 and 39 parameters:
pp=2 cuts [0] | [1, 2]) and mlp(10, (12, 8, 12), 3) (two pairs, stage boundaries 12 and 8 wide),
dropout 0.2 everywhere (the first pair's masks cut by columns, the others replicated).
"""

import math

import numpy as np
import pytest

from mesh_cases import assert_equals_reference, make_config
from runtime.testing import run_ranks
from trainer import checkpoint
from trainer.data import iter_local_batches, make_synthetic
from trainer.nn import Context, Dropout, LayerNorm, Linear, Model, Unit, mlp
from trainer.optim import AdamW
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.parallel.split import check_pairs
from trainer.sharding import make_strategy

ROWS, IN, OUT, GLOBAL_BATCH, STEPS, LR, SEED = 48, 10, 3, 16, 3, 2e-2, 5
X, Y = make_synthetic(ROWS, in_dim=IN, num_classes=OUT, seed=4, dtype=np.float64)
NARROW, WIDE = (12, 12), (12, 8, 12)


def model(hidden=NARROW) -> Model:
    return mlp(IN, hidden, OUT, dropout=0.2, dtype=np.float64)


def reference(hidden=NARROW, clip_norm=None):
    """Single-process training: (unpadded params per unit, losses, grad norms)."""
    m = model(hidden)
    params = m.init_params(SEED)
    opt = AdamW(weight_decay=0.1, kernel="numpy")
    states = [opt.init_state(p.size, p.dtype) for p in params]
    losses, norms = [], []
    for step, b in enumerate(list(iter_local_batches(ROWS, GLOBAL_BATCH, seed=SEED, epoch=0))[:STEPS]):
        grads = m.zeros()
        losses.append(m.forward_backward(params, grads, X[b.indices], Y[b.indices], Context(seed=SEED, step=step),
                                         loss_denominator=b.global_size))
        norms.append(math.sqrt(sum(float(np.dot(g, g)) for g in grads)))
        for g in grads:
            g *= min(1.0, clip_norm / (norms[-1] + 1e-6)) if clip_norm else 1.0
        for p, g, s, u in zip(params, grads, states, m.units):
            opt.step(p, g, s, LR, segments=u.decay_segments(0, len(p)))
    return [p[: u.numel] for p, u in zip(params, m.units)], losses, norms


def batches(dp: int, dp_rank: int, accum: int):
    micro = GLOBAL_BATCH // accum
    local = list(iter_local_batches(ROWS, micro, dp, dp_rank, seed=SEED, epoch=0))
    return [[(X[b.indices], Y[b.indices], b.offset, b.global_size) for b in local[k : k + accum]]
            for k in range(0, len(local), accum)]


async def train(name, *, dp=1, tp=1, pp=1, hidden=NARROW, schedule="1f1b", m=2, hook=None, **variant):
    config = make_config(**variant)

    async def body(world):
        mesh = Mesh(world, dp=dp, tp=tp, pp=pp)
        s = make_parallel_strategy(name, model(hidden), config, mesh, parallel=ParallelConfig(schedule, m))
        try:
            await s.setup()
            results = [await s.train_step(mbs) for mbs in batches(dp, mesh.coords["dp"], config.grad_accum)[:STEPS]]
            extra = await hook(s, mesh) if hook is not None else None
            return await s.full_params(), results, s, extra
        finally:
            s.close()

    return await run_ranks(dp * tp * pp, body)


CASES = [  # (strategy, dp, tp, pp, hidden, schedule, micro-batches, variant)
    ("ddp", 1, 2, 1, NARROW, "1f1b", 2, {}),
    ("fsdp", 1, 2, 1, NARROW, "1f1b", 2, {"grad_accum": 2}),
    ("ddp", 1, 1, 2, NARROW, "gpipe", 4, {}),
    ("fsdp", 1, 1, 2, WIDE, "1f1b", 4, {"clip_norm": 0.3}),
    ("ddp", 1, 2, 2, WIDE, "1f1b", 4, {"clip_norm": 0.3}),
    ("fsdp", 1, 2, 2, NARROW, "gpipe", 2, {}),
    ("zero3", 2, 2, 1, WIDE, "1f1b", 2, {"grad_accum": 2}),
    ("ddp", 2, 1, 2, NARROW, "1f1b", 2, {}),
    ("zero2", 2, 2, 1, NARROW, "1f1b", 2, {"clip_norm": 0.3}),
    ("zero1", 1, 2, 2, WIDE, "gpipe", 2, {}),
]


def _id(case):
    name, dp, tp, pp, hidden, sched, m, variant = case
    return f"{name}-dp{dp}tp{tp}pp{pp}-{'x'.join(map(str, hidden))}-{sched}-m{m}-{'+'.join(variant) or 'plain'}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
async def test_the_mlp_on_a_mesh_equals_single_process(case):
    name, dp, tp, pp, hidden, sched, m, variant = case
    want_params, want_losses, want_norms = reference(hidden, variant.get("clip_norm"))
    out = await train(name, dp=dp, tp=tp, pp=pp, hidden=hidden, schedule=sched, m=m, **variant)
    assert len(out) == dp * tp * pp
    for params, results, s, _ in out:
        assert_equals_reference(params, results, want_params, want_losses, want_norms)
        assert s.memory_bytes()["transient_now"] == 0
        if tp > 1:  # the first pair is cut: the tp dimension carried bytes
            assert all(r.comm_bytes_by_dim["tp"] > 0 for r in results)
    if variant.get("clip_norm"):
        assert all(n > variant["clip_norm"] for n in want_norms)  # the clip bit


@pytest.mark.timeout(120)
async def test_evaluation_and_checkpoints_of_the_mlp_on_a_mesh(tmp_path):
    """tp2 x pp2: the metric sums of a slice equal one process's on every rank; a checkpoint saved on
    the mesh holds the full model and loads on one rank with plain ddp."""
    x, y = X[:20], Y[:20]

    async def hook(s, mesh):
        metrics = await s.evaluate(x, y)
        await checkpoint.save(s, tmp_path)
        return metrics

    out = await train("fsdp", tp=2, pp=2, hidden=WIDE, hook=hook)
    want_params, _, _ = reference(WIDE)
    plain = model(WIDE)
    want = plain.metrics([np.asarray(p) for p in want_params], x, y)
    for _, _, _, metrics in out:
        assert set(metrics) == {"loss", "accuracy"}
        assert metrics["accuracy"] == want["accuracy"]
        np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-12)

    async def load(group):
        s = make_strategy("ddp", model(WIDE), make_config(), group)
        try:
            await s.setup()
            meta = checkpoint.load(s, tmp_path)
            return meta, await s.full_params()
        finally:
            s.close()

    [(meta, params)] = await run_ranks(1, load)
    assert meta["mesh"] == {"pp": 2, "dp": 1, "tp": 2} and meta["step"] == STEPS
    for got, want in zip(params, want_params):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _model(*units) -> Model:
    return Model([Unit(list(u)) for u in units])


@pytest.mark.parametrize("units, message", [
    ([[Linear(4, 4, split="row")]], "unit 0 layer 0: a row Linear needs the cut features of a column Linear"),
    ([[Linear(4, 4, split="column")], [Linear(4, 2)]],
     "unit 1 layer 0: a Linear between unit 0 layer 0's column Linear and its row Linear"),
    ([[Linear(4, 4, split="column"), LayerNorm(4)], [Linear(4, 2, split="row")]],
     "unit 0 layer 1: a LayerNorm between unit 0 layer 0's column Linear"),
    ([[Linear(4, 4, split="column"), Dropout(0.1)], [Linear(4, 2, split="row")]],
     "unit 0 layer 1: a Dropout between"),
    ([[Linear(4, 4), Dropout(0.1, split="column")]], "unit 0 layer 1: a Dropout declared 'column' outside"),
    ([[Linear(4, 4, split="column")], [Linear(4, 2, split="column")]], "a column Linear while unit 0 layer 0's"),
    ([[Linear(4, 4, split="column")]], "unit 0 layer 0: a column Linear never closed by a row Linear"),
])
def test_declarations_that_do_not_pair_are_refused_naming_the_layer(units, message):
    with pytest.raises(ValueError, match=message):
        check_pairs(_model(*units))


def test_declarations_that_pair_pass_and_split_only_what_they_name():
    check_pairs(model(WIDE))
    check_pairs(_model([Linear(4, 4, split="column"), LayerNorm(4, split="column"), Dropout(0.1, split="column")],
                       [Linear(4, 4, split="row"), LayerNorm(4)], [Linear(4, 2)]))
    with pytest.raises(ValueError, match="Linear split must be None or one of"):
        Linear(4, 4, split="vocab")
