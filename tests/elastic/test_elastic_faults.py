"""Faults at chosen points of an elastic job of 4 ranks under the real launcher (elastic_job.py, whose
fault_points.py hook kills or stops the first process of a slot there): each ends in the right state,
the job shrunk, grown back and equal to the undisturbed run (float64, 1e-12) with no survivor
restarted, or in a clear error when a shard has no copy left."""

from __future__ import annotations

import re

import numpy as np
import pytest

from el_launch import launch

pytestmark = pytest.mark.timeout(120)
HOLD = {"EL_HOLD_S": "30"}  # the members wait for the joiners: every job grows back before it ends


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> np.ndarray:
    """The undisturbed run (ddp at 4 ranks): every strategy and world size trains the same global batches."""
    code, log, out = launch(tmp_path_factory.mktemp("ref"), "ref", n=4)
    assert code == 0, log[-3000:]
    return np.load(out / "params.npy")


def members_done(log: str) -> dict[str, str]:
    """member id -> 'generation g, rank r of n', one per process that finished."""
    return dict(re.findall(r"member done: (\S+), (generation \d+, rank \d+ of \d+)", log))


def assert_shrunk_and_grown_back(log: str, out, killed: list[int], n: int = 4) -> None:
    """The killed slots failed and came back as joiners once each; every other slot's first process
    (a survivor: never restarted) and the joiners finished together, in a generation of n."""
    for slot in killed:
        assert (out / f"fault-{slot}").exists(), (slot, log[-3000:])
    assert log.count("starting a joiner in its place") == len(killed), log[-4000:]
    done = members_done(log)
    first = {m for m in done if re.search(r"/a0$", m)}
    joiners = {m for m in done if "/j" in m}
    assert {int(re.search(r"/r(\d+)/", m).group(1)) for m in first} == set(range(n)) - set(killed), log[-4000:]
    assert {int(re.search(r"/r(\d+)/", m).group(1)) for m in joiners} == set(killed), log[-4000:]
    assert all(where.endswith(f"of {n}") for where in done.values()), done


@pytest.mark.parametrize("strategy,faults,bounds", [
    ("ddp", "0:all_reduce@3", "3:4"),  # rank 0 mid the gradients' all_reduce
    ("zero1", "2:update@3,0:vote@8", "3:4"),  # after the commit (the step counts), then mid the vote
    ("zero2", "1:reduce_scatter@3,3:reshard@0", "2:4"),  # mid reduce_scatter, then a kill during the recovery
    ("zero3", "1:all_gather@4,2:stats@9", "3:4"),  # mid the forward's all_gather; mid the statistics' sum
    ("fsdp", "1:reduce_scatter@4,3:reduce_scatter@4", "2:4"),  # two at once, not each other's holder
])
def test_a_fault_shrinks_then_the_job_grows_back_equal_to_the_undisturbed_run(tmp_path, undisturbed, strategy,
                                                                              faults, bounds):
    env = {"EL_STRATEGY": strategy, "EL_FAULTS": faults, **HOLD}
    code, log, out = launch(tmp_path, "el", "--elastic", bounds, n=4, env=env)
    assert code == 0, log[-4000:]
    assert_shrunk_and_grown_back(log, out, [int(f.split(":")[0]) for f in faults.split(",")])
    np.testing.assert_allclose(np.load(out / "params.npy"), undisturbed, rtol=1e-12, atol=1e-14)


def test_a_rank_stopped_past_the_timeout_is_left_out_then_replaced(tmp_path, undisturbed):
    """SIGSTOP for longer than the collectives' timeout: the others time out, re-form without it;
    woken, it finds itself excluded and exits; its slot's joiner grows the job back."""
    env = {"EL_STRATEGY": "fsdp", "EL_FAULTS": "2:stop@4", **HOLD}
    code, log, out = launch(tmp_path, "stop", "--elastic", "3:4", n=4, env=env, timeout_s=2, wake=(2, 6.0))
    assert code == 0, log[-4000:]
    assert "ExcludedError" in log, log[-4000:]
    assert_shrunk_and_grown_back(log, out, [2])
    np.testing.assert_allclose(np.load(out / "params.npy"), undisturbed, rtol=1e-12, atol=1e-14)


def test_a_kill_mid_checkpoint_save_shrinks_and_the_saves_go_on(tmp_path, undisturbed):
    env = {"EL_STRATEGY": "zero2", "EL_FAULTS": "1:save@5", "EL_CKPT": "1", **HOLD}
    code, log, out = launch(tmp_path, "save", "--elastic", "3:4", n=4, env=env)
    assert code == 0, log[-4000:]
    assert_shrunk_and_grown_back(log, out, [1])
    np.testing.assert_allclose(np.load(out / "params.npy"), undisturbed, rtol=1e-12, atol=1e-14)
    saved = sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step-"))
    assert saved and saved[-1] == "step-00000020", saved


def test_two_ranks_holding_each_others_shard_lost_at_once_stop_the_job_saying_so(tmp_path):
    """Ranks 1 and 2 die together: rank 2's shard and its copy (held by rank 1) are gone, and there is
    no checkpoint. Every survivor raises ShardLostError naming the checkpoint, and the launcher fails
    the job at once with the survivor's code instead of starting joiners into a job that cannot go on."""
    env = {"EL_STRATEGY": "zero2", "EL_FAULTS": "1:reduce_scatter@4,2:reduce_scatter@4"}
    code, log, _ = launch(tmp_path, "buddies", "--elastic", "2:4", n=4, env=env, deadline_s=45)
    assert code == 1, log[-4000:]
    assert re.search(r"ShardLostError: zero2: the shards of rank\(s\) \[2\] .* newest checkpoint on disk", log), \
        log[-4000:]
    assert "member done" not in log


def test_with_a_checkpoint_the_survivors_of_a_shard_with_no_copy_go_on_from_it(tmp_path, undisturbed):
    """The same loss with a checkpoint every 2 steps: the survivors load the newest one (step 6) onto
    the shrunk job, run step 6 again, grow back, and end equal to the undisturbed run."""
    env = {"EL_STRATEGY": "zero2", "EL_FAULTS": "1:reduce_scatter@7,2:reduce_scatter@7", "EL_CKPT": "2", **HOLD}
    code, log, out = launch(tmp_path, "fallback", "--elastic", "2:4", n=4, env=env)
    assert code == 0, log[-4000:]
    assert "a shard had no copy left in memory: continuing from" in log and "step-00000006" in log, log[-4000:]
    assert_shrunk_and_grown_back(log, out, [1, 2])
    np.testing.assert_allclose(np.load(out / "params.npy"), undisturbed, rtol=1e-12, atol=1e-14)


def test_a_member_lost_after_the_decision_before_it_connects_is_left_out_at_the_timeout(tmp_path, undisturbed):
    """Rank 1 dies between two steps; rank 3 dies once the next generation (with it) is decided,
    before it connects: the others wait for its address until the timeout, then decide the
    generation after without it."""
    env = {"EL_STRATEGY": "fsdp", "EL_FAULTS": "1:read@3,3:wire@0", **HOLD}
    code, log, out = launch(tmp_path, "wire", "--elastic", "2:4", n=4, env=env, timeout_s=4)
    assert code == 0, log[-4000:]
    assert "never connected; deciding the next without them" in log, log[-4000:]
    assert_shrunk_and_grown_back(log, out, [1, 3])
    np.testing.assert_allclose(np.load(out / "params.npy"), undisturbed, rtol=1e-12, atol=1e-14)
