"""Under a real SLURM (22.05, Debian's packages; a private two-node cluster on this machine,
tests/scheduler/slurm_cluster.py): the README's srun line and sbatch script as written, a
preemption with requeue and resume, a two-node step with uneven tasks per node, a killed
rank, tools.status through the store, and a batch script that runs Python without srun.
Skipped, saying why, where SLURM is not installed (``make slurm``)."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.scheduler.jobs import FINAL_STEP, PREEMPT_ENV, ROOT, TRAIN_ARGS, alive, assert_same_run, kill_all, \
    load_run, probe_reports, recipe, text_of, wait_for

pytestmark = pytest.mark.timeout(300)
PROBE = str(ROOT / "tests" / "scheduler" / "probe.py")
# The tests wait for step-00000020 to appear: kept, it cannot be rotated away (keep_last) between
# two polls of a loaded machine, where a run's later steps take well under a millisecond.
KEEP_ALL = ["--keep-last", "1000"]


def test_srun_n4_runs_the_main_job_as_four_ranks(slurm, tmp_path, reference_run):
    """The README's `srun -n 4 python -m trainer`: no MASTER_ADDR, MASTER_PORT or secret set by hand."""
    cmd = recipe("srun").split() + TRAIN_ARGS + ["--checkpoint-dir", str(tmp_path / "ckpt"),
                                                 "--json", str(tmp_path / "run.json")]
    out = slurm.run(cmd, timeout=180, cwd=tmp_path)
    assert "== ddp on 4 rank(s)" in out.stdout
    assert_same_run(reference_run(4), load_run(tmp_path / "run.json", tmp_path / "ckpt"))


def test_sbatch_preempted_by_usr1_requeues_and_resumes_to_the_uninterrupted_result(slurm, tmp_path, reference_run):
    """The README's sbatch script (submitted with --ntasks=2, which wins over its #SBATCH line):
    SIGUSR1 to the job's tasks mid-training (what --signal=USR1@120 sends before the time limit)
    -> every rank checkpoints, srun exits 138, the script requeues the job, and its second run
    resumes and ends bit for bit where an uninterrupted run ends."""
    script, out = tmp_path / "train.sbatch", tmp_path / "job.out"
    script.write_text(recipe("sbatch"))
    ckpt = tmp_path / "ckpt"
    job = slurm.run(["sbatch", "--parsable", "--ntasks=2", "-o", str(out), "-D", str(tmp_path), str(script),
                     *TRAIN_ARGS, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20", *KEEP_ALL,
                     "--json", str(tmp_path / "run.json")], env=dict(slurm.env, **PREEMPT_ENV)).stdout.strip()
    # srun holds the tasks' output back a while; the first periodic checkpoint says training is under way
    wait_for(lambda: (ckpt / "step-00000020").exists(), 120, lambda: f"job {job} to train\n{text_of(out)[-2000:]}\n{slurm.state()}")
    slurm.run(["scancel", "--signal=USR1", job])
    info = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 180)
    log = text_of(out)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert "stopped by SIGUSR1 at a step boundary every rank agreed on, checkpoint saved; exit code 138" in log
    assert "resumed from" in log
    assert (ckpt / FINAL_STEP).is_dir()
    assert_same_run(reference_run(2), load_run(tmp_path / "run.json", ckpt))


def test_scancel_saves_a_checkpoint_before_the_job_ends(slurm, tmp_path):
    """scancel sends the tasks SIGTERM (SIGKILL KillWait seconds later): the ranks agree on a step,
    save it, and exit 143 instead of dying with whatever they had saved before."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "srun.out"
    with open(log, "w") as f:
        srun = subprocess.Popen(["srun", "-n", "2", "python", "-m", "trainer", *TRAIN_ARGS, "--checkpoint-dir",
                                 str(ckpt), "--checkpoint-every", "20", *KEEP_ALL], env=dict(slurm.env, **PREEMPT_ENV),
                                cwd=tmp_path, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (ckpt / "step-00000020").exists(), 120, lambda: f"training\n{text_of(log)[-2000:]}\n{slurm.state()}")
        job = slurm.run(["squeue", "-h", "-o", "%i"]).stdout.split()
        assert len(job) == 1
        slurm.run(["scancel", job[0]])
        srun.wait(timeout=120)
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait()
    assert "stopped by SIGTERM at a step boundary every rank agreed on, checkpoint saved; exit code 143" in \
        text_of(log), text_of(log)[-3000:]
    saved = sorted(p.name for p in ckpt.glob("step-*"))
    assert "step-00000020" < saved[-1] < FINAL_STEP, saved


def test_two_nodes_with_uneven_tasks_find_the_first_node_local_sizes_and_threads(slurm, tmp_path):
    """`srun -N 2 -n 3 -c 3`: tasks 0, 1 on n1 and task 2 on n2 (SLURM_TASKS_PER_NODE=2,1); the
    store on n1 (a name that does not resolve here: SLURM's NodeAddr for it), 3 threads each."""
    out = slurm.run(["srun", "-N", "2", "-n", "3", "-c", "3", "python", PROBE], timeout=120, cwd=tmp_path,
                    env=dict(slurm.env, RINGWEAVE_SECRET="two-node-test"))
    ranks = probe_reports(out.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2] and {r["sum"] for r in ranks} == {3}
    assert [(r["node"], r["local_rank"], r["local_world_size"]) for r in ranks] == [
        ("n1", 0, 2), ("n1", 1, 2), ("n2", 0, 1)]
    assert {r["master_addr"] for r in ranks} == {"n1"}
    assert "SLURM_STEP_NODELIST='n[1-2]'" in ranks[0]["master_addr_source"]
    assert [r["hosts_store"] for r in ranks] == [True, False, False]
    assert len({r["master_port"] for r in ranks}) == 1 and {r["job"] for r in ranks} == {ranks[0]["job"]}
    for r in ranks:
        assert set(r["threads"].values()) == {"3"}, r


def test_a_killed_rank_ends_the_step_and_tools_status_finds_the_job_through_its_store(slurm, tmp_path):
    """While `srun -n 2` ranks wait, `srun --overlap python -m tools.status` (no job file, no
    flags: SLURM's variables) asks both; then one rank is SIGKILLed: the other raises
    PeerLostError, srun ends, and no process of the job is left."""
    log = tmp_path / "srun.out"
    with open(log, "w") as f:
        srun = subprocess.Popen(["srun", "-n", "2", "python", PROBE, "--wait"], env=slurm.env, cwd=tmp_path,
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: text_of(log).count("ready") == 2, 120, lambda: f"the ranks\n{text_of(log)}\n{slurm.state()}")
        ranks = probe_reports(text_of(log))
        job = ranks[0]["job"].split("-")[1]
        status = slurm.run(["srun", f"--jobid={job}", "--overlap", "-n", "1", "python", "-m", "tools.status",
                            "--json"], timeout=60, cwd=ROOT)
        assert [s["rank"] for s in json.loads(status.stdout)] == [0, 1]
        victim = next(r["pid"] for r in ranks if r["rank"] == 1)
        os.kill(victim, signal.SIGKILL)
        assert srun.wait(timeout=60) != 0
        assert "PeerLostError" in text_of(log) and "rank 1" in text_of(log)
        left = [r["pid"] for r in ranks if alive(r["pid"])]
        assert not left, f"ranks {left} outlived their step"
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait()
        kill_all(r["pid"] for r in probe_reports(text_of(log)))


def test_python_in_the_batch_script_without_srun_is_told_so_at_once(slurm, tmp_path):
    """sbatch --ntasks=2 running the trainer directly: SLURM_PROCID=0 SLURM_NTASKS=2 but no srun."""
    out = tmp_path / "job.out"
    job = slurm.run(["sbatch", "--parsable", "--ntasks=2", "-o", str(out), "-D", str(tmp_path), "--wrap",
                     "python -m trainer --epochs 1"]).stdout.strip()
    started = time.monotonic()
    info = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
    assert info["JobState"] == "FAILED" and time.monotonic() - started < 60
    assert f"batch script of SLURM job {job}, not a task that srun started" in text_of(out)
