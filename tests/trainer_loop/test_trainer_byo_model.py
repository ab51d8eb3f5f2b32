"""Bring your own model: the README's "Your own model" example as written, its regression
model with MSE under every strategy through `fit`, and the openings it needs (the loss and
metrics from the model or the caller, padding as the strategy's business, full_params
that model.forward takes)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.testing import run_ranks
from trainer.loop import fit
from trainer.nn import MSELoss, mlp
from trainer.sharding import STRATEGIES, TrainConfig, make_strategy

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    """The first python block of the README's "## Your own model" section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own model"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def example_namespace() -> dict:
    namespace = {"__name__": "readme_example"}  # not __main__: define, do not run
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    return namespace


@pytest.mark.timeout(120)
def test_the_readme_example_runs_as_written_with_fsdp_on_two_ranks(tmp_path):
    script = tmp_path / "regression.py"
    script.write_text(readme_example())
    assert len(readme_example().splitlines()) < 60
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "2", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fsdp on 2 rank(s): 8 epoch(s)" in proc.stdout
    val_loss = float(re.search(r"validation loss\s+([0-9.]+)", proc.stdout).group(1))
    assert val_loss < 0.005  # Huber on targets of variance ~0.17: the curve is learnt


@pytest.mark.timeout(60)
async def test_the_readme_regression_model_with_mse_trains_under_every_strategy():
    ns = example_namespace()
    data, epochs = ns["Data"], 2
    config = TrainConfig(lr=1e-2, warmup_steps=6, total_steps=epochs * 32, decay="all")
    variance = float(np.var(data.val.y))

    async def body(group, name):
        strategy = make_strategy(name, ns["make_model"](MSELoss()), config, group)  # padding: the strategy's
        try:
            await strategy.setup()
            history = await fit(strategy, data, config, epochs=epochs, global_batch_size=64, log_every=0,
                                eval_train=False, print_summary=False, group=group)
            full = await strategy.full_params()  # unpadded: model.forward takes them as they are
            mse = float(((strategy.model.forward(full, data.val.x) - data.val.y) ** 2).mean())
            return history.final.val_loss, mse, history.final.val_acc
        finally:
            strategy.close()

    losses = {}
    for name in STRATEGIES:
        for val_loss, mse, acc in await run_ranks(3, lambda group, name=name: body(group, name)):
            assert val_loss == pytest.approx(mse, rel=1e-6)  # the loop's metric is the loss of the model
            assert acc is None  # MSE has no accuracy
            losses[name] = val_loss
    assert max(losses.values()) < 0.1 * variance, losses
    assert max(losses.values()) == pytest.approx(min(losses.values()), rel=1e-3)  # one run, five ways


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, pad_to", [("ddp", 1), ("zero2", 1), ("fsdp", 1), ("fsdp", 4)])
async def test_an_unpadded_model_runs_at_four_ranks_and_its_full_params_feed_forward(name, pad_to):
    x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    y = np.arange(8) % 2

    async def body(group):
        model = mlp(3, (5,), 2, pad_to=pad_to)  # numels 15 + 5 + 10 = 30 and 12: 30 is no multiple of 4
        strategy = make_strategy(name, model, TrainConfig(), group)
        try:
            await strategy.setup()
            rows = slice(2 * group.rank, 2 * group.rank + 2)
            await strategy.train_step([(x[rows], y[rows], 2 * group.rank, 8)])
            return model.forward(await strategy.full_params(), x)
        finally:
            strategy.close()

    outs = await run_ranks(4, body)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
