"""runtime.init under a scheduler's environment, without a scheduler: what must fail at once
fails at once with a message that says why, the thread variables a launcher implies are set,
and a rank whose launcher dies exits (whatever the launcher is)."""

import asyncio
import json
import os
import socket
import subprocess
import textwrap

import pytest

import runtime
from runtime import net, scheduler
from runtime.errors import ConnectError, RingweaveError
from tests.scheduler.jobs import PYTHON, ROOT, assert_ranks_die_with, free_port, text_of

pytestmark = pytest.mark.timeout(60)
NO_SUCH_HOST = "ringweave-no-such-host.invalid"
# The suite's own settings (tests/conftest.py), kept where a test clears the launchers' variables: with
# RINGWEAVE_WARMUP unset, init compiles every kernel (a minute on a loaded machine, in the test's
# process, whose event loop then waits for it to close).
SUITE_SETTINGS = ("RINGWEAVE_TUNE", "RINGWEAVE_WARMUP")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables of the test's own environment; the parent not watched (these ranks
    live inside pytest)."""
    for name in list(os.environ):
        if name in SUITE_SETTINGS:
            continue
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MASTER_", "RINGWEAVE_")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RINGWEAVE_WATCH_PARENT", "0")
    for name in scheduler.THREAD_VARS:  # set: init leaves them (and this process's BLAS) alone
        monkeypatch.setenv(name, os.environ.get(name) or "1")
    monkeypatch.setenv("RINGWEAVE_TIMEOUT_S", "20")  # the old behaviour (a wait) fails in 20 s, not 300
    return monkeypatch


def _permanent_dns_failure() -> bool:
    try:
        socket.getaddrinfo(NO_SUCH_HOST, None)
    except socket.gaierror as exc:
        return exc.errno in net.PERMANENT_DNS_ERRORS
    return False


async def test_a_batch_script_without_srun_is_told_so_at_once(clean_env):
    for name, value in {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
                        "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "n1"}.items():
        clean_env.setenv(name, value)
    with pytest.raises(RingweaveError, match="batch script of SLURM job 9, not a task that srun started"):
        await asyncio.wait_for(runtime.init(), 10)


async def test_a_master_addr_that_does_not_resolve_fails_at_once_naming_its_source(clean_env):
    if not _permanent_dns_failure():
        pytest.skip(f"{NO_SUCH_HOST!r} does not fail as a permanent DNS error here (no resolver answer)")
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": NO_SUCH_HOST,
                        "MASTER_PORT": str(free_port())}.items():
        clean_env.setenv(name, value)
    with pytest.raises(RingweaveError, match=f"MASTER_ADDR '{NO_SUCH_HOST}' \\(MASTER_ADDR\\) does not resolve"):
        await asyncio.wait_for(runtime.init(), 10)
    with pytest.raises(ConnectError, match="does not resolve .*not retried"):  # and any connect, e.g. a tool's
        await asyncio.wait_for(net.connect(NO_SUCH_HOST, 1, timeout_s=20), 10)


async def test_a_taken_store_port_is_an_error_naming_the_port_and_where_it_came_from(clean_env):
    """Rank 0 of SLURM job J hosts the store on 15000 + J mod 10000; another program holds it."""
    with socket.socket() as holder:
        for port in range(scheduler.PORT_BASE + 4242, scheduler.PORT_BASE + scheduler.PORT_SPAN):
            try:
                holder.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        holder.listen()
        job = port - scheduler.PORT_BASE
        for name, value in {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                            "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
                            "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_NUM_NODES": "1"}.items():
            clean_env.setenv(name, value)
        with pytest.raises(ConnectError, match=f"port {port} \\(from SLURM_JOB_ID={job}: 15000 \\+ id mod 10000\\) "
                                               f"is in use"):
            await asyncio.wait_for(runtime.init(), 10)


def test_an_srun_task_gets_the_thread_variables_and_its_loaded_blas_is_limited():
    """`srun -n 1 -c 1` (SLURM_CPUS_PER_TASK=1): numpy's BLAS, loaded before init with as many
    threads as cores, runs with 1 after it; the variables are set for what loads later."""
    code = textwrap.dedent("""
        import json, os
        import numpy
        from threadpoolctl import threadpool_info
        import runtime
        before = sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        async def main():
            rt = await runtime.init()
            await runtime.shutdown(rt)
        runtime.run(main())
        print(json.dumps({"before": before, "after": sorted({i["num_threads"] for i in threadpool_info()
                                                              if i["user_api"] == "blas"}),
                          "vars": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                                  "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS") and not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="5", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0",
               SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="1", SLURM_STEP_NODELIST="n1", SLURM_CPUS_PER_TASK="1")
    out = subprocess.run([PYTHON, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["vars"] == dict.fromkeys(got["vars"], "1")
    assert got["after"] == [1], got
    if len(os.sched_getaffinity(0)) > 1:
        assert got["before"][0] > 1, got  # OpenBLAS started with a thread per core: the limit did something


LAUNCHER = textwrap.dedent("""
    # A launcher of our own making: starts two ranks, says so, and sleeps.
    import os, subprocess, sys, time
    port, probe = sys.argv[1], sys.argv[2]
    for r in range(2):
        subprocess.Popen([sys.executable, probe, "--wait"], stdout=sys.stdout, stderr=sys.stderr,
                         env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port))
    time.sleep(120)
""")


def test_ranks_exit_within_seconds_of_any_sigkilled_launcher(tmp_path):
    """Not our launcher, not mpirun: any parent. Its ranks notice it died and exit."""
    script, log = tmp_path / "launcher.py", tmp_path / "run.log"
    script.write_text(LAUNCHER)
    env = {k: v for k, v in os.environ.items()
           if k in SUITE_SETTINGS or not k.startswith(("SLURM_", "OMPI_", "RINGWEAVE_", "MASTER_"))}
    pid = assert_ranks_die_with([PYTHON, str(script), str(free_port()), str(ROOT / "tests/scheduler/probe.py")], log,
                                2, cwd=ROOT, env=env)
    # the first rank to notice says so and exits; the other may notice, or lose its peer first
    assert f"its launcher (pid {pid}, python) is gone; exiting" in text_of(log)
