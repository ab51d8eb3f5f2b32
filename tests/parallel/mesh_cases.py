"""Shared pieces of the mesh tests: the tiny float64 GPT, its single-process reference, a runner
of a dp x tp x pp mesh whose ranks are tasks of one process, and `run_trainer`, `python -m trainer`
(through the launcher) with the tiny float64 MLP's flags `MLP`.

The model: 4 heads of size 2 (tp = 4 splits them), a vocabulary of 11 (tp = 4 cuts it 3 3 3 2),
4 blocks (pp = 4 gives each stage one), dropout 0.1 everywhere (the attention's masks cut by heads,
the residual ones replicated). The data: random windows of 5 tokens, global batches of 8 windows.
The reference is the plain model and AdamW in one process on the same global batches, weight
decay on the matrices only, clipping by the global norm.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.testing import run_ranks
from trainer.data import iter_local_batches
from trainer.nn import GPT, Context, GPTConfig
from trainer.optim import AdamW
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.sharding import TrainConfig
from trainer.text import RandomWindows

CONFIG = GPTConfig(vocab_size=11, block_size=5, n_layer=4, n_head=4, n_embd=8, dropout=0.1)
TOKENS = np.random.default_rng(8).integers(0, 11, size=300)
WINDOWS = RandomWindows(TOKENS, CONFIG.block_size, num_windows=24, seed=3)
GLOBAL_BATCH, STEPS, LR, SEED = 8, 3, 2e-2, 5
F64 = dict(param_dtype="float64", reduce_dtype="float64", master_dtype="float64", adam_kernel="numpy")
ROOT = Path(__file__).resolve().parents[2]
MLP = ["--data", "synthetic", "--size", "320", "--in-dim", "8", "--classes", "3", "--width", "16", "--depth", "2",
       "--batch-size", "32", "--epochs", "2", "--strategy", "fsdp", "--master-dtype", "float64",
       "--param-dtype", "float64", "--reduce-dtype", "float64", "--log-every", "0", "--blas-threads", "1"]


def make_config(**kw) -> TrainConfig:
    return TrainConfig(**F64, lr=LR, seed=SEED, weight_decay=0.1, **kw)


@functools.cache
def reference(clip_norm: float | None = None, steps: int = STEPS):
    """Single-process training: (unpadded params per unit, losses, grad norms)."""
    model = GPT(CONFIG, dtype=np.float64)
    params = model.init_params(SEED)
    opt = AdamW(weight_decay=0.1, kernel="numpy")
    states = [opt.init_state(p.size, p.dtype) for p in params]
    batches = list(iter_local_batches(len(WINDOWS), GLOBAL_BATCH, seed=SEED, epoch=0))
    losses, norms = [], []
    for step in range(steps):
        x, y = WINDOWS.get(batches[step].indices, 0)
        grads = model.zeros()
        losses.append(model.forward_backward(params, grads, x, y, Context(seed=SEED, step=step)))
        norm = math.sqrt(sum(float(np.dot(g, g)) for g in grads))
        norms.append(norm)
        if clip_norm:
            for g in grads:
                g *= min(1.0, clip_norm / (norm + 1e-6))
        for p, g, s, u in zip(params, grads, states, model.units):
            opt.step(p, g, s, LR, segments=u.decay_segments(0, len(p)))
    return [p[: u.numel] for p, u in zip(params, model.units)], losses, norms


def assert_equals_reference(params, results, want_params, want_losses, want_norms) -> None:
    """One rank's run equals single-process training: parameters, losses and norms to 1e-12."""
    for i, (got, want) in enumerate(zip(params, want_params)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"unit {i}")
    np.testing.assert_allclose([r.loss for r in results], want_losses, rtol=1e-12)
    np.testing.assert_allclose([r.grad_norm for r in results], want_norms, rtol=1e-12)
    assert not any(r.skipped for r in results)


def step_batches(dp: int, dp_rank: int, accum: int):
    """This dp rank's micro-batches of each step: [(x, y, offset, global size)]."""
    micro = GLOBAL_BATCH // accum
    local = list(iter_local_batches(len(WINDOWS), micro, dp, dp_rank, seed=SEED, epoch=0))
    steps = [local[k : k + accum] for k in range(0, len(local), accum)]
    return [[(*WINDOWS.get(b.indices, 0), b.offset, b.global_size) for b in mbs] for mbs in steps]


async def train_mesh(strategy: str, *, dp: int = 1, tp: int = 1, pp: int = 1, steps: int = STEPS,
                     parallel: ParallelConfig | None = None, body_hook=None, **config_kw):
    """Per rank: (full params, step results, strategy) after ``steps`` steps on a dp x tp x pp mesh."""
    config = make_config(**config_kw)

    async def body(world):
        mesh = Mesh(world, dp=dp, tp=tp, pp=pp)
        s = make_parallel_strategy(strategy, CONFIG, config, mesh, parallel=parallel)
        try:
            await s.setup()
            batches = step_batches(dp, mesh.coords["dp"], config.grad_accum)
            results = [await s.train_step(mbs) for mbs in batches[:steps]]
            extra = await body_hook(s) if body_hook is not None else None
            return await s.full_params(), results, s, extra
        finally:
            s.close()

    return await run_ranks(dp * tp * pp, body)


def run_trainer(argv, cwd, ranks: int = 0, timeout: int = 150):
    """`python -m trainer ARGV` (through the launcher when ``ranks``): (exit code, output, history)."""
    out = Path(cwd) / f"history-{ranks}.json"
    cmd = [sys.executable, "-m", "trainer", *argv, "--json", str(out)]
    if ranks:
        cmd[1:3] = ["-m", "runtime.launch", "-n", str(ranks), "--max-time-s", str(timeout - 10), "-m", "trainer"]
    proc = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=timeout)
    history = json.loads(out.read_text())["history"] if out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, history


def assert_same_history(got: dict, want: dict) -> None:
    """Two runs' epochs agree to 1e-12 (losses and accuracies)."""
    assert len(got["epochs"]) == len(want["epochs"])
    for g, w in zip(got["epochs"], want["epochs"]):
        for key in ("train_loss", "train_eval_loss", "val_loss", "val_acc"):
            assert g[key] == pytest.approx(w[key], rel=1e-12, abs=1e-12), key
