"""The checkpoint fallback of an elastic job, through the real launcher and ``python -m trainer``: a
tensor-parallel job (tp 2, no replica of a rank's slice) whose rank 1 is SIGKILLed mid-run says in
one line what was lost, from which checkpoint it restarts and how many steps repeat, and the launcher
restarts the attempt, which resumes there and ends equal to an undisturbed fixed job (float64); the
trainer's refusal of --tp under --elastic without --checkpoint-dir; the pure parts (which exits
restart, which losses fall back, who speaks)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.errors import PeerLostError
from runtime.launch_elastic import FALLBACK_EXIT, MAX_FALLBACKS, fatal, preempted_codes, restarts_allowed
from runtime.launch_outcome import Ending, Outcome, RankExit
from trainer.checkpoint import read_full_params
from trainer.checkpoint_fallback import line, lost_without_copy, speaks
from trainer.sharding.base import ShardLostError, StepAbortedError

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90
TRAIN = ["-m", "trainer", "--tp", "2", "--data", "synthetic", "--size", "600", "--width", "16", "--epochs", "2",
         "--batch-size", "12", "--no-eval-train", "--master-dtype", "float64", "--param-dtype", "float64",
         "--reduce-dtype", "float64", "--checkpoint-every", "4", "--keep-last", "1000", "--quiet"]
FINAL = "step-00000080"  # 480 training rows / 12 = 40 steps per epoch

pytestmark = pytest.mark.timeout(3 * TIMEOUT_S)


def environ() -> dict:
    e = {**os.environ, "PYTHONPATH": str(REPO)}
    e.pop("RINGWEAVE_SECRET", None)
    return e


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's child that is ``rank`` (its environment says RANK=rank)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == launcher:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"RANK={rank}".encode() in f.read().split(b"\0"):
                        return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    return None


def final_state(d: Path) -> tuple[list, dict]:
    """Each epoch's training loss and the final checkpoint's parameters by name (any world size's files)."""
    history = json.loads((d / "run.json").read_text())["history"]
    arrays = read_full_params(d / "ckpt" / FINAL)
    assert arrays, f"no parameters in {d}"
    return [e["train_loss"] for e in history["epochs"]], arrays


def signal_mid_run(tmp_path: Path, elastic: str, n: int, trainer_args: list, rank: int, sig: int) -> tuple[Path, str]:
    """``python -m runtime.launch --elastic ELASTIC -n N -m trainer ...`` checkpointing to tmp_path/el;
    sends ``sig`` to ``rank`` once the step-8 checkpoint is there, asserts the job exits 0; returns
    (tmp_path/el, the job's output)."""
    el, log = tmp_path / "el", tmp_path / "el.log"
    cmd = [sys.executable, "-m", "runtime.launch", "--elastic", elastic, "-n", str(n), "--timeout-s", "30",
           "--grace-s", "2", "-m", "trainer", *trainer_args, "--checkpoint-dir", str(el / "ckpt"), "--json",
           str(el / "run.json")]
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, cwd=REPO, env=environ(), stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (el / "ckpt" / "step-00000008").exists():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        victim = rank_pid(job.pid, rank)
        assert victim is not None, log.read_text()[-3000:]
        os.kill(victim, sig)
        assert job.wait(timeout=TIMEOUT_S) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return el, log.read_text()


def test_a_tp_job_that_loses_a_rank_restarts_from_its_checkpoint_and_equals_the_undisturbed_run(tmp_path):
    ref = tmp_path / "ref"
    el, text = signal_mid_run(tmp_path, "1:2", 2, TRAIN[2:], 1, signal.SIGKILL)
    said = [ln for ln in text.splitlines()
            if ln.startswith("[rank") and "lost (PeerLostError), and tp 2 x pp 1 keeps no copy" in ln]
    assert len(said) == 1, text[-4000:]
    assert "trainer: rank 1 lost" in said[0] and "every member restarts from checkpoint step-" in said[0], said
    assert "optimizer step(s) run again" in said[0] and "restarting the job (1 of 3)" in text, text[-3000:]
    p = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "2", *TRAIN, "--checkpoint-dir",
                        str(ref / "ckpt"), "--json", str(ref / "run.json")], cwd=REPO, env=environ(),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    (el_losses, el_arrays), (ref_losses, ref_arrays) = final_state(el), final_state(ref)
    np.testing.assert_allclose(el_losses, ref_losses, rtol=1e-12)
    assert el_arrays.keys() == ref_arrays.keys()
    for name, a in el_arrays.items():
        np.testing.assert_allclose(a, ref_arrays[name], rtol=1e-12, atol=1e-14, err_msg=name)


def test_tp_under_elastic_without_a_checkpoint_dir_is_refused_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "runtime.launch", "--elastic", "1:2", "-n", "2", *TRAIN], cwd=REPO,
                       env=environ(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 2, p.stderr[-3000:]
    refusals = [ln for ln in p.stderr.splitlines() if "trainer: error: --elastic runs" in ln]
    assert len(refusals) == 1 and "only with --checkpoint-dir" in refusals[0], p.stderr[-3000:]


def test_which_exits_restart_the_attempt_and_which_fail_it():
    env = {"RINGWEAVE_PREEMPT_SIGNALS": "TERM,USR1"}
    assert preempted_codes(env) == {143, 138}
    assert preempted_codes({**env, "RINGWEAVE_PREEMPT_EXIT_CODE": "99"}) == {99}
    assert fatal(FALLBACK_EXIT, False, False, 3, 2, 0, {143}).startswith("its state has no copy left")
    assert fatal(143, False, False, 3, 2, 0, {143}) == "the job was preempted"
    assert fatal(-9, False, False, 3, 2, 0, {143}) is None  # a shrink; a joiner takes the slot
    assert fatal(-9, False, False, 1, 2, 0, {143}) == "below"
    assert fatal(1, True, False, 3, 2, 0, {143}) == "it cannot be replaced"
    # only joiners left (every process of the latest generation gone): nobody can let them in
    assert fatal(1, False, False, 2, 1, 0, {143}, holders=False).startswith("no member of the job's latest generation")
    fell_back = Outcome(Ending.FAILED, failure=RankExit(0, FALLBACK_EXIT, 0.0, None))
    assert restarts_allowed(fell_back) == MAX_FALLBACKS
    assert restarts_allowed(Outcome(Ending.FAILED, failure=RankExit(0, -9, 0.0, None))) == 0
    assert restarts_allowed(Outcome(Ending.SUCCEEDED)) == 0


def test_which_losses_fall_back_to_the_checkpoint_and_who_says_so(tmp_path):
    lost = PeerLostError("rank 1 is gone", rank=1)
    assert lost_without_copy(lost, layout=None) is None  # data parallel: a re-shard, not a restart
    assert lost_without_copy(lost, layout="tp 2 x pp 1") == [1]
    aborted = StepAbortedError("discarded", 3)
    aborted.__cause__ = lost
    assert lost_without_copy(aborted, layout="tp 2 x pp 1") == [1]
    assert lost_without_copy(ExceptionGroup("g", [ValueError("x"), lost]), layout="tp 1 x pp 2") == [1]
    assert lost_without_copy(ShardLostError("both gone", [1, 2]), layout=None) == [1, 2]
    assert lost_without_copy(ValueError("own bug"), layout="tp 2 x pp 1") is None
    assert speaks(0, [1]) and not speaks(2, [1]) and speaks(1, [0]) and speaks(2, [0, 1])
    text = line([1], lost, "tp 2 x pp 1", str(tmp_path), 7)
    assert "every member restarts from the start (no checkpoint in" in text and "7 optimizer step(s) run again" in text


DP = ["--strategy", "ddp", *TRAIN[4:]]  # the same run, data parallel (after -m trainer)


def test_the_trainer_leaves_on_sigterm_and_its_checkpoints_load_at_another_size(tmp_path):
    """python -m trainer --elastic 2:3 with --checkpoint-dir: rank 2 gets SIGTERM mid-run, leaves
    (exit 0, no joiner), the two others checkpoint on; one process resumes from one of their
    checkpoints; both end equal to an undisturbed one-process run."""
    ref, again = tmp_path / "ref", tmp_path / "again"
    el, text = signal_mid_run(tmp_path, "2:3", 3, DP, 2, signal.SIGTERM)
    assert "[launch] rank 2 left the job (left the elastic job on SIGTERM" in text, text[-3000:]
    assert "trainer: rank 2: left the elastic job on SIGTERM" in text and "joiner" not in text, text[-3000:]
    by_two = [p for p in sorted((el / "ckpt").glob("step-*"))
              if json.loads((p / "metadata.json").read_text())["world_size"] == 2 and p.name < FINAL]
    assert by_two and (el / "ckpt" / FINAL).is_dir(), text[-3000:]
    one = [sys.executable, "-m", "trainer", *DP]  # one process: no launcher
    p = subprocess.run([*one, "--checkpoint-dir", str(ref / "ckpt"), "--json", str(ref / "run.json")], cwd=REPO,
                       env=environ(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    (again / "ckpt").mkdir(parents=True, mode=0o700)
    shutil.copytree(by_two[0], again / "ckpt" / by_two[0].name)
    p = subprocess.run([*one, "--checkpoint-dir", str(again / "ckpt"), "--resume", "--json", str(again / "run.json")],
                       cwd=REPO, env=environ(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0 and "resumed from" in p.stderr, p.stderr[-3000:]
    _, ref_arrays = final_state(ref)
    for d in (el, again):
        _, arrays = final_state(d)
        assert arrays.keys() == ref_arrays.keys()
        for name, a in arrays.items():
            np.testing.assert_allclose(a, ref_arrays[name], rtol=1e-12, atol=1e-14, err_msg=f"{d.name}: {name}")


def test_a_rank_lost_with_the_holder_of_its_copy_continues_from_the_checkpoint(tmp_path):
    """fsdp on 3 ranks, ranks 1 and 2 SIGKILLed in the same step: rank 2's shard and its copy (on
    rank 1) are both gone, so the re-shard raises ShardLostError on every member, and the members
    load the run's newest checkpoint in memory (trainer/elastic.py), saying so, with no restart; the
    run ends equal to an undisturbed one-process run (float64, 1e-12)."""
    job = REPO / "tests" / "elastic" / "leave_job.py"
    el, ref = tmp_path / "el", tmp_path / "ref"
    el.mkdir()
    ref.mkdir()
    kill = {"EL_STRATEGY": "fsdp", "EL_KILL_RANKS": "1,2", "EL_AT_STEP": "5", "EL_CHECKPOINT": "1",
            "EL_SETTLE_S": "2"}
    p = subprocess.run([sys.executable, "-m", "runtime.launch", "--elastic", "1:3", "-n", "3", "--timeout-s", "30",
                        "--grace-s", "2", str(job), str(el)], cwd=REPO, env={**environ(), **kill},
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    said = [ln for ln in log.splitlines() if ln.startswith("[rank") and "a shard had no copy left in memory" in ln]
    assert len(said) == 1 and "continuing from" in said[0] and "step-00000004" in said[0], log[-4000:]
    assert "restarting the job" not in log, log[-3000:]
    q = subprocess.run([sys.executable, str(job), str(ref)], cwd=REPO, env={**environ(), "EL_STRATEGY": "fsdp"},
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert q.returncode == 0, q.stderr[-3000:]
    np.testing.assert_allclose(np.load(el / "params.npy"), np.load(ref / "params.npy"), rtol=1e-12, atol=1e-14)
