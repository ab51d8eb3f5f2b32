"""The shared-memory path between real processes: through the launcher, and ranks started by
hand so a test can SIGKILL one of them in the middle of a collective."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectives.slots import fastpath
from runtime.sharedmem import segments

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("shm_rank.py"))

pytestmark = pytest.mark.timeout(180)


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RINGWEAVE_SHM", None)
    env.update(extra)
    return env


def _job(tag: str) -> str:
    return f"shmtest-{tag}-{os.getpid()}-{time.monotonic_ns() % 10**6}"


def _launch(n: int, mode: str, job: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.launch", "-n", str(n), "--job-id", job, SCRIPT, mode],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)


def test_collectives_through_the_launcher_4_ranks():
    job = _job("matrix")
    proc = _launch(4, "matrix", job)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(line.split()[-1] for line in proc.stdout.splitlines() if " OK " in line) == ["0", "1", "2", "3"]
    assert segments.job_segments(job) == []


def test_launcher_removes_what_a_killed_rank_left():
    job = _job("leftover")
    proc = _launch(3, "leftover", job)
    assert proc.returncode != 0  # rank 1 was killed
    assert "CREATED" in proc.stdout, proc.stdout[-2000:]
    assert "SIGKILL" in proc.stdout + proc.stderr
    assert segments.job_segments(job) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_by_hand(n: int, mode: str, job: str, **extra) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for r in range(n):
        env = _env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RINGWEAVE_JOB=job, PYTHONUNBUFFERED="1", **extra)
        env.pop("RINGWEAVE_STORE_HOSTED", None)
        procs.append(subprocess.Popen([sys.executable, SCRIPT, mode], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def _read_until(proc: subprocess.Popen, word: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(word):
            return line
    raise AssertionError(f"no {word!r} line; got:\n{''.join(lines)[-3000:]}")


def _finish(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        p.stdout.close()


@pytest.mark.parametrize("mode", ["kill", "kill-small", "kill-barrier"])
def test_a_killed_rank_is_detected_within_seconds_and_dev_shm_is_clean(mode):
    """A rank SIGKILLed while the others wait for it: in the large all_reduce (Python), in the
    small one and in the barrier (compiled, collectives/slots/fastpath.py), every survivor raises
    PeerLostError within seconds, none hangs."""
    job = _job(mode)
    procs = _start_by_hand(4, mode, job, RINGWEAVE_SHM_COMPILED="1")  # (auto: Python where ranks share cores)
    try:
        _read_until(procs[3], "READY")
        for p in procs[:3]:
            words = _read_until(p, "ENTER").split()
            if mode != "kill" and fastpath.SUPPORTED:
                assert words[2] == "compiled", words
        time.sleep(0.5)  # the survivors are now asleep in the shared-memory wait
        killed_at = time.time()
        procs[3].send_signal(signal.SIGKILL)
        for r, p in enumerate(procs[:3]):
            words = _read_until(p, "CAUGHT", 30).split()
            assert words[2] == "PeerLostError", (r, words)
            print(f"rank {r} saw the loss after {float(words[3]) - killed_at:.3f} s")
            assert float(words[3]) - killed_at < 3.0, f"rank {r} saw the loss after {float(words[3]) - killed_at:.2f} s"
        for p in procs:
            p.wait(30)
    finally:
        _finish(procs)
    assert segments.job_segments(job) == []


def test_timeout_is_bounded_when_a_rank_never_calls():
    job = _job("timeout")
    procs = _start_by_hand(4, "timeout", job)
    try:
        for r, p in enumerate(procs[:3]):
            words = _read_until(p, "CAUGHT", 60).split()
            assert words[2] == "CollectiveTimeoutError", (r, words)
            print(f"rank {r} timed out after {words[4]} s")
            assert 0.9 < float(words[4]) < 2.0, f"rank {r} timed out after {words[4]} s (timeout 1.0 s)"
        for p in procs:
            p.wait(30)
    finally:
        _finish(procs)
    assert segments.job_segments(job) == []
