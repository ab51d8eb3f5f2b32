"""Restarts: a rank killed mid-training, the launcher restarts the job, the trainer
resumes from its last checkpoint without being told to (no --resume: the attempt is a
restart of the same run, RINGWEAVE_RESTART=1 under the same RINGWEAVE_JOB) and ends with
the parameters of a run that never failed. Before, the restarted attempt started again
from step 0 unless --resume was given.

Both runs are the main job through the real launcher, 4 ranks, FSDP, float64
(so that nothing but the order of operations could make them differ, and that
order is the same), a checkpoint every 8 optimizer steps and at each epoch's end:

    python -m runtime.launch -n 4 [--max-restarts 1] wrapper.py CKPT_DIR --strategy fsdp ...

``wrapper.py`` runs ``trainer.cli.main``; in the first attempt
(RINGWEAVE_RESTART == "0") rank 1 SIGKILLs itself at the start of optimizer step
KILL_STEP (epoch 2 has steps 17-32: after the checkpoint of step 24, before
the end-of-epoch one). The other ranks fail with PeerLostError, the launcher restarts the
job once, and attempt 1 resumes from step 24. Both runs' final checkpoints are
exported to ``.npz`` (trainer.checkpoint.export_npz_from_checkpoint) and must be
bit-for-bit equal.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.faults.harness import REPO

KILL_STEP = 29

WRAPPER = r'''
import os, signal, sys

KILL_STEP = int(os.environ["KILL_STEP"])
ckpt, argv = sys.argv[1], sys.argv[2:]
from runtime import env
if env.RESTART.get() == 0 and os.environ.get("RANK") == "1":
    import trainer.sharding

    real_make = trainer.sharding.make_strategy

    def make_strategy(*a, **kw):                    # counts optimizer steps, dies at KILL_STEP
        strategy = real_make(*a, **kw)
        step = strategy.train_step
        done = [0]

        async def train_step(*sa, **skw):
            if done[0] == KILL_STEP:
                print(f"rank 1: killing itself at optimizer step {KILL_STEP}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            done[0] += 1
            return await step(*sa, **skw)
        strategy.train_step = train_step
        return strategy
    trainer.sharding.make_strategy = make_strategy

from trainer.cli import main
sys.exit(main(argv + ["--checkpoint-dir", ckpt]))
'''

TRAIN_ARGS = ["--strategy", "fsdp", "--data", "synthetic", "--size", "1280", "--in-dim", "16", "--classes", "4",
              "--width", "32", "--depth", "2", "--epochs", "2", "--batch-size", "64", "--master-dtype", "float64",
              "--param-dtype", "float64", "--reduce-dtype", "float64", "--adam-kernel", "numpy",
              "--checkpoint-every", "8", "--keep-last", "3", "--no-eval-train", "--log-every", "0", "--seed", "3"]


def start_job(tmp_path, name: str, max_restarts: int) -> subprocess.Popen:
    wrapper = tmp_path / "wrapper.py"  # written by the test, once for both jobs
    cmd = [sys.executable, "-m", "runtime.launch", "-n", "4", "--max-restarts", str(max_restarts),
           "--grace-s", "3", "--max-time-s", "100", str(wrapper), str(tmp_path / name), *TRAIN_ARGS]
    env = dict(os.environ, PYTHONPATH=str(REPO), KILL_STEP=str(KILL_STEP) if max_restarts else "-1")
    with open(tmp_path / f"{name}.log", "w") as log:  # a file: nobody reads a pipe while the other job runs
        return subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, tmp_path, name: str, timeout_s: float = 110) -> tuple[int, str]:
    """The job's exit code and its output, once it ended (killed past ``timeout_s``)."""
    try:
        proc.wait(timeout=timeout_s)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc.returncode, (tmp_path / f"{name}.log").read_text()


def final_params(tmp_path, name: str) -> dict[str, np.ndarray]:
    from trainer.checkpoint import export_npz_from_checkpoint, latest

    path = export_npz_from_checkpoint(latest(tmp_path / name), tmp_path / f"{name}.npz")
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.timeout(240)
def test_restarted_training_ends_with_the_uninterrupted_parameters(tmp_path):
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    # both jobs at once: neither depends on the other (their own job ids, ports and directories)
    jobs = {name: start_job(tmp_path, name, max_restarts)
            for name, max_restarts in (("restarted", 1), ("uninterrupted", 0))}
    try:
        (code, log), (clean_code, clean_log) = (finish(proc, tmp_path, name) for name, proc in jobs.items())
    finally:
        for proc in jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 0, log[-5000:]
    assert f"killing itself at optimizer step {KILL_STEP}" in log, log[-3000:]
    assert "restarting the job (1 of 1) after rank 1 failed with signal SIGKILL" in log, log[-3000:]
    # attempt 1 continued from the checkpoint, not from scratch (which would end equal too)
    assert "(optimizer step 24) (restart 1 of the run " in log and "RINGWEAVE_RESTART=1)" in log, log[-3000:]
    assert clean_code == 0, clean_log[-5000:]

    got, want = final_params(tmp_path, "restarted"), final_params(tmp_path, "uninterrupted")
    assert sorted(got) == sorted(want)
    resumed = [line for line in log.splitlines() if "resumed from" in line]
    print(f"\n== restart: rank 1 SIGKILLed at step {KILL_STEP} of attempt 0; {resumed[0].strip()}")
    worst = 0.0
    for name in sorted(want):
        diff = float(np.max(np.abs(got[name] - want[name]))) if want[name].size else 0.0
        worst = max(worst, diff)
        print(f"   {name:24s} {str(want[name].shape):12s} max |restarted - uninterrupted| = {diff:.3g}")
    print(f"   {len(want)} arrays, {sum(a.size for a in want.values())} parameters, largest difference {worst:.3g}")
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name} differs (max {worst:.3g})"
