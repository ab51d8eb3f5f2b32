"""``python -m runtime.store`` as users run it: a process of its own that clients reach with
the job's secret, that refuses strangers and unauthenticated non-loopback addresses, and that
ends cleanly on SIGTERM and SIGINT."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from runtime.errors import AuthenticationError, StoreError
from runtime.store_main import read_secret_file
from runtime.store_tcp import TCPStore

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "0123456789abcdef" * 4
LISTENING = re.compile(r"^listening on 127\.0\.0\.1:(\d+) \(job 'elastic-test', authenticated\)")


def start(*args: str, secret: str | None = SECRET, **extra_env: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RINGWEAVE_SECRET" and not k.startswith("SLURM_")}
    env.update(extra_env)
    if secret is not None:
        env["RINGWEAVE_SECRET"] = secret
    env["PYTHONPATH"] = ROOT
    return subprocess.Popen([sys.executable, "-m", "runtime.store", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@contextlib.contextmanager
def running(*args: str, secret: str | None = SECRET, **extra_env: str):
    """The store process; killed (if still running) and its pipes closed, whatever happened."""
    proc = start(*args, secret=secret, **extra_env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def listening_port(proc: subprocess.Popen) -> int:
    line = proc.stdout.readline()  # the first line, printed once it listens
    m = LISTENING.match(line)
    assert m, (line, proc.poll())
    return int(m.group(1))


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
async def test_a_client_with_the_secret_is_served_and_a_signal_ends_it_cleanly(how):
    with running("--job", "elastic-test") as proc:
        port = listening_port(proc)
        store = await TCPStore.connect("127.0.0.1", port, secret=SECRET.encode(), job="elastic-test", timeout_s=10)
        try:
            await store.set("gen/0", b"a,b")
            assert await store.get("gen/0") == b"a,b"
            assert await store.compare_set("gen/1", None, b"first") == b"first"
            assert await store.compare_set("gen/1", None, b"second") == b"first"  # one decision
            assert await store.add("n", 3) == 3
            with pytest.raises(AuthenticationError):
                await TCPStore.connect("127.0.0.1", port, secret=b"wrong", job="elastic-test", timeout_s=5)
            assert await store.get("gen/1") == b"first"  # the refused stranger changed nothing
            proc.send_signal(how)
            assert proc.wait(timeout=20) == 0
            with pytest.raises(StoreError):  # the server told us bye, or the connection is gone
                await store.get("gen/0", timeout_s=2)
        finally:
            await store.close()
        assert port_is_free(port)
        lines = proc.stderr.read().splitlines()  # the stranger was logged, and nothing else went wrong
        assert len(lines) == 1 and "failed authentication" in lines[0], lines


def test_no_secret_beyond_loopback_is_refused_before_listening():
    proc = start("--host", "0.0.0.0", "--port", "0", secret=None)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert out == ""
    assert "without a secret" in err and "RINGWEAVE_SECRET" in err


def test_the_secret_file_must_be_this_users_alone(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    assert read_secret_file(str(path)) == b"s3cret"
    path.chmod(0o640)
    with pytest.raises(AuthenticationError, match="0640|mode"):
        read_secret_file(str(path))
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(AuthenticationError, match="symbolic link"):
        read_secret_file(str(link))
    for bad in ("\n", "two\nlines\n", "x" * 5000):
        path.write_text(bad)
        with pytest.raises(AuthenticationError, match="one line"):
            read_secret_file(str(path))


async def test_a_secret_file_serves_like_the_variable(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    with running("--job", "elastic-test", "--secret-file", str(path), secret=None) as proc:
        port = listening_port(proc)
        store = await TCPStore.connect("127.0.0.1", port, secret=SECRET.encode(), job="elastic-test", timeout_s=10)
        await store.set("k", b"v")
        assert await store.get("k") == b"v"
        await store.close()
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def test_inside_a_slurm_step_the_job_is_named_as_its_ranks_name_it():
    with running(secret=None, SLURM_JOB_ID="77", SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_STEP_ID="0",
                 SLURM_STEP_NUM_TASKS="2", SLURM_NODELIST="localhost", SLURM_TASKS_PER_NODE="2") as proc:
        line = proc.stdout.readline()
        assert "(job 'slurm-77'" in line and line.rstrip().endswith("RINGWEAVE_JOB=slurm-77"), line
        proc.terminate()
        assert proc.wait(timeout=20) == 0
