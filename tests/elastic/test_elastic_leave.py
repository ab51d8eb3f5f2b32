"""A graceful leave through the real launcher: ranks of an elastic job that get SIGTERM finish their
step, leave at the next boundary (exit 0, their state re-sharded from the others' copies, no disk),
the launcher counts that as a leave (no joiner in their slots), and the survivors go on shrunk at
once (membership's settle wait is 60 s here: waiting for the leavers would show) and end equal to
an undisturbed one-process run (float64, 1e-12). Two neighbours leaving at once (a whole node's ranks) go in
two rounds, each holder staying for its buddy's re-shard. Too many signalled: the whole job stops
as a preempted fixed one. The decisions themselves: pure tests."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.leave import Change, Plan, leave_round, plan

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("leave_job.py")
TIMEOUT_S = 60

pytestmark = pytest.mark.timeout(4 * TIMEOUT_S)


def launch(tmp_path: Path, name: str, *flags: str, n: int = 4, env: dict | None = None) -> tuple[int, str, Path]:
    """leave_job.py under the launcher with ``flags`` and ``n`` ranks (n=1: one process, no launcher)."""
    out = tmp_path / name
    out.mkdir()
    environ = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    environ.pop("RINGWEAVE_SECRET", None)
    launcher = ["-m", "runtime.launch", *flags, "-n", str(n), "--timeout-s", "30", "--grace-s", "2"] if n > 1 else []
    p = subprocess.run([sys.executable, *launcher, str(JOB), str(out)], cwd=REPO, env=environ, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    return p.returncode, p.stdout + p.stderr, out


@pytest.mark.parametrize("strategy, leavers", [("fsdp", "1,2")])
def test_signalled_ranks_leave_and_the_rest_equal_the_undisturbed_run(tmp_path, strategy, leavers):
    env = {"EL_STRATEGY": strategy, "EL_TERM_RANKS": leavers, "EL_AT_STEP": "4"}
    code, log, out = launch(tmp_path, "el", "--elastic", "2:4", env=env)
    assert code == 0, log[-4000:]
    gone = leavers.split(",")
    left = [line for line in log.splitlines() if "left: left the elastic job on SIGTERM" in line]
    assert len(left) == len(gone), log[-3000:]
    for r in gone:
        assert f"[launch] rank {r} left the job" in log, log[-3000:]
    assert "joiner" not in log and "exited with" not in log, log[-3000:]
    done = [line for line in log.splitlines() if "member done:" in line]
    assert len(done) == 4 - len(gone) and all(f"of {4 - len(gone)}" in line for line in done), log[-3000:]
    # no wait for a timeout: membership's settle_s is 60 s in this job (a loaded machine takes seconds)
    delays = [float(line.split("shrunk step: ")[1].split(" s")[0])
              for line in log.splitlines() if "shrunk step:" in line]
    assert len(delays) == 4 - len(gone) and max(delays) < 30, log[-3000:]
    print("signal -> first shrunk step (s):", delays)
    ref_code, ref_log, ref = launch(tmp_path, "ref", n=1, env={"EL_STRATEGY": strategy})  # one process
    assert ref_code == 0, ref_log[-3000:]
    np.testing.assert_allclose(np.load(out / "params.npy"), np.load(ref / "params.npy"), rtol=1e-12, atol=1e-14)


def test_too_many_signalled_stop_the_whole_job_as_preempted(tmp_path):
    env = {"EL_TERM_RANKS": "1,2", "EL_AT_STEP": "3"}
    code, log, _ = launch(tmp_path, "stop", "--elastic", "2:3", n=3, env=env)
    assert code == 143, log[-3000:]
    stopped = [line for line in log.splitlines()
               if line.startswith("[rank") and "stopped: stopped by SIGTERM at a step boundary" in line]
    assert len(stopped) == 3 and "joiner" not in log and "left the job" not in log, log[-3000:]
    assert "the job was preempted" in log, log[-3000:]


def test_leave_round_never_takes_a_holder_with_its_buddy():
    assert leave_round({1}, 4, replicated=False) == (1,)
    assert leave_round({1, 2}, 4, replicated=False) == (1,)
    assert leave_round({1, 2, 3}, 5, replicated=False) == (1, 3)
    assert leave_round({0, 3}, 4, replicated=False) == (0,)  # 3 holds 0's copy (mod 4)
    assert leave_round({1, 2}, 4, replicated=True) == (1, 2)  # ddp: every rank holds everything
    for n in range(2, 9):  # any set: no chosen rank's holder is chosen, and something is chosen
        for mask in range(1, 2 ** n):
            leavers = {r for r in range(n) if mask >> r & 1}
            chosen = leave_round(leavers, n, replicated=False)
            assert chosen and set(chosen) <= leavers
            assert not any((q - 1) % n in chosen for q in chosen), (leavers, chosen)


def test_plan_grows_leaves_or_stops_the_same_on_every_member():
    assert plan(Change(), 4, 2, False) == Plan("none")
    assert plan(Change(grow=True), 4, 2, False) == Plan("grow")
    assert plan(Change(grow=True, signals={3: 15}), 4, 2, False) == Plan("leave", (3,), 15)
    assert plan(Change(signals={1: 15, 2: 10}), 4, 2, False) == Plan("leave", (1,), 15)
    assert plan(Change(signals={1: 15, 2: 15}), 4, 3, False) == Plan("stop", signum=15)
    assert plan(Change(signals={r: 15 for r in range(4)}), 4, 1, True) == Plan("stop", signum=15)
