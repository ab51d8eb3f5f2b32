"""The job file holds the job's secret: no other local user may read it, plant it or swap it,
and it does not outlive its launcher (SECURITY.md, "The job file").

The attacker is uid nobody (tests/security/stranger.py) on the same machine, without
XDG_RUNTIME_DIR, so the job files live in the shared temporary directory.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from runtime import errors, jobfile
from tests.security.stranger import as_stranger, needs_root

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cret-" + "ab" * 28


@pytest.fixture
def shared_tmp(monkeypatch):
    """A temporary directory like /tmp (mode 1777: everyone may create in it), used as the
    system temporary directory, with XDG_RUNTIME_DIR unset."""
    base = tempfile.mkdtemp(prefix="rw-shared-", dir="/tmp")
    os.chmod(base, 0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", base)
    yield Path(base)
    subprocess.run(["rm", "-rf", base], check=False)


def _plant(d: str, names: list[str]) -> None:
    """As the stranger: the job files' directory, open to all, with files waiting to be written."""
    os.mkdir(d)
    os.chmod(d, 0o777)
    for name in names:
        fd = os.open(os.path.join(d, name), os.O_CREAT | os.O_WRONLY, 0o666)
        os.fchmod(fd, 0o666)
        os.close(fd)


def _read_all(d: str) -> dict[str, str]:
    """As the stranger: everything it can read in the directory."""
    out = {}
    for name in os.listdir(d):
        try:
            with open(os.path.join(d, name)) as f:
                out[name] = f.read()
        except OSError as exc:
            out[name] = f"<{type(exc).__name__}>"
    return out


@needs_root
def test_a_stranger_who_made_the_directory_reads_no_secret(shared_tmp):
    """Another user makes ``ringweave-<uid>`` (0777) and plants the temporary file names the
    launcher would use; the launcher must refuse the directory, and nothing in it may hold the
    secret. (Before: the planted 0666 ``<job>.json.tmp`` was truncated, filled and renamed.)"""
    d = jobfile.job_dir()
    job = "job-0123456789ab"
    as_stranger(_plant, d, [f"{job}.json.tmp", f"{job}.json"])
    refused = None
    try:
        jobfile.write(job, {"secret": SECRET, "launcher_pid": os.getpid()})
    except errors.RingweaveError as exc:
        refused = exc
    seen = as_stranger(_read_all, d)
    assert not any(SECRET in text for text in seen.values()), seen
    assert type(refused).__name__ == "JobFileError" and "belongs to uid" in str(refused), refused
    with pytest.raises(errors.RingweaveError, match="belongs to uid"):  # tools.status will not trust it
        jobfile.find(job)


def test_a_directory_others_may_enter_or_a_link_is_refused(shared_tmp):
    d = Path(jobfile.job_dir())
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(errors.RingweaveError, match="mode 0755"):
        jobfile.write("j", {"secret": SECRET})
    assert os.listdir(d) == []
    d.rmdir()
    real = shared_tmp / "elsewhere"
    real.mkdir(mode=0o700)
    d.symlink_to(real)
    with pytest.raises(errors.RingweaveError, match="symbolic link"):
        jobfile.write("j", {"secret": SECRET})
    assert os.listdir(real) == []


def test_the_file_is_ours_alone_and_written_without_following_links(shared_tmp):
    path = jobfile.write("j/../x", {"secret": SECRET, "launcher_pid": os.getpid()})
    d = jobfile.job_dir()
    assert path == os.path.join(d, "j_.._x.json")  # the job id cannot name another place
    st_dir, st_file = os.stat(d), os.stat(path)
    assert stat.S_IMODE(st_dir.st_mode) == 0o700 and st_dir.st_uid == os.geteuid()
    assert stat.S_IMODE(st_file.st_mode) == 0o600 and st_file.st_uid == os.geteuid()
    assert jobfile.find("j/../x")["secret"] == SECRET
    assert sorted(os.listdir(d)) == ["j_.._x.json"]  # no temporary file left behind
    os.unlink(path)
    os.symlink("/etc/hostname", path)  # a link where the file should be: read it, never follow it
    with pytest.raises(errors.RingweaveError):
        jobfile.find("j/../x")


def test_the_file_of_a_sigkilled_launcher_is_removed(shared_tmp):
    """A launcher killed with SIGKILL cannot remove its file; the next launcher (write) and
    tools.status (find) do, knowing from the pid and start time it records that it is gone."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(shared_tmp))
    env.pop("XDG_RUNTIME_DIR", None)
    script = shared_tmp / "rank.py"  # dies with its launcher (PR_SET_PDEATHSIG), as a rank does
    script.write_text("import time\nfrom runtime.init import die_with_launcher\ndie_with_launcher()\ntime.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "runtime.launch", "-n", "1", "--job-id", "killed",
                                 str(script)], cwd=str(REPO), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        path = Path(jobfile.job_dir()) / "killed.json"
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline and launcher.poll() is None, "the launcher wrote no job file"
            time.sleep(0.05)
        assert jobfile.find("killed")["launcher_pid"] == launcher.pid
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert path.exists()  # nobody removed it
    with pytest.raises(FileNotFoundError):
        jobfile.find("killed")
    assert not path.exists()
    # a file whose pid is running but is another process (the pid was used again) goes too
    jobfile.write("reused", {"secret": SECRET, "launcher_pid": os.getpid(), "launcher_start": 1})
    jobfile.write("next", {"secret": SECRET, "launcher_pid": os.getpid()})
    assert sorted(os.listdir(jobfile.job_dir())) == ["next.json"]


def test_an_xdg_runtime_dir_that_names_no_directory_falls_back_to_the_temporary_directory(shared_tmp, monkeypatch):
    """srun exports the login node's XDG_RUNTIME_DIR to compute nodes that have none: the job
    files (and a derived job secret) then live under the temporary directory, not nowhere."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared_tmp / "run-user-0-on-the-login-node"))
    assert jobfile.job_dir() == os.path.join(str(shared_tmp), f"ringweave-{os.getuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared_tmp))
    assert jobfile.job_dir() == os.path.join(str(shared_tmp), f"ringweave-{os.getuid()}")
