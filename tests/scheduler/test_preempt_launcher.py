"""Preemption under our launcher: SIGTERM that reaches ONE rank mid-training makes every rank
checkpoint at the same step and exit 143 (128 + SIGTERM); --resume then ends exactly where a run that
was never stopped ends (losses and every parameter and optimizer array, bit for bit)."""

import os
import signal
import subprocess

import pytest

from tests.scheduler.jobs import PREEMPT_ENV, PYTHON, ROOT, TRAIN_ARGS, assert_same_run, load_run, \
    run_until_signalled, text_of

pytestmark = pytest.mark.timeout(240)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_signal_to_one_rank_checkpoints_all_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path,
                                                                                             reference_run):
    reference = reference_run(2)
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    cmd = [PYTHON, "-m", "runtime.launch", "-n", "2", "-m", "trainer", *TRAIN_ARGS, "--checkpoint-dir", str(ckpt)]
    def one_rank(job):  # only one: the others learn it at the step boundary
        ranks = _children(job.pid)
        assert len(ranks) == 2
        os.kill(ranks[-1], signal.SIGTERM)

    env = dict(os.environ, **PREEMPT_ENV)
    stopped_at = run_until_signalled(cmd + ["--json", str(tmp_path / "stopped.json")], log, one_rank,
                                     128 + signal.SIGTERM, cwd=ROOT, env=env)
    assert "stopped by SIGTERM" in text_of(log)
    resumed = subprocess.run(cmd + ["--resume", "--json", str(tmp_path / "resumed.json")], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"optimizer step {int(stopped_at[-1].split('-')[1])})" in resumed.stderr
    assert_same_run(reference, load_run(tmp_path / "resumed.json", ckpt))
