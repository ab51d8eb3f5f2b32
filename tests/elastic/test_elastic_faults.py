"""Faults at chosen points of an elastic job of 4 ranks under the real launcher (elastic_job.py, whose
fault_points.py hook kills or stops the first process of a slot there): each ends in the right state,
the job shrunk (grown back where it waits for its joiners) and equal to the undisturbed run (float64,
1e-12) with no survivor restarted, or in a clear error when a shard has no copy left and no checkpoint."""

from __future__ import annotations

import re

import numpy as np
import pytest

from el_launch import launch, undisturbed

pytestmark = pytest.mark.timeout(120)
HOLD = {"EL_HOLD_S": "30"}  # the members wait for the joiners: the job grows back before it ends


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> np.ndarray:
    return undisturbed(tmp_path_factory.mktemp("undisturbed"))


def members_done(log: str) -> dict[str, str]:
    """member id -> 'generation g, rank r of n', one per process that finished."""
    return dict(re.findall(r"member done: (\S+), (generation \d+, rank \d+ of \d+)", log))


def slot(member: str) -> int:
    return int(re.search(r"/r(\d+)/", member).group(1))


def assert_survivors_went_on(log: str, out, killed: list[int], *, grown: bool, n: int = 4) -> None:
    """The killed slots failed and were restarted, no other (a joiner may fail in turn: one that
    entered a generation whose member died before connecting); every other slot's first process
    (never restarted) finished, all in one final generation (of n when ``grown``)."""
    for s in killed:
        assert (out / f"fault-{s}").exists(), (s, log[-3000:])
    restarted = re.findall(r"\[launch\] rank (\d+) exited with .*; starting a joiner in its place", log)
    assert sorted(set(map(int, restarted))) == sorted(killed), log[-4000:]
    done = members_done(log)
    first = [m for m in done if m.endswith("/a0")]
    assert sorted(map(slot, first)) == sorted(set(range(n)) - set(killed)), log[-4000:]
    assert len(set(done.values())) == len(done) and len({w.split(",")[0] for w in done.values()}) == 1, done
    if grown:
        assert sorted(map(slot, done)) == list(range(n)) and all(w.endswith(f"of {n}") for w in done.values()), done


@pytest.mark.parametrize("strategy,faults", [
    ("ddp", "0:all_reduce@3,2:vote@6"),  # rank 0 mid the gradients' all_reduce; then mid the vote
    # in the optimizer (after the commit: the step counts); then rank 0 in the recovery's last all_gather
    # (the others may hold the whole state: the re-shard's vote says no, and all re-form again)
    ("zero1", "2:update@3,0:reshard@2"),
    ("zero2", "1:reduce_scatter@3,3:reshard@0"),  # mid reduce_scatter; then in the recovery's first all_gather
    ("zero3", "1:all_gather@4,3:all_gather@4"),  # two at once, neither holding the other's shard
])
def test_a_fault_shrinks_the_job_and_it_trains_on_equal_to_the_undisturbed_run(tmp_path, reference, strategy,
                                                                               faults):
    env = {"EL_STRATEGY": strategy, "EL_FAULTS": faults}  # grace: joiners too late for the end are stopped soon
    code, log, out = launch(tmp_path, "el", "--elastic", "2:4", n=4, env=env, grace_s=0.5)
    assert code == 0, log[-4000:]
    assert_survivors_went_on(log, out, [int(f.split(":")[0]) for f in faults.split(",")], grown=False)
    np.testing.assert_allclose(np.load(out / "params.npy"), reference, rtol=1e-12, atol=1e-14)


def test_a_member_lost_during_the_recovery_before_it_connects_then_one_stopped_past_the_timeout(tmp_path,
                                                                                                   reference):
    """Rank 1 dies mid the statistics' all_reduce; rank 3 once the next generation (with it) is decided,
    before it connects: the others wait for its address until the timeout, then decide the
    generation after without it; both slots' joiners grow the job back. Then rank 2 is stopped
    (SIGSTOP) for longer than the collectives' timeout: the others time out and re-form without it;
    woken, it finds itself excluded and exits; its slot's joiner grows the job back again."""
    env = {"EL_STRATEGY": "fsdp", "EL_FAULTS": "1:stats@3,3:wire@0,2:stop@8", **HOLD}
    code, log, out = launch(tmp_path, "wire", "--elastic", "2:4", n=4, env=env, timeout_s=3, wake=(2, 4.0))
    assert code == 0, log[-4000:]
    assert "generation 1: ranks [2] never connected; deciding the next without them" in log, log[-4000:]
    assert re.search(r"\[rank 2\] runtime.errors.ExcludedError: '\S+/r2/a0' is not a member of generation \d+", log), \
        log[-4000:]
    assert_survivors_went_on(log, out, [1, 2, 3], grown=True)
    np.testing.assert_allclose(np.load(out / "params.npy"), reference, rtol=1e-12, atol=1e-14)


def test_a_kill_mid_save_then_two_holders_of_one_shard_the_job_goes_on_from_the_newest_checkpoint(tmp_path,
                                                                                                  reference):
    """A checkpoint every 2 steps. Rank 3 dies mid save (step 4's: never committed), the job shrinks;
    at step 7 ranks 1 and 2 die together: rank 2's shard and its copy (held by rank 1) are gone. The
    survivors load the newest checkpoint (step 6) onto the shrunk job, saying so, run step 6 again,
    grow back to 4 and end equal to the undisturbed run; the saves go on to the last step."""
    env = {"EL_STRATEGY": "zero2", "EL_FAULTS": "3:save@4,1:reduce_scatter@7,2:reduce_scatter@7", "EL_CKPT": "2",
           **HOLD}
    code, log, out = launch(tmp_path, "fallback", "--elastic", "1:4", n=4, env=env)
    assert code == 0, log[-4000:]
    assert re.search(r"a shard had no copy left in memory: continuing from \S+/step-00000006 \(optimizer step 6\)",
                     log), log[-4000:]
    assert_survivors_went_on(log, out, [1, 2, 3], grown=True)
    np.testing.assert_allclose(np.load(out / "params.npy"), reference, rtol=1e-12, atol=1e-14)
    saved = sorted(p.name for p in (out / "ckpt").iterdir())
    assert saved[-1] == "step-00000020" and not [name for name in saved if name.startswith(".tmp")], saved


def test_two_holders_of_one_shard_lost_without_a_checkpoint_stop_the_job_saying_so(tmp_path):
    """Ranks 1 and 2 die together and there is no checkpoint: every survivor raises ShardLostError
    naming the checkpoint, and the launcher fails the job at once with the survivor's code instead of
    starting joiners into a job that cannot go on."""
    env = {"EL_STRATEGY": "zero2", "EL_FAULTS": "1:reduce_scatter@4,2:reduce_scatter@4"}
    code, log, _ = launch(tmp_path, "buddies", "--elastic", "2:4", n=4, env=env, deadline_s=45)
    assert code == 1, log[-4000:]
    assert re.search(r"ShardLostError: zero2: the shards of rank\(s\) \[2\] .* newest checkpoint on disk", log), \
        log[-4000:]
    assert "member done" not in log and log.count("starting a joiner in its place") <= 2, log[-4000:]
