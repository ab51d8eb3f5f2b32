"""HSDP through `python -m trainer --replicas R`: at 4 ranks as 2 replicas x 2 shard ranks, fsdp
trains the same steps as one process (float64, to 1e-12) and each rank sends the README's bytes per
step; a replica count that does not fit the world is one line and exit 2 on every rank.

The formula (README, "Parallelism"), N the units' lengths padded to a multiple of S, b bytes each:

    reduce_scatter of the gradients within the S shard ranks     (S - 1) / S  N b
    all_reduce of the gradient shard across the R replicas       2 (R - 1) / R  N / S  b
    all_gather of each unit in the forward and the backward      (S - 1) / S  (2 N - N_last) b
      (fsdp, zero3; the last call's unit stays gathered from its forward to its backward)

plus the step's [loss, overflow, norm] all_reduce, 3 float64 (at most 2 x 24 bytes in each of
the two groups). At R = 1 this is fsdp's traffic today, checked here on the strategy as it is.
"""

import inspect
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.testing import run_ranks
from trainer.cli import build_model, load_data, make_config, parse_args
from trainer.loop import fit, steps_per_epoch
from trainer.nn.unit import round_up
from trainer.sharding import make_strategy

ROOT = Path(__file__).resolve().parents[2]
MLP = ["--data", "synthetic", "--size", "320", "--in-dim", "8", "--classes", "3", "--width", "16", "--depth", "2",
       "--batch-size", "32", "--epochs", "2", "--strategy", "fsdp", "--master-dtype", "float64",
       "--param-dtype", "float64", "--reduce-dtype", "float64", "--log-every", "0", "--blas-threads", "1"]
STATS = 3 * 8  # the step's [loss, overflow, sum of squares] all_reduce, float64


def formula_bytes(args, shard: int, replicas: int) -> float:
    """Bytes one rank sends in a step of fsdp over ``shard`` ranks and ``replicas`` replicas (module
    docstring), for the model of ``args``, without the step's statistics."""
    model = build_model(args, load_data(args))
    lengths = [round_up(u.numel, shard) for u in model.units]
    n, last, b = sum(lengths), lengths[model.calls[-1].unit], 8
    reduce_scatter = (shard - 1) / shard * n * b
    all_reduce = 2 * (replicas - 1) / replicas * n / shard * b
    all_gather = (shard - 1) / shard * (2 * n - last) * b
    return reduce_scatter + all_reduce + all_gather


def takes_replicate() -> bool:
    """Whether make_strategy's sharded strategies take ``replicate=`` (the HSDP groups)."""
    from trainer.sharding.fsdp import FSDPStrategy

    inits = [make_strategy] + [vars(c)["__init__"] for c in FSDPStrategy.__mro__ if "__init__" in vars(c)]
    return any("replicate" in inspect.signature(f).parameters for f in inits)


def trainer(argv, cwd, ranks: int = 0, timeout: int = 150):
    """`python -m trainer ARGV` (through the launcher when ``ranks``): (exit code, output, history)."""
    out = Path(cwd) / f"history-{ranks}.json"
    cmd = [sys.executable, "-m", "trainer", *argv, "--json", str(out)]
    if ranks:
        cmd[1:3] = ["-m", "runtime.launch", "-n", str(ranks), "--max-time-s", str(timeout - 10), "-m", "trainer"]
    proc = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=timeout)
    history = json.loads(out.read_text())["history"] if out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, history


@pytest.mark.timeout(60)
async def test_the_formula_at_one_replica_is_what_fsdp_sends_today():
    args = parse_args(MLP)
    data = load_data(args)
    config = make_config(args, steps_per_epoch(len(data.train), args.batch_size, args.grad_accum))

    async def body(world):
        strategy = make_strategy("fsdp", build_model(args, data), config, world)
        try:
            await strategy.setup()
            history = await fit(strategy, data, config, epochs=1, global_batch_size=args.batch_size, group=world,
                                progress_stream=io.StringIO(), summary_stream=io.StringIO())
            return [r.comm_bytes / r.steps for r in history.ranks]
        finally:
            strategy.close()

    per_step = (await run_ranks(2, body))[0]
    assert per_step == [formula_bytes(args, 2, 1) + STATS] * 2  # the all_reduce of 24 bytes at 2 ranks: 24


@pytest.mark.timeout(60)
def test_a_replica_count_that_does_not_divide_dp_is_one_line_and_exit_2(tmp_path):
    code, out, _ = trainer([*MLP, "--replicas", "3"], tmp_path, ranks=2, timeout=50)
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert "[rank 0] trainer: error: dp=2 ranks do not split into replicate=3 replicas" in out, out[-3000:]
    assert "[rank 1] trainer: error" not in out and "epoch 1/2" not in out


@pytest.mark.timeout(240)
def test_hsdp_at_2x2_equals_one_process_and_sends_the_formula(tmp_path):
    if not takes_replicate():
        pytest.skip("needs make_strategy(replicate=)")
    code, out, one = trainer(MLP, tmp_path)
    assert code == 0, out[-3000:]
    code, out, hsdp = trainer([*MLP, "--replicas", "2"], tmp_path, ranks=4, timeout=200)
    assert code == 0, out[-3000:]
    assert "fsdp on 4 rank(s) (HSDP: 2 replicas x 2 shard ranks)" in out
    assert len(hsdp["epochs"]) == len(one["epochs"]) == 2
    for got, want in zip(hsdp["epochs"], one["epochs"]):
        for key in ("train_loss", "train_eval_loss", "val_loss", "val_acc"):
            assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), key
    formula = formula_bytes(parse_args(MLP), 2, 2)
    for rank in hsdp["ranks"]:
        per_step = rank["comm_bytes"] / rank["steps"]
        assert formula <= per_step <= formula + 2 * 2 * STATS, (rank["rank"], per_step, formula)
