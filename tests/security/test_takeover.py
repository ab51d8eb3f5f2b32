"""No job runs unauthenticated by accident (SECURITY.md, "A job started without a secret").

A 2-rank job on one node started without RINGWEAVE_SECRET, as srun, mpirun, torchrun or a user by
hand starts it. Its store port is public (srun: 15000 + the job id mod 10000), so another local user
(uid nobody, tests/security/stranger.py) binds it first and plays the job's rank 0 and store
(tests/security/impostor.py). The job's own rank 0 cannot host the store; its rank 1 must refuse
the impostor and never return a sum computed with the impostor's data. Before, rank 1 joined it
and returned 20 wrong sums in a row.
"""

from __future__ import annotations

import pytest

from tests.security.impostor import IMPOSTOR_VALUE, ROUNDS, free_job_number, impostor, run_job, wait_listening, \
    warm_up
from tests.security.jobutil import REPO
from tests.security.stranger import Stranger, needs_root

pytestmark = [needs_root, pytest.mark.timeout(90)]


@pytest.mark.parametrize("kind, guess", [("srun", None), ("mpirun", None), ("hand", None), ("torchrun", None),
                                         ("srun", "a-guessed-secret")])
def test_another_user_on_the_store_port_gets_nothing_from_a_job_without_a_secret(tmp_path, kind, guess):
    number = free_job_number()
    port = 15000 + number % 10000
    job = {"srun": f"slurm-{number}", "mpirun": f"mpi-{number}", "hand": "ringweave",
           "torchrun": f"torchrun-{number}"}[kind]
    warm_up()
    with Stranger(impostor, port, job, ROUNDS, guess) as attacker:
        wait_listening(attacker.pid, port)
        rank0, rank1 = run_job(kind, number, tmp_path, REPO)
        got = attacker.stop()
    honest = 1.0 + 2.0
    assert rank0["error"] == "ConnectError" and f"port {port}" in rank0["message"], rank0
    assert "sums" not in rank1, f"rank 1 all_reduced with the impostor: {rank1}"
    assert IMPOSTOR_VALUE + 2.0 not in rank1.get("sums", [honest]), rank1
    assert rank1["error"] == "AuthenticationError" and rank1["code"] != 0, rank1
    assert "store at 127.0.0.1" in rank1["message"], rank1
    assert got["listening"] and not got["joined"] and got["rounds"] == 0, got
