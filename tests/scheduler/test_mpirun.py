"""Under Open MPI's mpirun (4.1, Debian's openmpi-bin): the README's train-mpi.sh as written,
stopped by SIGUSR1 and run again to the uninterrupted result; a two-node layout (the second
node's daemon started through a stand-in for ssh) where the store is hosted by the first rank
on mpirun's host; ranks that exit within seconds of a SIGKILLed mpirun. Skipped, saying why,
where mpirun is not installed (``make mpi``)."""

import os
import shutil
import signal
import socket
import subprocess

import pytest

from tests.scheduler.jobs import PREEMPT_ENV, ROOT, TRAIN_ARGS, VENV_BIN, assert_ranks_die_with, assert_same_run, \
    load_run, probe_reports, recipe, run_until_signalled

pytestmark = pytest.mark.timeout(300)
PROBE = str(ROOT / "tests" / "scheduler" / "probe.py")


def _open_mpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun is not installed: `make mpi` installs Open MPI with apt"
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" not in out.stdout + out.stderr:
        return f"mpirun is not Open MPI's: {out.stdout.strip()[:80]!r}"
    return None


@pytest.fixture(scope="module")
def mpi_env():
    missing = _open_mpi_missing()
    if missing:
        pytest.skip(missing)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_"))}
    # As the README says: root must allow mpirun to run as root.
    return dict(env, **PREEMPT_ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}")


def test_train_mpi_sh_stopped_by_usr1_and_run_again_equals_an_uninterrupted_run(mpi_env, tmp_path, reference_run):
    script, log, ckpt = tmp_path / "train-mpi.sh", tmp_path / "run.log", tmp_path / "ckpt"
    script.write_text(recipe("mpirun"))
    cmd = ["bash", str(script), "-np", "2", "--", *TRAIN_ARGS, "--checkpoint-dir", str(ckpt),
           "--json", str(tmp_path / "run.json")]
    # the script exec'd mpirun, which forwards SIGUSR1 to every rank
    run_until_signalled(cmd, log, lambda job: job.send_signal(signal.SIGUSR1), 128 + signal.SIGUSR1,
                        cwd=tmp_path, env=mpi_env)
    again = subprocess.run(cmd, cwd=tmp_path, env=mpi_env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resumed from" in again.stderr
    assert_same_run(reference_run(2), load_run(tmp_path / "run.json", ckpt))


def test_two_nodes_the_store_is_hosted_on_mpiruns_host_whatever_rank_runs_there(mpi_env, tmp_path):
    """`mpirun --host n2:2,<this host>:2`: ranks 0 and 1 on "n2" (under an orted that a stand-in for
    ssh starts here), ranks 2 and 3 on mpirun's host: rank 2 hosts the store, at mpirun's address."""
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text('#!/bin/sh\n# ssh HOST COMMAND: run COMMAND here\nwhile [ "${1#-}" != "$1" ]; do shift; done\n'
                        'shift\nexec /bin/sh -c "$*"\n')
    fake_ssh.chmod(0o700)
    here = socket.gethostname().split(".")[0]
    rankfile = tmp_path / "rankfile"  # mpirun would put ranks 0 and 1 on its own host first
    rankfile.write_text(f"rank 0=n2 slot=0\nrank 1=n2 slot=1\nrank 2={here} slot=0\nrank 3={here} slot=1\n")
    out = subprocess.run(["mpirun", "-np", "4", "--host", f"n2:2,{here}:2", "--rankfile", str(rankfile),
                          "--mca", "plm_rsh_agent", str(fake_ssh),
                          "-x", "RINGWEAVE_SECRET", "-x", "PATH", "python", PROBE], cwd=tmp_path, timeout=120,
                         env=dict(mpi_env, RINGWEAVE_SECRET="two-node-test"), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ranks = probe_reports(out.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and {r["sum"] for r in ranks} == {6}
    assert [(r["local_rank"], r["local_world_size"]) for r in ranks] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["hosts_store"] for r in ranks] == [False, False, True, False]
    assert len({r["master_addr"] for r in ranks}) == 1 and "OMPI_MCA_orte_hnp_uri" in ranks[0]["master_addr_source"]
    assert len({r["master_port"] for r in ranks}) == 1 and ranks[0]["job"].startswith("mpi-")
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert all(set(r["threads"].values()) == {threads} for r in ranks)


def test_ranks_exit_within_seconds_of_a_sigkilled_mpirun(mpi_env, tmp_path):
    assert_ranks_die_with(["mpirun", "-np", "2", "python", PROBE, "--wait"], tmp_path / "run.log", 2, cwd=tmp_path,
                          env=mpi_env)
