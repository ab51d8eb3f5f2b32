"""Preemption under our launcher: SIGTERM that reaches ONE rank mid-training makes every rank
checkpoint at the same step and exit 143 (128 + SIGTERM); --resume then ends exactly where a run that
was never stopped ends (losses and every parameter and optimizer array, bit for bit)."""

import os
import signal
import subprocess

import pytest

from tests.scheduler.jobs import FINAL_STEP, PYTHON, ROOT, SIGNAL_AFTER, TRAIN_ARGS, assert_same_run, load_run, \
    text_of, wait_for

pytestmark = pytest.mark.timeout(240)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_signal_to_one_rank_checkpoints_all_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path,
                                                                                             reference_run):
    reference = reference_run(2)
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    cmd = [PYTHON, "-m", "runtime.launch", "-n", "2", "-m", "trainer", *TRAIN_ARGS, "--checkpoint-dir", str(ckpt)]
    with open(log, "w") as out:
        job = subprocess.Popen(cmd + ["--json", str(tmp_path / "stopped.json")], cwd=ROOT, stdout=out,
                               stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: SIGNAL_AFTER in text_of(log), 120, "training to start")
            ranks = _children(job.pid)
            assert len(ranks) == 2
            os.kill(ranks[-1], signal.SIGTERM)  # one rank only: the others learn it at the step boundary
            assert job.wait(timeout=120) == 128 + signal.SIGTERM, text_of(log)[-3000:]
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    stopped_at = sorted(p.name for p in ckpt.glob("step-*"))
    assert stopped_at and stopped_at[-1] < FINAL_STEP, f"not stopped mid-training: {stopped_at}"
    assert "stopped by SIGTERM" in text_of(log)
    resumed = subprocess.run(cmd + ["--resume", "--json", str(tmp_path / "resumed.json")], cwd=ROOT,
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"optimizer step {int(stopped_at[-1].split('-')[1])})" in resumed.stderr
    assert_same_run(reference, load_run(tmp_path / "resumed.json", ckpt))
