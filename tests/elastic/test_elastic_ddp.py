"""Elastic jobs through the real launcher (ddp): a rank SIGKILLed between two steps is a shrink, its
slot comes back as a joiner (the state sent live), and the final parameters equal an undisturbed
run's (float64, 1e-12); below MIN, and without --elastic, the same kill fails the job.

The sharded strategies' kill, shrink and rejoin (their shards sent live) are test_elastic_faults.py's:
zero2 grows back after a kill mid save in the checkpoint case, fsdp after a kill mid the statistics'
all_reduce and one before connecting in the recovery (the wire case), zero1, zero2 and zero3 shrink
at kills inside their collectives; each ends equal to the same undisturbed run."""

import subprocess
import sys

import numpy as np
import pytest

from el_launch import REPO, environ, launch, undisturbed

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> np.ndarray:
    """One process: the same global batches, so the training every strategy and world size must equal."""
    return undisturbed(tmp_path_factory.mktemp("undisturbed"))


def test_killed_rank_shrinks_then_rejoins_and_equals_the_undisturbed_run(tmp_path, reference):
    # the members wait (at most EL_HOLD_S) at a step boundary for the joiner: grown back before the
    # end whatever the load, with no sleep in every step
    kill = {"EL_KILL_RANK": "1", "EL_KILL_STEP": "4", "EL_HOLD_S": "30", "EL_STRATEGY": "ddp"}
    code, log, out = launch(tmp_path, "el", "--elastic", "2:3", env=kill)
    assert code == 0, log[-4000:]
    assert (out / "fault-1").exists(), log[-3000:]
    assert "starting a joiner in its place" in log, log[-3000:]
    # two survivors and the joiner finish together, in a generation of 3 (shrunk, then grown back)
    done = [line for line in log.splitlines() if "member done:" in line]
    assert len(done) == 3 and all("of 3" in line for line in done), log[-3000:]
    assert "generation 0" not in " ".join(done)
    reforms = [line for line in log.splitlines() if "re-formed" in line]
    # each survivor re-formed at least once (shrink, then grow: or both at once if the joiner came early)
    assert len(reforms) >= 2, log[-3000:]
    # a step that raised changed no state: every survivor equals new rank 0 already
    checks = [line for line in log.splitlines() if "reshard: parameters equal" in line]
    assert len(checks) >= 2 and all(line.endswith("True") for line in checks), log[-3000:]
    np.testing.assert_allclose(np.load(out / "params.npy"), reference, rtol=1e-12, atol=1e-14)
    for line in log.splitlines():
        if "first step after the loss" in line:
            print(line)


def test_fewer_than_min_fails_naming_the_rank(tmp_path):
    kill = {"EL_KILL_RANK": "2", "EL_KILL_STEP": "3"}
    code, log, _ = launch(tmp_path, "min", "--elastic", "3:3", env=kill)
    assert code == 137, log[-3000:]
    assert "rank 2 exited with signal SIGKILL" in log and "fewer than the minimum 3 of --elastic 3:3" in log, \
        log[-3000:]


def test_without_elastic_the_kill_fails_the_job(tmp_path):
    kill = {"EL_KILL_RANK": "1", "EL_KILL_STEP": "3"}
    code, log, out = launch(tmp_path, "fixed", env=kill)
    assert code == 137, log[-3000:]
    assert "joiner" not in log and not (out / "params.npy").exists()


def test_the_trainer_refuses_a_layout_it_cannot_keep_elastic_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "runtime.launch", "--elastic", "1:2", "-n", "2", "-m", "trainer",
                        "--data", "synthetic", "--compression", "int8"], cwd=REPO, env=environ(), capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert p.returncode == 2, p.stderr[-3000:]
    refusals = [line for line in p.stderr.splitlines() if "trainer: error: --elastic runs ddp" in line]
    assert len(refusals) == 1 and "--compression" in refusals[0], p.stderr[-3000:]
    assert "joiner" not in p.stderr
