"""A rank that stalls (SIGSTOP) with no failure: the collective timeout fires.

Rank 2 stops itself (SIGSTOP) while the others are inside an all_reduce that
it has not reached; nothing breaks, so no
peer is lost: the only way out is the collective timeout, set to 3 s with the
launcher's ``--timeout-s``. Every other rank must raise
CollectiveTimeoutError within a little more than the timeout, naming the
rank(s) it waited on (its algorithm's neighbours: in a ring, the rank to the
left, which need not be rank 2; on shared memory, nobody in particular) and the
rank that had not reached the call (rank 2, not answering), and the job must
show what each rank was last doing:

* each running rank prints ``runtime.current().status()`` one second into the
  stall (its call in flight, how long it has waited, on whom);
* the test runs ``python -m tools.status --job ID`` during the stall, which
  asks every rank from outside and reports rank 2 as not answering.

The launcher then stops everything (the stopped rank by SIGKILL after
--grace-s) and no process is left. Over TCP only and with shared memory.
"""

from __future__ import annotations

import math
import subprocess

import pytest

from tests.faults.harness import PYTHON, REPO, assert_no_process_left, launch, wait_for_file

TIMEOUT_S = 4.0

STALL = r'''
import json

async def show_status(rt):
    await asyncio.sleep(1.0)
    print(f"rank {RANK} status 1 s into the stall: {json.dumps(rt.status())}", flush=True)


async def body(rt):
    x = np.ones(1 << 20, np.float32)          # 4 MiB
    # The first call imports and compiles what it needs in each rank (no warm-up in the suite),
    # seconds on a loaded machine: it gets room for that; the stalled call has --timeout-s.
    await C.all_reduce(x, timeout=60)
    await C.barrier(timeout=60)
    if RANK == 2:
        # Stalls just before the all_reduce, while the others are inside it. (Stopping
        # inside it would not do: on shared memory a rank's part can be done before
        # its first await, and the others then finish without it.)
        await asyncio.sleep(0.3)
        die(signal.SIGSTOP, "SIGSTOP")
    task = asyncio.ensure_future(C.all_reduce(x))
    reporter = asyncio.ensure_future(show_status(rt))
    try:
        await task
    finally:
        reporter.cancel()
    raise SystemExit(f"rank {RANK}: the all_reduce finished without rank 2")

run(body)
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_stalled_rank_times_out_naming_it(tmp_path, path):
    job = f"stall-{path}-{tmp_path.name}"
    seen = {}

    def ask_status(proc, out):
        if wait_for_file(out / "fault", 30):
            import time
            time.sleep(0.3)
            st = subprocess.run([PYTHON, "-m", "tools.status", "--job", job, "--timeout-s", "1"], cwd=str(REPO),
                                capture_output=True, text=True, timeout=20)
            seen["status"] = st.stdout + st.stderr

    env = {"RINGWEAVE_SHM": "0" if path == "tcp" else "1"}
    result = launch(tmp_path, STALL, env=env, during=ask_status, timeout_s=45,
                    launcher_args=("--timeout-s", f"{TIMEOUT_S:g}", "--grace-s", "1", "--job-id", job))
    result.show(f"rank 2 stalled (SIGSTOP) before an all_reduce the others are in, timeout {TIMEOUT_S:g} s ({path})")
    status_lines = [line for line in result.stdout.splitlines() if "status 1 s into the stall" in line]
    print("   what each rank was doing (its own status, 1 s into the stall):")
    for line in status_lines:
        print("     " + line)
    print("   python -m tools.status during the stall:")
    for line in seen.get("status", "(not run)").splitlines():
        print("     " + line)

    assert result.returncode != 0, result.explain()
    assert sorted(result.reports) == [0, 1, 3], result.explain()
    for r, rep in result.reports.items():
        assert rep.error == "CollectiveTimeoutError", (r, rep, result.explain())
        assert "; rank 2 had not reached this call (2: not answering" in rep.message, (r, rep)
        assert "[" not in rep.message and "rank(s)" not in rep.message, (r, rep)  # in words, no empty list
        assert not math.isnan(rep.after_s) and rep.after_s < TIMEOUT_S + 2.0, (r, rep)
    assert len(status_lines) == 3, result.explain()
    assert all('"calls": [{' in line and "all_reduce" in line for line in status_lines), status_lines
    status = seen.get("status", "")
    assert "rank 2: not answering" in status, status
    for r in (0, 1, 3):
        assert f"rank {r}: all_reduce" in status, status
    assert_no_process_left(result)
