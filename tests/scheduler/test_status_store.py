"""python -m tools.status reaches a job that no launcher of ours started (srun, mpirun, by hand):
through its store, with the address and secret from flags or the environment."""

import json
import os
import subprocess

import pytest

from tests.scheduler.jobs import PYTHON, ROOT, free_port, kill_all, probe_reports, text_of, wait_for

pytestmark = pytest.mark.timeout(120)


def test_status_finds_ranks_started_by_hand_through_their_store(tmp_path):
    port, secret = free_port(), "status-test-secret"
    base = {k: v for k, v in os.environ.items()  # the suite's settings (tests/conftest.py) kept
            if k in ("RINGWEAVE_TUNE", "RINGWEAVE_WARMUP") or not k.startswith(("SLURM_", "OMPI_", "RINGWEAVE_", "MASTER_"))}
    base["XDG_RUNTIME_DIR"] = str(tmp_path)  # no job file to be found: only the store can answer
    log = tmp_path / "ranks.log"
    ranks = []
    with open(log, "w") as out:
        for r in range(2):
            ranks.append(subprocess.Popen(
                [PYTHON, str(ROOT / "tests/scheduler/probe.py"), "--wait"], cwd=ROOT, stdout=out,
                stderr=subprocess.STDOUT, env=dict(base, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=str(port),
                                                   RINGWEAVE_SECRET=secret, RINGWEAVE_JOB="by-hand")))
    try:
        wait_for(lambda: text_of(log).count("ready") == 2, 60, lambda: f"the ranks\n{text_of(log)}")

        def status(*flags, **env):
            return subprocess.run([PYTHON, "-m", "tools.status", "--json", "--timeout-s", "10", *flags], cwd=ROOT,
                                  env=dict(base, **env), capture_output=True, text=True, timeout=60)

        by_flags = status("--master-port", str(port), "--job", "by-hand", RINGWEAVE_SECRET=secret)
        assert by_flags.returncode == 0, by_flags.stderr
        assert [s["rank"] for s in json.loads(by_flags.stdout)] == [0, 1]
        secret_file = tmp_path / "secret"
        with os.fdopen(os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as f:
            f.write(secret + "\n")
        by_file = status("--master-addr", "127.0.0.1", "--master-port", str(port), "--job", "by-hand",
                         "--secret-file", str(secret_file))
        assert by_file.returncode == 0 and [s["rank"] for s in json.loads(by_file.stdout)] == [0, 1], by_file.stderr
        by_env = status(MASTER_PORT=str(port), RINGWEAVE_JOB="by-hand", RINGWEAVE_SECRET=secret)
        assert by_env.returncode == 0 and [s["rank"] for s in json.loads(by_env.stdout)] == [0, 1], by_env.stderr
        wrong = status("--master-port", str(port), "--job", "by-hand", RINGWEAVE_SECRET="not-it")
        assert wrong.returncode == 1 and "authentication failed" in wrong.stderr
        nothing = status()
        assert nothing.returncode == 1 and "--master-port" in nothing.stderr
    finally:
        pids = [r["pid"] for r in probe_reports(text_of(log))]
        for p in ranks:
            p.kill()
            p.wait()
        kill_all(pids)
