"""The launcher end to end: real launcher processes running small rank
scripts (written to tmp_path) that record their pids, environment and
timings in files, so that the tests can check exit codes, output, timing and
that no process of a job outlives it (``os.kill(pid, 0)`` must fail)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

RANK_SCRIPT = r'''
import asyncio, json, os, signal, subprocess, sys, time

mode, out = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
restart = os.environ["RINGWEAVE_RESTART"]  # the launcher's contract: read as the launcher set it


def put(name, text):
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def wait_for(names, timeout_s=20):
    deadline = time.time() + timeout_s
    while not all(os.path.exists(os.path.join(out, n)) for n in names):
        if time.time() > deadline:
            sys.exit(f"rank {rank}: timed out waiting for {names}")
        time.sleep(0.01)


async def rendezvous():
    """Every rank of the job meets every other through the launcher's store."""
    from runtime.launch_config import attempt_prefix
    from runtime.store import PrefixStore
    from runtime.store_tcp import TCPStore
    secret = os.environ.get("RINGWEAVE_SECRET")  # the launcher's contract: read as the launcher set it
    client = await TCPStore.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    secret=secret.encode() if secret else None,
                                    job=os.environ["RINGWEAVE_JOB"], timeout_s=20)  # the launcher's contract
    try:
        store = PrefixStore(attempt_prefix(int(restart)), client)
        await store.set(f"rank{rank}", b"here")
        await store.wait([f"rank{r}" for r in range(world)], timeout_s=20)
    finally:
        await client.close()


put(f"pid.{rank}.{restart}", str(os.getpid()))
all_started = [f"pid.{r}.{restart}" for r in range(world)]

if mode == "env":
    asyncio.run(rendezvous())
    put(f"env.{rank}.{restart}", json.dumps(dict(os.environ)))
    print(f"hello from rank {rank}")
    print(f"warn from rank {rank}", file=sys.stderr)
    sys.stdout.write(f"no newline {rank}")
elif mode == "fail":  # argv: bad rank, exit code
    bad, code = int(sys.argv[3]), int(sys.argv[4])
    if rank == bad:
        wait_for(all_started)
        # a grandchild that inherits the pipes and outlives its rank must not
        # delay the failure, and must not outlive the job
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        put(f"gc.{rank}.{restart}", str(child.pid))
        print(f"rank {rank} is about to fail")
        put("t_fail", repr(time.time()))
        sys.exit(code)
    time.sleep(60)
elif mode == "sigkill":  # argv: bad rank
    if rank == int(sys.argv[3]):
        wait_for(all_started)
        print("about to be killed")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
elif mode == "hang":  # argv: [ignore-term]; starts a grandchild, then sleeps
    ignore = sys.argv[3:] == ["ignore-term"]
    if ignore:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    put(f"gc.{rank}.{restart}", str(child.pid))
    print("ready")
    time.sleep(60)
elif mode == "restart":  # rank 1 fails in attempt 0 only
    if rank == 1 and restart == "0":
        wait_for(all_started)
        sys.exit(5)
    if restart != "0":
        asyncio.run(rendezvous())
    put(f"env.{rank}.{restart}", json.dumps(dict(os.environ)))
else:
    sys.exit(f"unknown mode {mode}")
'''

THREAD_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def launcher_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k in ("RINGWEAVE_TUNE", "RINGWEAVE_WARMUP")  # the suite's settings (tests/conftest.py)
           or not k.startswith("RINGWEAVE_") and k not in THREAD_VARS}
    env.update(extra)
    return env


@pytest.fixture
def job(tmp_path):
    """A rank script and an output directory; on the way out, kills whatever
    pid a failed test left alive, so one broken test does not leak into others."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    yield script, out
    for pid in recorded_pids(out):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch_cmd(*opts, script, mode, out, args=()) -> list[str]:
    return [sys.executable, "-m", "runtime.launch", *opts, str(script), mode, str(out), *args]


def run(cmd, env=None, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env or launcher_env(), capture_output=True,
                          text=True, timeout=timeout)


def recorded_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.iterdir()
            if p.name.startswith(("pid.", "gc.")) and not p.name.endswith(".tmp")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_no_orphans(out: Path, expect_at_least: int) -> None:
    pids = recorded_pids(out)
    assert len(pids) >= expect_at_least, sorted(p.name for p in out.iterdir())
    assert [pid for pid in pids if alive(pid)] == []


def wait_files(out: Path, names, timeout_s=20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((out / n).exists() for n in names):
        assert time.monotonic() < deadline, f"ranks never wrote {names}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_env(out: Path, rank: int, restart: int = 0) -> dict:
    return json.loads((out / f"env.{rank}.{restart}").read_text())


@pytest.mark.timeout(30)
def test_all_succeed_environment_and_prefixed_output(job):
    script, out = job
    r = run(launch_cmd("-n", "3", script=script, mode="env", out=out),
            env=launcher_env(OMP_NUM_THREADS="7"))
    assert r.returncode == 0, r.stderr
    for rank in range(3):
        assert f"[rank {rank}] hello from rank {rank}\n" in r.stdout
        assert f"[rank {rank}] no newline {rank}\n" in r.stdout  # partial last line, flushed at exit
        assert f"[rank {rank}] warn from rank {rank}\n" in r.stderr
        assert "warn from" not in r.stdout and "hello from" not in r.stderr
    envs = [read_env(out, rank) for rank in range(3)]
    threads = str(max(1, len(os.sched_getaffinity(0)) // 3))
    for rank, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
            (str(rank), str(rank), "3", "3")
        assert (env["NODE_RANK"], env["GROUP_RANK"], env["MASTER_ADDR"]) == ("0", "0", "127.0.0.1")
        assert (env["RINGWEAVE_STORE_HOSTED"], env["RINGWEAVE_RESTART"], env["PYTHONUNBUFFERED"]) == \
            ("1", "0", "1")
        assert env["OMP_NUM_THREADS"] == "7"  # set by the user: kept
        assert [env[v] for v in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")] == \
            [threads] * 3
    # one store, one secret, one job for every rank; the port is the real one, not 0
    assert len({(e["MASTER_PORT"], e["RINGWEAVE_SECRET"], e["RINGWEAVE_JOB"]) for e in envs}) == 1
    assert int(envs[0]["MASTER_PORT"]) > 0 and len(envs[0]["RINGWEAVE_SECRET"]) == 64
    assert_no_orphans(out, 3)


@pytest.mark.timeout(30)
def test_failing_rank_stops_the_job_fast_with_its_exit_code(job):
    script, out = job
    r = run(launch_cmd("-n", "4", script=script, mode="fail", out=out, args=("2", "3")))
    t_exit = time.time()
    assert r.returncode == 3, r.stderr
    t_fail = float((out / "t_fail").read_text())
    assert t_exit - t_fail < 5.0
    assert "rank 2 failed first: exit code 3" in r.stderr
    assert "  | rank 2 is about to fail" in r.stderr  # its last lines
    assert "[rank 2] rank 2 is about to fail" in r.stdout
    assert_no_orphans(out, 5)  # 4 ranks + the grandchild of rank 2


@pytest.mark.timeout(30)
def test_rank_killed_by_sigkill_is_named(job):
    script, out = job
    r = run(launch_cmd("-n", "2", script=script, mode="sigkill", out=out, args=("1",)))
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    assert "rank 1 failed first: signal SIGKILL (exit code 137)" in r.stderr
    assert "  | about to be killed" in r.stderr
    assert_no_orphans(out, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_ranks_and_grandchildren(job, sig, code):
    script, out = job
    proc = subprocess.Popen(launch_cmd("-n", "2", script=script, mode="hang", out=out), cwd=REPO,
                            env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_files(out, [f"gc.{r}.0" for r in range(2)])
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, stderr
    assert f"got {signal.Signals(sig).name}" in stderr
    assert "[rank 0] ready" in stdout
    assert_no_orphans(out, 4)  # 2 ranks + 2 grandchildren


@pytest.mark.timeout(30)
def test_ranks_that_ignore_sigterm_are_killed_after_the_grace(job):
    script, out = job
    proc = subprocess.Popen(launch_cmd("-n", "2", "--grace-s", "0.5", script=script, mode="hang",
                                       out=out, args=("ignore-term",)),
                            cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_files(out, [f"gc.{r}.0" for r in range(2)])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
        took_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr
    assert "did not stop within --grace-s 0.5: killed" in stderr
    assert 0.4 < took_s < 5.0
    assert_no_orphans(out, 4)


@pytest.mark.timeout(40)
def test_max_restarts_restarts_after_a_failure_and_succeeds(job):
    script, out = job
    r = run(launch_cmd("-n", "3", "--max-restarts", "1", script=script, mode="restart", out=out))
    assert r.returncode == 0, r.stderr
    assert "restarting the job (1 of 1) after rank 1 failed with exit code 5" in r.stderr
    assert all((out / f"pid.{rank}.{attempt}").exists() for rank in range(3) for attempt in (0, 1))
    envs = [read_env(out, rank, restart=1) for rank in range(3)]
    assert {e["RINGWEAVE_RESTART"] for e in envs} == {"1"}
    assert_no_orphans(out, 6)


@pytest.mark.timeout(40)
def test_max_restarts_exhausted_exits_with_the_last_failure(job):
    script, out = job
    r = run(launch_cmd("-n", "3", "--max-restarts", "1", script=script, mode="fail", out=out,
                       args=("2", "3")))
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("rank 2 failed first: exit code 3") == 2
    assert r.stderr.count("restarting the job") == 1
    assert_no_orphans(out, 7)


@pytest.mark.timeout(30)
def test_max_time_stops_a_job_that_runs_too_long(job):
    script, out = job
    r = run(launch_cmd("-n", "2", "--max-time-s", "1", script=script, mode="hang", out=out))
    assert r.returncode == 124, r.stderr
    assert "ran past --max-time-s 1" in r.stderr
    assert_no_orphans(out, 4)


@pytest.mark.timeout(40)
@pytest.mark.parametrize("given", ["s" * 64, None])
def test_two_nodes_on_one_machine(job, tmp_path, given):
    """With RINGWEAVE_SECRET, every rank gets it; without, the two launchers share one made for
    the job in a private file (runtime/jobsecret.py), removed when the job ends."""
    script, out = job
    port = free_port()
    env = launcher_env(XDG_RUNTIME_DIR=str(tmp_path), **({"RINGWEAVE_SECRET": given} if given else {}))
    procs = [subprocess.Popen(
        launch_cmd("-n", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                   "--master-port", str(port), "--job-id", "two-nodes", script=script, mode="env",
                   out=out),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (1, 0)]  # node 1 first: its ranks must wait for node 0's store
    try:
        results = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0], results
    envs = [read_env(out, rank) for rank in range(4)]
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["NODE_RANK"]) for e in envs] == [
        ("0", "4", "0", "0"), ("1", "4", "1", "0"), ("2", "4", "0", "1"), ("3", "4", "1", "1")]
    secrets_seen = {e["RINGWEAVE_SECRET"] for e in envs}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["RINGWEAVE_JOB"]) for e in envs} == {
        ("127.0.0.1", str(port), "two-nodes")}
    if given:
        assert secrets_seen == {given}
    else:
        assert len(secrets_seen) == 1 and re.fullmatch("[0-9a-f]{64}", secrets_seen.pop())
        assert all("the nodes share the job's secret in" in err for _, err in results), results
        assert not list((tmp_path / f"ringweave-{os.getuid()}").glob("*.secret"))
    assert "[rank 2] hello from rank 2" in results[0][0]  # node 1 prints its own ranks
    assert "[rank 0] hello from rank 0" in results[1][0]


@pytest.mark.timeout(20)
def test_multi_node_beyond_loopback_refuses_without_a_secret(job):
    script, out = job
    r = run(launch_cmd("-n", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.255.255.1",
                       "--master-port", "29599", script=script, mode="env", out=out))
    assert r.returncode == 2
    assert "RINGWEAVE_SECRET" in r.stderr
    assert list(out.iterdir()) == []  # no rank was started


@pytest.mark.timeout(20)
def test_bad_options_exit_2_with_the_reason(job):
    script, out = job
    r = run(launch_cmd("-n", "2", "--nnodes", "2", script=script, mode="env", out=out))
    assert r.returncode == 2
    assert "--master-addr" in r.stderr
