"""Where is a running job? What ``python -m tools.status`` (and any other tool) connects to.

First that applies wins:

1. flags: ``--master-addr H --master-port P`` (and ``--job ID``): the job's store;
2. ``--job ID`` that names a job file of our launcher on this machine (runtime/jobfile.py);
3. the environment, read as a rank reads it (runtime/scheduler.py): MASTER_ADDR /
   MASTER_PORT / RINGWEAVE_JOB, or what SLURM or Open MPI imply. Inside an allocation,
   ``srun --jobid=J --overlap -n 1 python -m tools.status`` finds job J's store from
   SLURM_JOB_ID alone (a one-task step runs on the job's first node, where the store is);
4. the newest job file of this user on this machine, with the others (``"others"``: the caller
   says which it shows, and how to ask for another).

Through the store, the world size and restart count come from the ``job/info`` key that
rank 0 sets (runtime/rendezvous.py). The secret comes from ``--secret-file`` or
``RINGWEAVE_SECRET``, else, for a job on this host started without one, from the file its
ranks derived it in (runtime/jobsecret.py).

Not here: asking the ranks anything (tools/status.py).
"""

from __future__ import annotations

import msgpack

from runtime import args as types
from runtime import auth, jobfile
from runtime.errors import RingweaveError
from runtime.init import read_env
from runtime.rendezvous import JOB_INFO_KEY
from runtime.store_main import read_secret_file
from runtime.store_tcp import TCPStore
from runtime import jobsecret


def add_arguments(p) -> None:
    """The flags above, on an argparse parser (``--job`` is the caller's)."""
    p.add_argument("--master-addr", default=None, help="the job's store host (default: MASTER_ADDR or the scheduler's)")
    p.add_argument("--master-port", type=types.port, default=None, help="the job's store port")
    p.add_argument("--secret-file", default=None, help="file holding the job's secret (default: RINGWEAVE_SECRET)")


def newest_job() -> dict:
    """The job file of this user's newest job on this machine, with ``"others"``: the files of
    the other jobs still running, newest first (the caller says which one it shows).

    Raises:
        FileNotFoundError: no job of this user runs on this machine.
    """
    jobs = jobfile.running()
    if not jobs:
        raise FileNotFoundError(f"no ringweave job files in {jobfile.job_dir()}: is a job running on this machine?")
    return dict(jobs[0], others=jobs[1:])


def _secret(path: str | None) -> str | None:
    """The secret of ``--secret-file`` (a private file of this user: runtime.store_main's rules),
    else RINGWEAVE_SECRET's, else None."""
    if path:
        return read_secret_file(path).decode()
    value = auth.secret_from_env()
    return value.decode() if value else None


async def locate(args, timeout_s: float, env=None) -> dict:
    """The job's info as tools/status.collect wants it: master_addr, master_port, job,
    secret, world_size, restart.

    Raises:
        FileNotFoundError: no flags, no job file and nothing in the environment names a job.
        RingweaveError: the store could not be reached, or holds no ``job/info`` (not a
            ringweave job, or one whose rank 0 has not joined yet).
    """
    placed = read_env(env)
    if args.master_addr is None and args.master_port is None:
        if args.job:
            try:
                return jobfile.find(args.job)
            except FileNotFoundError:  # not a job of our launcher here: maybe the environment names its store
                pass
        if placed["master_port"] is None:
            try:
                if args.job:
                    return jobfile.find(args.job)
                return newest_job()
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"{exc}; or give --master-addr and --master-port (the job's store), "
                                        f"or run where MASTER_PORT or a scheduler's variables name it") from None
    info = {"master_addr": args.master_addr or placed["master_addr"],
            "master_port": args.master_port if args.master_port is not None else placed["master_port"],
            "job": args.job or placed["job"], "secret": _secret(args.secret_file)}
    if info["master_port"] is None:
        raise RingweaveError("--master-addr without --master-port (or MASTER_PORT): the store's port is needed")
    if info["secret"] is None:  # a job started without one derived it, in a file of this user's on its host
        derived = jobsecret.lookup(info["job"], info["master_port"])
        info["secret"] = derived.decode() if derived else None
    secret = info["secret"].encode() if info["secret"] else None
    store = await TCPStore.connect(info["master_addr"], info["master_port"], secret=secret, job=info["job"],
                                   timeout_s=timeout_s, who={"tool": "locate"})
    try:
        job = msgpack.unpackb(await store.get(JOB_INFO_KEY, timeout_s))
    finally:
        await store.close()
    return dict(info, world_size=job["world_size"], restart=job["restart"])
