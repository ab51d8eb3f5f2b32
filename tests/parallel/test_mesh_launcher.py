"""The mesh as users run it, through the real launcher: `python -m trainer --model gpt --tp 2 --pp 2
--micro-batches 4 --schedule 1f1b` with a checkpoint, its run summary (coordinates, bytes per
dimension, the bubble beside its formula), the checkpoint resumed on 2 ranks without a mesh; and a
rank killed with SIGKILL in the middle of a step, which every survivor reports as PeerLostError
naming it within seconds; the MLP under `--tp 2` and `--pp 2`, equal to one process (float64, to
1e-12). The mesh's flags are checked here too."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mesh_cases import MLP, assert_same_history, run_trainer
from runtime.testing import run_ranks

from tests.faults.harness import assert_no_process_left, launch
from trainer import checkpoint
from trainer.cli import make_config, parse_args

ROOT = Path(__file__).resolve().parents[2]
GPT = ["--model", "gpt", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
       "--windows-per-epoch", "128", "--batch-size", "16", "--log-every", "0"]


def test_the_mesh_flags_and_what_they_refuse(capsys):
    args = parse_args(["--model", "gpt", "--tp", "2", "--pp", "2", "--micro-batches", "8", "--schedule", "gpipe",
                       "--stage-layers", "3,1", "--offload", "optimizer", "--offload-dir", "/x"])
    assert (args.tp, args.pp, args.dp, args.micro_batches, args.schedule, args.stage_layers) == \
        (2, 2, None, 8, "gpipe", (3, 1))
    config = make_config(args, 10)
    assert (config.offload, config.offload_dir) == ("optimizer", "/x")
    for bad, message in [(["--pp", "4"], "choose --pp <= 3"),
                         (["--model", "gpt", "--pp", "2", "--stage-layers", "1,1,2"], "names 3 stages; --pp is 2"),
                         (["--model", "gpt", "--grad-accum", "2", "--micro-batches", "3"], "multiple of --grad-accum"),
                         (["--model", "gpt", "--offload", "params"], "set --param-dtype bfloat16"),
                         (["--model", "gpt", "--stage-layers", "2,0"], "at least one block")]:
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert message in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_tp2_pp2_through_the_launcher_then_resumed_on_two_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ckpt = tmp_path / "ckpt"
    train = [sys.executable, "-m", "runtime.launch", "-n", "4", "-m", "trainer", *GPT, "--tp", "2", "--pp", "2",
             "--micro-batches", "4", "--schedule", "1f1b", "--strategy", "zero1", "--epochs", "1",
             "--checkpoint-dir", str(ckpt)]
    proc = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "as dp 1 x tp 2 x pp 2 (1f1b, 4 micro-batches per step)" in proc.stderr
    rows = re.findall(r"^\[rank 0\]\s+(\d) +(\d) +(\d) +(\d) +(\S+ \S+) +(\S+ \S+) +(\S+ \S+) +(\d+) +([\d.]+) / "
                      r"([\d.]+)$", proc.stdout, re.M)
    assert [tuple(map(int, r[:4])) for r in rows] == [(0, 0, 0, 0), (1, 0, 0, 1), (2, 1, 0, 0), (3, 1, 0, 1)]
    for rank, pp, dp, tp, sent_dp, sent_tp, sent_pp, in_flight, bubble, formula in rows:
        assert sent_dp == "0 B" and sent_tp != "0 B" and sent_pp != "0 B"  # dp = 1: nothing on dp
        assert int(in_flight) == (2 if pp == "0" else 1)  # 1F1B: pp - stage micro-batches
        assert float(formula) == pytest.approx(1 / 5, abs=1e-3) and 0 <= float(bubble) < 1
    assert checkpoint.read_metadata(ckpt)["mesh"] == {"pp": 2, "dp": 1, "tp": 2}
    resume = [sys.executable, "-m", "runtime.launch", "-n", "2", "-m", "trainer", *GPT, "--strategy", "zero3",
              "--epochs", "2", "--checkpoint-dir", str(ckpt), "--resume"]
    proc = subprocess.run(resume, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "epoch 2/2" in proc.stderr


@pytest.mark.timeout(240)
def test_the_mlp_on_tp2_and_on_pp2_through_the_launcher_equals_one_process(tmp_path):
    code, out, one = run_trainer(MLP, tmp_path)
    assert code == 0, out[-3000:]
    for flags in (["--tp", "2"], ["--pp", "2", "--schedule", "gpipe", "--micro-batches", "2"]):
        code, out, got = run_trainer([*MLP, *flags], tmp_path, ranks=2, timeout=100)
        assert code == 0, out[-3000:]
        assert "fsdp on 2 rank(s) as dp 1 x tp %s x pp %s" % ((2, 1) if flags[0] == "--tp" else (1, 2)) in out, out
        assert len(one["epochs"]) == 2
        assert_same_history(got, one)


VICTIM, BOUND_S = 3, 5.0
TP2_PP2_STEP = r'''
from trainer.data import iter_local_batches
from trainer.nn import GPTConfig
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.parallel import tp_group
from trainer.sharding import TrainConfig
from trainer.text import RandomWindows

step_now = [0]
if RANK == 3:  # the last stage's tp rank 1 dies inside a tensor-parallel all-reduce of step 2
    real = tp_group.TPGroup.all_reduce
    def all_reduce(self, x, op="sum"):
        if step_now[0] == 2:
            print("rank 3: dying in a tp all-reduce of step 2", flush=True)
            die()
        return real(self, x, op)
    tp_group.TPGroup.all_reduce = all_reduce

async def body(rt):
    mesh = Mesh(rt.world, tp=2, pp=2)
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    s = make_parallel_strategy("fsdp", config, TrainConfig(adam_kernel="numpy"), mesh,
                               parallel=ParallelConfig(micro_batches=4))
    await s.setup()
    data = RandomWindows(np.random.default_rng(0).integers(0, 11, 500), 8, num_windows=64)
    try:
        for step, b in enumerate(iter_local_batches(len(data), 8, 1, 0)):
            step_now[0] = step
            await s.train_step([(*data.get(b.indices), b.offset, b.global_size)])
    finally:
        s.close()
    raise SystemExit(f"rank {RANK}: training finished without rank 3")

run(body)
'''


@pytest.mark.timeout(90)
def test_a_rank_killed_in_a_tp2_pp2_step_fails_every_rank_naming_it(tmp_path):
    result = launch(tmp_path, TP2_PP2_STEP, timeout_s=75)
    result.show(f"SIGKILL of rank {VICTIM} in a tp all-reduce of a tp2 x pp2 step")
    assert result.returncode == 128 + 9, result.explain()
    assert f"rank {VICTIM} failed first: signal SIGKILL" in result.stderr, result.explain()
    assert sorted(result.reports) == [0, 1, 2], result.explain()  # its tp peer, its stage-0 peer, and rank 0
    for r, rep in result.reports.items():
        assert rep.error == "PeerLostError" and f"rank {VICTIM}" in rep.message, (r, rep, result.explain())
        assert not math.isnan(rep.after_s) and rep.after_s < BOUND_S, (r, rep)
    assert_no_process_left(result)


def readme_mesh_example() -> str:
    """The python block of the README's parallelism section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Parallelism: tensor, pipeline, a mesh, HSDP, offload"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(120)
async def test_the_readme_mesh_example_trains_as_written(capsys):
    namespace = {"__name__": "readme_mesh"}  # define, do not run main
    exec(compile(readme_mesh_example(), "README.md", "exec"), namespace)
    histories = await run_ranks(4, namespace["train"])
    for h in histories:
        assert h.epochs[0].val_loss == histories[0].epochs[0].val_loss  # agreed by every rank
        assert h.epochs[0].val_loss < math.log(256)  # better than a uniform guess over the bytes
    out = capsys.readouterr().out
    assert "zero1 on 4 rank(s)" in out and "bubble measured" in out
