"""Where a running job can be found by tools on the same machine.

The launcher of the node that hosts the store writes
``<runtime dir>/ringweave-<uid>/<job>.json`` (mode 0600: it holds the secret)
with the store's address, the job id, the world size, the current restart and
the launcher's pid and when the job started, and removes it when the job ends. ``python -m tools.status``
reads it to ask every rank what it is doing. The runtime dir is
``$XDG_RUNTIME_DIR`` or the system temporary directory.

Only this user may read or replace these files (SECURITY.md), by the rules of
runtime/private.py: the directory (made with mode 0700) is opened once without
following a link and checked through its descriptor (this user's, nothing for
group or others), files are made under a fresh random name with ``O_EXCL`` and
mode 0600 and renamed into place, and read only when they are this user's and
not readable by others. Anything else raises :class:`JobFileError`; nothing is
written or read there.

Stale files: a launcher killed with SIGKILL cannot remove its file, so every
``write`` and ``find`` removes the files (and half-written temporary files) of
launchers that no longer run: the file records the launcher's pid and its
start time (``/proc/<pid>/stat``), so a pid used again by another process does
not keep a dead job's file alive.

Not here: what the tools do with the file (tools/status.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile

from runtime import private
from runtime.errors import JobFileError

_RULES = private.Rules(
    "the job files' directory", private.PRIVATE, JobFileError,
    owner_risk="another user may have made it to read the job's secret", fix="remove it, or set XDG_RUNTIME_DIR",
    mode_fix="remove it, or chmod 700 it if nothing in it came from someone else")
_MAX_FILE_NBYTES = 64 * 1024  # a job file is a few hundred bytes
_TMP = re.compile(r"^\..+\.(\d+)\.[0-9a-f]+\.tmp$")  # .<name>.<writer pid>.<random>.tmp


def job_dir() -> str:
    """``$XDG_RUNTIME_DIR/ringweave-<uid>``, or the temporary directory's where that variable is
    unset or names no directory (srun often exports the login node's XDG_RUNTIME_DIR to compute
    nodes that have none: every process of a host then agrees on the fallback)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base):
        base = tempfile.gettempdir()
    return os.path.join(base, f"ringweave-{os.getuid()}")


def file_name(job: str) -> str:
    """The file name of ``job``'s file: odd characters (``/`` among them) become ``_``.

    >>> file_name("10.0.0.1:29500")
    '10.0.0.1:29500.json'
    """
    name = re.sub(r"[^A-Za-z0-9._:-]", "_", job)[:120] or "_"
    return ("_" + name if name.startswith(".") else name) + ".json"


def open_dir(create: bool) -> int:
    """Opens the job directory once and checks it through the descriptor (runtime/private.py).
    Returns the descriptor (the caller closes it).

    Raises:
        JobFileError: not a directory we may trust (another owner, group or other access, a link).
        FileNotFoundError: it does not exist and ``create`` is false.
    """
    return private.open_dir(job_dir(), _RULES, create=create)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22 of stat(5); fields[0] is field 3
    except (OSError, IndexError, ValueError):
        return None


def _running(pid, start) -> bool:
    """Whether the process that wrote a file is still running (the same process, not a new one
    with its pid)."""
    if type(pid) is not int or pid <= 0:
        return True  # not ours to judge: keep the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's
    now = process_start(pid)
    return start is None or now is None or now == start


def write(job: str, info: dict) -> str:
    """Writes ``info`` (plus ``job``, and the start time of ``info["launcher_pid"]`` when given)
    atomically, mode 0600; returns the file's path. Removes stale files first.

    Raises:
        JobFileError: the directory is not safely ours (nothing is written).
    """
    info = dict(info, job=job)
    if "launcher_pid" in info and "launcher_start" not in info:
        info["launcher_start"] = process_start(info["launcher_pid"])
    data = json.dumps(info).encode()
    name = file_name(job)
    dfd = open_dir(create=True)
    try:
        _remove_stale(dfd)
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        fd = private.create_file(tmp, dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            _unlink(tmp, dfd)
            raise
    finally:
        os.close(dfd)
    return os.path.join(job_dir(), name)


def remove(job: str) -> None:
    """Removes ``job``'s file, if there is one in a directory we trust."""
    try:
        dfd = open_dir(create=False)
    except (OSError, JobFileError):
        return
    try:
        _unlink(file_name(job), dfd)
    finally:
        os.close(dfd)


def find(job: str | None = None) -> dict:
    """The named job's file, else the newest one of a launcher still running (:func:`running`).

    Raises:
        FileNotFoundError: no such job (or no job running on this machine).
        JobFileError: the directory or the file is not safely ours.
    """
    if not job:
        jobs = running()
        if not jobs:
            raise FileNotFoundError(f"no ringweave job files in {job_dir()}: is a job running on this machine?")
        return jobs[0]
    try:
        dfd = open_dir(create=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"no ringweave job files in {job_dir()}: is a job running on this machine?") from None
    try:
        _remove_stale(dfd)
        name = file_name(job)
        info = _read(name, dfd)
        if info is None:
            raise FileNotFoundError(f"no job file {os.path.join(job_dir(), name)}")
        return info
    finally:
        os.close(dfd)


def running() -> list[dict]:
    """The files of this user's jobs whose launchers still run on this machine, newest first
    (by ``started_at``, else when the file was written). Files that are not safely ours are
    left out (:func:`find` names one when asked for it).

    Raises:
        JobFileError: the directory is not safely ours.
    """
    try:
        dfd = open_dir(create=False)
    except FileNotFoundError:
        return []
    try:
        _remove_stale(dfd)
        jobs = []
        for name in os.listdir(dfd):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                info = _read(name, dfd)
            except JobFileError:
                continue
            if info is not None:
                started = info.get("started_at")
                jobs.append((started if isinstance(started, (int, float)) else _mtime(name, dfd), name, info))
        return [info for _, _, info in sorted(jobs, key=lambda t: (-t[0], t[1]))]
    finally:
        os.close(dfd)


def _mtime(name: str, dfd: int) -> float:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _read(name: str, dfd: int) -> dict | None:
    """A job file's contents; None when it is gone. Raises JobFileError when it is not ours alone."""
    path = os.path.join(job_dir(), name)
    try:
        fd, _ = private.open_file(name, dfd, _RULES, label=path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_FILE_NBYTES + 1)
    try:
        info = json.loads(raw) if len(raw) <= _MAX_FILE_NBYTES else None
    except ValueError:
        info = None
    if type(info) is not dict:
        raise JobFileError(f"{path} is not a job file (not a JSON map under 64 KiB)")
    return info


def _remove_stale(dfd: int) -> list[str]:
    """Removes the job files of launchers that no longer run, and temporary files of writers
    that no longer run. Returns the names removed."""
    removed = []
    for name in os.listdir(dfd):
        if name.startswith("."):
            m = _TMP.match(name)
            if m and not _running(int(m.group(1)), None):
                removed += [name] if _unlink(name, dfd) else []
            continue
        if not name.endswith(".json"):
            continue
        try:
            info = _read(name, dfd)
        except JobFileError:
            continue  # not ours to judge; find() says so if it is asked for
        if info is not None and not _running(info.get("launcher_pid"), info.get("launcher_start")):
            removed += [name] if _unlink(name, dfd) else []
    return removed


def _unlink(name: str, dfd: int) -> bool:
    try:
        os.unlink(name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False
