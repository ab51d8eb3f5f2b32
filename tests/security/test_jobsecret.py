"""A job started without RINGWEAVE_SECRET derives one that only its user can read
(runtime/jobsecret.py; SECURITY.md, "A job started without a secret"):

* the ranks of one job share one secret, made by the first of them in a 0600 file of the
  private directory; other jobs and other SLURM steps get others; its maker removes it;
* a file left by a killed job is replaced by a fresh secret (its stragglers cannot join);
* another local user can read none of it; a directory they made first is refused, and the
  job does not start, saying how to set a secret;
* a job whose store is beyond this host gets no derived secret: it refuses at once, saying how;
* ranks started as srun, mpirun or a user starts them run authenticated without a secret, and
  ``tools.status`` finds them (a tool of another SLURM step too).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import runtime
from runtime import auth, jobsecret, scheduler
from runtime.errors import AuthenticationError
from runtime.store_tcp import TCPStore
from tests.security.impostor import free_job_number, launcher_env
from tests.security.jobutil import REPO, wait_until
from tests.security.stranger import as_stranger, needs_root

pytestmark = pytest.mark.timeout(60)
HOW = "export RINGWEAVE_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')"


@pytest.fixture
def private(tmp_path, monkeypatch) -> Path:
    """XDG_RUNTIME_DIR in tmp_path: the private directory is tmp_path/ringweave-<uid>."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / f"ringweave-{os.getuid()}"


def _secret_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.secret")) if d.exists() else []


def test_the_ranks_of_a_job_share_one_secret_in_a_private_file_that_its_maker_removes(private):
    srun = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
    first = jobsecret.derive("slurm-77", 15077, "127.0.0.1", "rank 1", env=srun)
    again = jobsecret.derive("slurm-77", 15077, "127.0.0.1", "rank 0", env=srun)
    assert first.made_here and not again.made_here and first.secret == again.secret
    assert re.fullmatch(rb"[0-9a-f]{64}", first.secret)
    (path,) = _secret_files(private)
    assert str(path) == first.path
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert jobsecret.lookup("slurm-77", 15077) == first.secret  # a tool, from a step of its own
    others = [jobsecret.derive("slurm-77", 15077, "127.0.0.1", "r", env={"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"}),
              jobsecret.derive("slurm-77", 15078, "127.0.0.1", "r", env=srun),
              jobsecret.derive("ringweave", 15077, "localhost", "r", env={})]
    assert len({first.secret} | {o.secret for o in others}) == 4  # another step, port or job: another secret
    assert jobsecret.lookup("slurm-77", 15077) == others[0].secret  # the newest step of the job
    assert not jobsecret.release(again)  # not its maker
    assert jobsecret.release(first) and not path.exists()
    assert jobsecret.derive("slurm-77", 15077, "127.0.0.1", "r", env=srun).secret != first.secret


KILLED = """
import os, signal
from runtime import jobsecret
print(jobsecret.derive("by-hand", 29500, "127.0.0.1", "rank 0", env={}).secret.decode(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_file_of_a_killed_job_is_replaced_by_a_fresh_secret(private):
    out = subprocess.run([sys.executable, "-c", KILLED], cwd=REPO, capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == -signal.SIGKILL
    old = out.stdout.strip()
    assert len(_secret_files(private)) == 1  # left behind by the killed maker
    fresh = jobsecret.derive("by-hand", 29500, "127.0.0.1", "rank 1", env={})
    assert fresh.made_here and fresh.secret.decode() != old
    assert len(_secret_files(private)) == 1


def _read_everything(d: str) -> dict:
    """As the stranger: list and read the private directory and each file in it."""
    out = {}
    try:
        names = os.listdir(d)
    except OSError as exc:
        return {"listdir": type(exc).__name__}
    for name in names:
        try:
            out[name] = open(os.path.join(d, name)).read()
        except OSError as exc:
            out[name] = type(exc).__name__
    return out


def _make_dir_first(d: str) -> None:
    os.mkdir(d)
    os.chmod(d, 0o777)


@needs_root
def test_another_user_reads_nothing_and_a_directory_they_made_first_stops_the_job_saying_how(tmp_path, monkeypatch):
    shared = tempfile.mkdtemp(prefix="rw-shared-", dir="/tmp")
    os.chmod(shared, 0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", shared)
    try:
        d = os.path.join(shared, f"ringweave-{os.getuid()}")
        js = jobsecret.derive("ringweave", 29501, "127.0.0.1", "rank 0", env={})
        assert as_stranger(_read_everything, d) == {"listdir": "PermissionError"}
        assert as_stranger(_read_everything, os.path.dirname(js.path) + "/") == {"listdir": "PermissionError"}
        jobsecret.release(js)
        os.rmdir(d)
        as_stranger(_make_dir_first, d)  # the stranger's, open to all: refused, nothing written there
        with pytest.raises(AuthenticationError) as err:
            jobsecret.derive("ringweave", 29501, "127.0.0.1", "rank 0", env={})
        assert HOW in str(err.value) and "belongs to uid" in str(err.value) and "\n" not in str(err.value)
        assert os.listdir(d) == []
    finally:
        subprocess.run(["rm", "-rf", shared], check=False)


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name in ("RINGWEAVE_TUNE", "RINGWEAVE_WARMUP"):  # the suite's settings (tests/conftest.py)
            continue
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MASTER_", "RINGWEAVE_")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RINGWEAVE_WATCH_PARENT", "0")
    monkeypatch.setattr(auth, "_taken_secret", None)  # no secret an earlier test of this process set
    for name in scheduler.THREAD_VARS:
        monkeypatch.setenv(name, os.environ.get(name) or "1")
    return monkeypatch


async def test_a_job_beyond_this_host_without_a_secret_refuses_at_once_saying_how(clean_env, private):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "29502"}.items():
        clean_env.setenv(name, value)
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError) as err:
        await asyncio.wait_for(runtime.init(), 10)
    assert time.monotonic() - t0 < 5
    assert "10.255.255.1:29502 is beyond this host" in str(err.value) and HOW in str(err.value), err.value
    assert _secret_files(private) == []


# A rank that stays in the job (a barrier every 50 ms) until the file argv[1] appears.
STAY = r'''
import asyncio, os, sys
import numpy as np
import collectives, runtime

async def main():
    rt = await runtime.init()
    print("ready", flush=True)
    flag = np.zeros(1, np.int32)
    while not flag[0]:
        await asyncio.sleep(0.05)
        flag[0] = os.path.exists(sys.argv[1])
        await collectives.all_reduce(flag, op="max")
    await runtime.shutdown(rt)

asyncio.run(main())
'''


def _tool_env(kind: str, number: int, private_base: Path) -> tuple[list[str], dict]:
    """How a user asks ``kind``'s job what it does, without a secret: under SLURM from another step
    (``srun --jobid=J --overlap -n 1 python -m tools.status``), else naming the store's port."""
    _, job, env = launcher_env(kind, number, 0)
    env.update(XDG_RUNTIME_DIR=str(private_base), PYTHONPATH=str(REPO))
    if kind == "srun":
        env.update(SLURM_STEP_ID="1", SLURM_NTASKS="1", SLURM_STEP_TASKS_PER_NODE="1")
        return [], env
    for name in list(env):
        if name.startswith(("OMPI_", "MASTER_")) or name in ("RANK", "WORLD_SIZE"):
            del env[name]
    return ["--master-port", str(scheduler.derived_port(number)), "--job", job], env


@pytest.mark.parametrize("kind", ["srun", "mpirun", "hand"])
def test_ranks_started_without_a_secret_run_authenticated_and_tools_find_them(tmp_path, kind):
    number = free_job_number(5151)
    port = scheduler.derived_port(number)
    script, stop = tmp_path / "stay.py", tmp_path / "stop"
    script.write_text(STAY)
    private = tmp_path / f"ringweave-{os.getuid()}"
    ranks = []
    for rank in range(2):
        _, job, env = launcher_env(kind, number, rank)
        env.update(XDG_RUNTIME_DIR=str(tmp_path), PYTHONPATH=str(REPO))
        ranks.append(subprocess.Popen([sys.executable, str(script), str(stop)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for r in ranks:
            assert r.stdout.readline().strip() == "ready", r.stderr.read() if r.poll() is not None else ""
        (path,) = _secret_files(private)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(AuthenticationError, match="requires a secret"):  # the store asks for one
            asyncio.run(TCPStore.connect("127.0.0.1", port, secret=None, job=job, timeout_s=5))
        flags, env = _tool_env(kind, number, tmp_path)
        tool = subprocess.run([sys.executable, "-m", "tools.status", "--json", *flags], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=30)
        assert tool.returncode == 0, tool.stderr
        assert [s["rank"] for s in json.loads(tool.stdout)] == [0, 1]
        stop.write_text("")
        codes = [r.wait(30) for r in ranks]
        assert codes == [0, 0], [r.stderr.read()[-2000:] for r in ranks]
        wait_until(lambda: not _secret_files(private), 5, "the maker to remove the secret file")
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
            r.communicate()

