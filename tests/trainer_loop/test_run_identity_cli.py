"""Runs and their checkpoints through `python -m trainer` and the launcher, as a user runs them.

Before, on each of these: a second run into a --checkpoint-dir mixed with the first (its pruning
deleted the new run's lower steps; --resume and trainer.sample then took the old run's), exit 0;
--resume into another architecture (--n-layer, --n-head) loaded silently; a restarted attempt
(a SLURM requeue, torchrun) started again from step 0 unless --resume was given; `--resume` into
a mistyped directory silently started a new run; trainer.sample read the highest step number
under a directory, whichever run wrote it.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.trainer_loop.test_resume_damaged import damage_piece
from trainer import checkpoint
from trainer.runid import job_identity
from trainer.sample import load_model

ROOT = Path(__file__).resolve().parents[2]
MLP = ["--data", "synthetic", "--size", "200", "--in-dim", "8", "--classes", "3", "--width", "16", "--depth", "1",
       "--batch-size", "32", "--no-eval-train", "--log-every", "0", "--blas-threads", "1"]  # 5 steps an epoch
GPT = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
       "--windows-per-epoch", "64", "--batch-size", "32", "--log-every", "0", "--blas-threads", "1"]  # 2 steps
JOB_VARS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
            "RINGWEAVE_JOB", "RINGWEAVE_RESTART")

pytestmark = pytest.mark.timeout(120)


def trainer(args, cwd, *, ranks=0, env=None, timeout=60):
    """`python -m trainer ARGS`, through the launcher when ``ranks``; (exit code, stdout + stderr)."""
    base = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    cmd = [sys.executable, "-m", "trainer", *args]
    if ranks:
        cmd = [sys.executable, "-m", "runtime.launch", "-n", str(ranks), "--max-time-s", str(timeout - 5),
               "-m", "trainer", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=dict(base, PYTHONPATH=str(ROOT), **(env or {})), capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_of(step_dir: Path) -> str:
    return json.loads((step_dir / checkpoint.METADATA).read_text())["run"]["id"]


def test_a_new_run_refuses_another_runs_directory_and_moves_it_aside_when_asked(tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out = trainer([*MLP, "--epochs", "1", "--checkpoint-dir", str(ckpt)], tmp_path, ranks=2)
    assert code == 0, out[-3000:]
    before = files(ckpt)

    code, out = trainer([*MLP, "--epochs", "1", "--keep-last", "1", "--checkpoint-dir", str(ckpt)], tmp_path, ranks=2)
    assert code == 2, out[-3000:]
    first = run_of(ckpt / "step-00000005")
    [line] = [s for s in out.splitlines() if s.startswith("[rank ") and "trainer: error:" in s]  # rank 0's alone
    assert line.startswith(f"[rank 0] trainer: error: {ckpt} holds the checkpoints of another run, run {first} "
                           f"(newest step 5, saved ")
    assert "add --resume" in line and "another --checkpoint-dir" in line and "--move-aside" in line
    assert "Traceback" not in out and "epoch 1/1" not in out  # refused before training
    assert files(ckpt) == before  # nothing of the old run touched

    code, out = trainer([*MLP, "--epochs", "1", "--keep-last", "1", "--move-aside", "--checkpoint-dir", str(ckpt)],
                        tmp_path, ranks=2)
    assert code == 0, out[-3000:]
    [aside] = ckpt.glob(f"aside-{first}-*")
    assert f"moved run {first} (newest step 5" in out and f"into {aside}" in out
    assert {f"{aside.name}/{k}": v for k, v in before.items()} == \
        {k: v for k, v in files(ckpt).items() if k.startswith(aside.name)}  # moved whole, byte for byte
    assert oct(aside.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step-00000005"]
    assert run_of(ckpt / "step-00000005") != first


def test_resume_refuses_another_architecture_and_allows_what_may_change(tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out = trainer([*GPT, "--epochs", "1", "--checkpoint-dir", str(ckpt)], tmp_path)
    assert code == 0, out[-3000:]

    changed = list(GPT)
    changed[changed.index("--n-layer") + 1], changed[changed.index("--n-head") + 1] = "1", "4"
    code, out = trainer([*changed, "--epochs", "2", "--resume", "--checkpoint-dir", str(ckpt)], tmp_path)
    assert code == 2 and "Traceback" not in out, out[-3000:]
    run = run_of(ckpt / "step-00000002")
    config = json.loads((ckpt / "step-00000002" / checkpoint.METADATA).read_text())["run"]["config"]
    assert (config["model"], config["n_layer"], config["n_head"], config["n_embd"], config["vocab_size"],
            config["optimizer"], config["data"]) == ("gpt", 2, 2, 16, 256, "adamw", "pydoc")
    assert f"trainer: error: cannot continue run {run} in {ckpt}" in out
    assert "n_layer: 2 -> 1" in out and "n_head: 2 -> 4" in out and "resumed from" not in out

    # world size, strategy, learning rate, betas, schedule, epochs, dropout and kernels may change
    code, out = trainer([*GPT, "--epochs", "2", "--resume", "--checkpoint-dir", str(ckpt), "--strategy", "zero3",
                         "--lr", "1e-3", "--betas", "0.9,0.95", "--warmup-steps", "0", "--dropout", "0.1",
                         "--kernel", "reference"],
                        tmp_path, ranks=2)
    assert code == 0, out[-3000:]
    assert f"resumed from {ckpt}/step-00000002: epoch 2, step 0 of 2 (optimizer step 2) (run {run})" in out
    assert [run_of(p) for p in checkpoint.list_checkpoints(ckpt)] == [run, run]  # it continued the same run


@pytest.mark.parametrize("job, counter", [("SLURM_JOB_ID", "SLURM_RESTART_COUNT"),
                                          ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")])
def test_a_restarted_attempt_continues_its_run_without_resume_and_a_new_job_refuses(tmp_path, job, counter):
    ckpt = tmp_path / "ckpt"
    args = [*MLP, "--checkpoint-dir", str(ckpt), "--quiet"]
    code, out = trainer([*args, "--epochs", "1"], tmp_path, env={job: "4242"})
    assert code == 0, out[-3000:]
    run = job_identity({job: "4242"}).run_id(lambda: "unused")  # derived from the job: the same in every attempt

    code, out = trainer([*args, "--epochs", "2"], tmp_path, env={job: "4242", counter: "1"})  # a requeue
    assert code == 0, out[-3000:]
    assert f"resumed from {ckpt}/step-00000005: epoch 2, step 0 of 5 (optimizer step 5) (restart 1 of the run " \
           f"{run}: {counter}=1)" in out
    assert run_of(ckpt / "step-00000005") == run_of(ckpt / "step-00000010") == run
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step-00000005", "step-00000010"]

    code, out = trainer([*args, "--epochs", "3"], tmp_path, env={job: "4243", counter: "0"})  # a brand-new job
    assert code == 2 and f"holds the checkpoints of another run, run {run} (newest step 10" in out, out[-3000:]


def test_resume_into_a_missing_directory_is_an_error_and_resume_auto_starts(tmp_path):
    code, out = trainer([*MLP, "--epochs", "1", "--quiet", "--checkpoint-dir", "typo_dir", "--resume"], tmp_path)
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert "trainer: error: no checkpoint in typo_dir; to start fresh drop --resume, or use --resume auto to " \
           "resume only when there is one" in out
    assert not (tmp_path / "typo_dir").exists()
    code, out = trainer([*MLP, "--epochs", "1", "--quiet", "--checkpoint-dir", "typo_dir", "--resume", "auto"],
                        tmp_path)
    assert code == 0 and "resumed from" not in out, out[-3000:]
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "typo_dir")] == ["step-00000005"]


def test_an_unnamed_checkpoint_resumes_when_its_model_matches_and_is_never_pruned(tmp_path):
    """A checkpoint written before checkpoints named their run (no "run" in its metadata)."""
    ckpt = tmp_path / "ckpt"
    args = [*MLP, "--quiet", "--keep-last", "1", "--checkpoint-dir", str(ckpt)]
    code, out = trainer([*args, "--epochs", "1"], tmp_path)
    assert code == 0, out[-3000:]
    meta_path = ckpt / "step-00000005" / checkpoint.METADATA
    meta = json.loads(meta_path.read_text())
    meta.pop("run", None)
    meta_path.write_text(json.dumps(meta))

    code, out = trainer([*args, "--epochs", "2", "--resume", "--width", "8"], tmp_path)
    assert code == 2 and "cannot continue the unnamed run" in out and "params: 0.0.weight [8, 16] -> [8, 8]" in out
    code, out = trainer([*args, "--epochs", "2"], tmp_path)  # a new run refuses it like any other
    assert code == 2 and "holds the checkpoints of another run, an unnamed run" in out, out[-3000:]
    code, out = trainer([*args, "--epochs", "3", "--resume"], tmp_path)
    assert code == 0, out[-3000:]
    [line] = [s for s in out.splitlines() if s.startswith("resumed from")]
    assert line.startswith(f"resumed from {ckpt}/step-00000005: epoch 2, step 0 of 5 (optimizer step 5) (run ")
    # the continued run has an id of its own; --keep-last 1 pruned its step 10, never the unnamed step 5
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step-00000005", "step-00000015"]
    assert run_of(ckpt / "step-00000015") == line.split("(run ")[1].rstrip(")")


def test_sample_reads_the_newest_valid_checkpoint_of_the_directorys_run_never_a_mix(tmp_path):
    old, new, mixed = tmp_path / "old", tmp_path / "new", tmp_path / "mixed"
    for where, extra in ((old, ["--seed", "1"]), (new, ["--checkpoint-every", "1", "--keep-last", "3"])):
        code, out = trainer([*GPT, "--epochs", "1", "--quiet", "--checkpoint-dir", str(where), *extra], tmp_path)
        assert code == 0, out[-3000:]
    # an unnamed run's checkpoint at a higher step (as a version that named no run left it) beside the new run's
    shutil.copytree(old / "step-00000002", mixed / "step-00000099")
    meta = json.loads((mixed / "step-00000099" / checkpoint.METADATA).read_text())
    meta.pop("run", None)
    (mixed / "step-00000099" / checkpoint.METADATA).write_text(json.dumps(meta))
    for name in ("step-00000001", "step-00000002"):
        shutil.copytree(new / name, mixed / name)

    def params(path):
        return np.concatenate(load_model(path)[1])

    np.testing.assert_array_equal(params(mixed), params(new / "step-00000002"))
    damage_piece(mixed / "step-00000002", 0)  # the run's newest does not read: its one before, not step 99
    np.testing.assert_array_equal(params(mixed), params(new / "step-00000001"))

    shutil.copytree(old / "step-00000002", mixed / "step-00000050")  # a second named run: which one is meant?
    proc = subprocess.run([sys.executable, "-m", "trainer.sample", "--checkpoint", str(mixed), "--tokens", "4"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "holds the checkpoints of 2 runs" in proc.stderr, proc.stderr[-2000:]
