"""The spin of the inline socket wait (``transport.wait_spin_s``): ``RINGWEAVE_SPIN_US`` where set;
unset, its default where each of the node's ranks has a core and 0 where they outnumber the cores.
In processes: ranks pinned to one core take the 0, and their small calls still read frames straight
off the socket with closed-form answers."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import env
from runtime.transport import wait_spin_s

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("RINGWEAVE_SPIN_US", raising=False)


def test_ranks_that_outnumber_the_cores_do_not_spin(two_cores):
    assert wait_spin_s(4) == 0.0
    assert wait_spin_s(3) == 0.0


def test_a_core_per_rank_keeps_the_default_spin(two_cores):
    assert wait_spin_s(2) == env.DEFAULT_SPIN_US / 1e6 > 0
    assert wait_spin_s(1) == env.DEFAULT_SPIN_US / 1e6


def test_a_spin_that_is_set_holds_however_many_ranks(two_cores, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SPIN_US", "30")
    assert wait_spin_s(4) == pytest.approx(30e-6)
    monkeypatch.setenv("RINGWEAVE_SPIN_US", "0")
    assert wait_spin_s(1) == 0.0


JOB = r'''
import os
import numpy as np
import runtime
import collectives as C

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # every rank on one core: ranks outnumber cores


async def main():
    rt = await runtime.init()
    n, r = rt.world_size, rt.rank
    wrong = 0
    for it in range(40):
        x = np.full(3, r + it, np.float32)
        await C.all_reduce(x)
        wrong += not np.array_equal(x, np.full(3, n * (n - 1) / 2 + n * it, np.float32))
        await C.barrier()
    now = sum(c.statistics().frames_received_now for c in rt.actor.conns.values())
    print(f"rank {r}: spin={rt.spin_s} wrong={wrong} now={now}", flush=True)
    await runtime.shutdown()

runtime.run(main())
'''


@pytest.mark.timeout(120)
def test_ranks_pinned_to_one_core_wait_without_spinning_and_stay_right(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    environ = {k: v for k, v in os.environ.items() if k != "RINGWEAVE_SPIN_US"}
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "3", str(script)], cwd=str(REPO),
                          env=dict(environ, PYTHONPATH=str(REPO), RINGWEAVE_SHM="0"),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.findall(r"rank (\d): spin=(\S+) wrong=(\d+) now=(\d+)", proc.stdout)
    assert sorted(int(f[0]) for f in found) == [0, 1, 2], proc.stdout[-3000:]
    for _, spin, wrong, now in found:
        assert float(spin) == 0.0 and wrong == "0", found
        assert int(now) > 0, found  # the inline path is still taken, sleeping in poll() at once
