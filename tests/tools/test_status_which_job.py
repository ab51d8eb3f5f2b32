"""``python -m tools.status`` without ``--job`` says which job it shows: this user's only job on
this machine, or the newest of several, listing the others with the command that shows each.
Job files of live launchers (this test's own pid stands in for them) in a private directory;
the ranks' answers are canned (tests/tools/test_status_and_trace.py asks real ranks)."""

from __future__ import annotations

import json
import os
import time

import pytest

from runtime import jobfile
from tools import status

pytestmark = pytest.mark.timeout(10)
CANNED = [{"rank": 0, "calls": []}, {"rank": 1, "calls": []}]


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    for name in ("MASTER_ADDR", "MASTER_PORT", "RINGWEAVE_JOB", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    shown = []

    async def collect(info, timeout_s):
        shown.append(info["job"])
        return CANNED

    monkeypatch.setattr(status, "collect", collect)

    def start(job, started_at, world_size=2):
        jobfile.write(job, {"master_addr": "127.0.0.1", "master_port": 1, "secret": "s", "restart": 0,
                            "world_size": world_size, "launcher_pid": os.getpid(), "started_at": started_at})
    return start, shown


def test_the_only_job_is_shown_and_named(jobs, capsys):
    start, shown = jobs
    start("job-mine", 1000.0)
    assert status.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("job job-mine (2 ranks, started ") and out[0].endswith(
        "): the only job of this user on this machine"), out
    assert out[1:] == ["rank 0: no collective in flight", "rank 1: no collective in flight"] and shown == ["job-mine"]


def test_several_jobs_are_listed_and_the_newest_shown_saying_so(jobs, capsys):
    start, shown = jobs
    start("job-old", 1000.0, world_size=4)
    start("job-new", 2000.0)
    start("job-mid", 1500.0, world_size=8)
    assert status.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert shown == ["job-new"]
    assert out[0].startswith("job job-new (2 ranks") and out[0].endswith(
        "the newest of 3 jobs of this user on this machine; the others:"), out
    assert out[1].startswith("  job job-mid (8 ranks") and out[1].endswith("python -m tools.status --job job-mid")
    assert out[2].startswith("  job job-old (4 ranks") and out[2].endswith("python -m tools.status --job job-old")


def test_a_named_job_is_shown_under_its_name_and_json_stays_a_list(jobs, capsys):
    start, shown = jobs
    start("job-a", 1000.0)
    start("job-b", 2000.0)
    assert status.main(["--job", "job-a"]) == 0
    started = time.strftime("%H:%M:%S", time.localtime(1000.0))
    assert capsys.readouterr().out.splitlines()[0] == f"job job-a (2 ranks, started {started})"
    assert status.main(["--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == CANNED and shown == ["job-a", "job-b"]
    assert "the newest of 2 jobs" in captured.err  # which one, beside the JSON


@pytest.mark.parametrize("how", ["group-readable", "a link"])
def test_a_secret_file_others_could_read_or_a_link_is_refused(jobs, tmp_path, capsys, how):
    """``--secret-file`` is held to the store's rules (a 0600 file of this user, not a link): the
    command refuses the file, saying which and why, and connects to nothing."""
    start, shown = jobs
    start("job-a", 1000.0)
    real = tmp_path / "secret"
    real.write_text("s\n")
    os.chmod(real, 0o640 if how == "group-readable" else 0o600)
    given = real
    if how == "a link":
        given = tmp_path / "link"
        given.symlink_to(real)
    assert status.main(["--job", "job-a", "--master-port", "1", "--secret-file", str(given)]) == 1
    err = capsys.readouterr().err
    assert str(given) in err and shown == [], err
