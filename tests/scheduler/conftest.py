"""Fixtures of the scheduler tests: an uninterrupted reference run per world size (shared by
the preemption tests under our launcher, SLURM and mpirun), and a private SLURM cluster
(tests/scheduler/slurm_cluster.py)."""

import subprocess

import pytest

from tests.scheduler.jobs import PYTHON, ROOT, TRAIN_ARGS, load_run
from tests.scheduler.slurm_cluster import SlurmCluster, slurm_missing

_references: dict[int, dict] = {}


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """reference_run(n): the training run of TRAIN_ARGS on n ranks under our launcher, never
    interrupted (jobs.load_run's dict), made once per n."""
    def make(n: int) -> dict:
        if n not in _references:
            d = tmp_path_factory.mktemp(f"reference{n}")
            out = subprocess.run([PYTHON, "-m", "runtime.launch", "-n", str(n), "-m", "trainer", *TRAIN_ARGS,
                                  "--checkpoint-dir", str(d / "ckpt"), "--json", str(d / "run.json"), "--quiet"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=180)
            assert out.returncode == 0, out.stderr[-3000:]
            _references[n] = load_run(d / "run.json", d / "ckpt")
        return _references[n]
    return make


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A SLURM cluster of two nodes (n1, n2; slurmctld, two slurmd and munged on this machine,
    private config and ports), or a skip naming what is missing."""
    missing = slurm_missing()
    if missing:
        pytest.skip(missing)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
