"""Where a running job can be found by tools on the same machine.

The launcher of the node that hosts the store writes
``<runtime dir>/ringweave-<uid>/<job>.json`` (mode 0600: it holds the secret)
with the store's address, the job id, the world size and the current restart,
and removes it when the job ends. ``python -m tools.status`` reads it to ask
every rank what it is doing. The runtime dir is ``$XDG_RUNTIME_DIR`` or the
system temporary directory.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile


def job_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"ringweave-{os.getuid()}")


def path(job: str) -> str:
    """Where the file of job ``job`` is (whether or not it exists)."""
    return os.path.join(job_dir(), f"{job}.json")


def write(job: str, info: dict) -> str:
    """Writes (atomically, 0600) and returns the job file's path."""
    d = job_dir()
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(d, f"{job}.json")
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(info, job=job), f)
    os.replace(tmp, path)
    return path


def remove(job: str) -> None:
    try:
        os.unlink(os.path.join(job_dir(), f"{job}.json"))
    except FileNotFoundError:
        pass


def find(job: str | None = None) -> dict:
    """The named job's file, else the newest one.

    Raises:
        FileNotFoundError: no such job (or no job running on this machine).
    """
    if job:
        path = os.path.join(job_dir(), f"{job}.json")
    else:
        paths = sorted(glob.glob(os.path.join(job_dir(), "*.json")), key=os.path.getmtime)
        if not paths:
            raise FileNotFoundError(f"no ringweave job files in {job_dir()}: is a job running on this machine?")
        path = paths[-1]
    with open(path) as f:
        return json.load(f)
