"""The takeover of a job started without a secret, for tests/security/test_takeover.py and
``bench/security.py takeover``: another local user binds the job's store port before the job
does and plays its rank 0 and its store; the job's own rank 0 fails (the port is taken) and
the question is what its other ranks do.

    port, env = launcher_env("srun", job_number)      # what srun / mpirun / a user would set
    with Stranger(impostor, port, job, ROUNDS, None) as attacker:   # as uid nobody
        wait_listening(attacker.pid, port)
        ranks = run_job(env, tmp_path)                # the job's ranks 0 and 1, as processes
    attacker.result                                   # {"joined": ..., "rounds": ...}

The impostor runs no ringweave launcher: a store server and a rank 0 of its own making, with no
secret (or a guessed one), and all_reduces ``IMPOSTOR_VALUE`` with whoever joins it.

Not here: what must happen (the tests and the benchmark say that).
"""

from __future__ import annotations

import asyncio
import encodings.idna  # noqa: F401 - loaded here: the impostor, a fork as nobody, may not read the stdlib's files
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

import collectives
import runtime
from runtime import scheduler
from runtime.store_server import StoreServer
from runtime.store_tcp import TCPStore
from tests.security.netutil import listening
from tests.security.stranger import Stopped

ROUNDS = 20                # the all_reduces the job's ranks run
IMPOSTOR_VALUE = 1000.0    # what the impostor contributes; a rank r contributes r + 1

# A rank of the job: joins, runs ROUNDS all_reduces of r + 1, prints one JSON line (its sums, or
# the error that stopped it).
RANK = r'''
import asyncio, json, sys
import numpy as np
import collectives, runtime

async def main():
    try:
        rt = await runtime.init()
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return 3
    sums = []
    for _ in range(int(sys.argv[1])):
        x = np.full(4, float(rt.rank + 1))
        await collectives.all_reduce(x)
        sums.append(float(x[0]))
    print(json.dumps({"sums": sums}), flush=True)
    await runtime.shutdown(rt)
    return 0

sys.exit(asyncio.run(main()))
'''

_SCRUBBED = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MASTER_", "RINGWEAVE_")


def free_job_number(start: int = 4242) -> int:
    """A job number whose derived store port (15000 + n mod 10000) nobody listens on now."""
    import socket
    for n in range(start, start + scheduler.PORT_SPAN):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", scheduler.derived_port(n)))
                return n
            except OSError:
                continue
    raise RuntimeError("no free derived port")


def launcher_env(kind: str, number: int, rank: int, base: dict | None = None) -> tuple[int, str, dict]:
    """(store port, job name, environment) of rank ``rank`` of a 2-rank job on this node as
    ``kind`` starts it: "srun" (SLURM job ``number``, step 0), "mpirun" (Open MPI job id
    ``number``), "hand" (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT) or "torchrun" (its
    variables, our store's port given by RINGWEAVE_STORE_PORT). No secret."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(_SCRUBBED) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    port = scheduler.derived_port(number)
    if kind == "srun":
        env.update(SLURM_JOB_ID=str(number), SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_NTASKS="2",
                   SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2",
                   SLURM_STEP_NODELIST="n1", SLURM_STEP_NUM_NODES="1", SLURM_JOB_NODELIST="n1")
        job = f"slurm-{number}"
    elif kind == "mpirun":
        env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                   OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_ess_base_jobid=str(number))
        job = f"mpi-{number}"
    elif kind == "hand":
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        job = "ringweave"
    elif kind == "torchrun":  # a worker of torchrun --standalone: MASTER_PORT is torchrun's own store's
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                   MASTER_ADDR="localhost", MASTER_PORT="1", TORCHELASTIC_RUN_ID=str(number),
                   RINGWEAVE_STORE_PORT=str(port))
        job = f"torchrun-{number}"
    else:
        raise ValueError(f"kind must be srun, mpirun, hand or torchrun, not {kind!r}")
    env.update(RINGWEAVE_WATCH_PARENT="0", RINGWEAVE_TIMEOUT_S="20")
    return port, job, env


async def _play_rank(rank: int, port: int, job: str, key: bytes | None, rounds: int, value: float,
                     state: dict) -> None:
    """Joins the store at ``port`` as ``rank`` of 2 (no launcher, no derived secret: ``key`` as
    given) and all_reduces ``value`` ``rounds`` times."""
    client = await TCPStore.connect("127.0.0.1", port, secret=key, job=job, timeout_s=60, who={"rank": rank})
    try:
        rt = await runtime.init(rank, 2, store=client, secret=key, job=job, timeout_s=60)
        state["joined"] = True
        for _ in range(rounds):
            x = np.full(4, value)
            await collectives.all_reduce(x)
            state["rounds"] += 1
        await runtime.shutdown(rt)
    finally:
        await client.close()


def warm_up() -> None:
    """Runs what the impostor runs, once, in this process (both ranks, on a store of its own):
    every module and kernel it needs is then loaded before a fork drops to a user that may not
    read them."""
    if _warm:
        return

    async def main():
        server = await StoreServer("127.0.0.1", 0, secret=b"warm", job="warm").start()
        try:
            await asyncio.gather(*(_play_rank(r, server.port, "warm", b"warm", 2, 1.0, {"rounds": 0})
                                   for r in range(2)))
        finally:
            await server.close()

    with mock.patch.dict(os.environ, {"RINGWEAVE_SHM": "0"}):  # as the impostor runs: over TCP
        asyncio.run(main())
    _warm.append(True)


_warm: list[bool] = []


def impostor(port: int, job: str, rounds: int, secret: str | None) -> dict:
    """As the other user: hosts a store on ``port`` for ``job`` (with ``secret``: None, or a
    guess) and joins it as rank 0 of 2, then all_reduces IMPOSTOR_VALUE ``rounds`` times with
    whoever comes as rank 1. Runs until done or stopped; returns what happened. Call
    :func:`warm_up` in the parent first."""
    state = {"listening": False, "joined": False, "rounds": 0, "error": None}
    key = secret.encode() if secret else None
    os.environ["RINGWEAVE_SHM"] = "0"  # no shared memory: the job's rank 1 could not map ours, nor we its

    async def main():
        server = StoreServer("127.0.0.1", port, secret=key, job=job)
        await server.start()
        state["listening"] = True
        try:
            await _play_rank(0, port, job, key, rounds, IMPOSTOR_VALUE, state)
        finally:
            await server.close()

    try:
        asyncio.run(main())
    except Stopped:
        pass
    except Exception as exc:  # noqa: BLE001 - the caller reads it
        state["error"] = f"{type(exc).__name__}: {exc}"
    return state


def wait_listening(pid: int, port: int, timeout_s: float = 20) -> None:
    """Until process ``pid`` listens on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout_s
    while f"127.0.0.1:{port}" not in listening(pid):
        if time.monotonic() > deadline or _exited(pid):
            raise AssertionError(f"the impostor (pid {pid}) did not listen on port {port}")
        time.sleep(0.02)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def run_job(kind: str, number: int, directory: Path, repo: Path, rounds: int = ROUNDS,
            timeout_s: float = 60) -> list[dict]:
    """Starts the job's ranks 0 and 1 (code of ``repo``) as ``kind`` would and waits; returns each
    rank's JSON line (``{"sums": [...]}`` or ``{"error", "message"}``) plus its exit code."""
    script = directory / "rank.py"
    script.write_text(RANK)
    procs = []
    for rank in range(2):
        _, _, env = launcher_env(kind, number, rank)
        env["PYTHONPATH"] = str(repo)
        procs.append(subprocess.Popen([sys.executable, str(script), str(rounds)], cwd=str(repo), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        got = json.loads(lines[-1]) if lines else {"error": "no result", "message": stderr[-2000:]}
        out.append(dict(got, code=p.returncode))
    return out
