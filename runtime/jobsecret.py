"""The secret of a job started without one: made once per job, readable by its user alone.

Ranks that srun, mpirun or a user starts on one host without ``RINGWEAVE_SECRET`` (and
launchers of several "nodes" on one host) share a secret through a file in the user's
private directory, the job file's (runtime/jobfile.py: ``$XDG_RUNTIME_DIR`` or
``<tmp>/ringweave-<uid>``, mode 0700, opened once and checked through its descriptor)::

    <dir>/<sha256(job, store port, SLURM job and step)[:32]>.secret    mode 0600
    {"secret": 64 hex digits, "job", "port", "step", "pid", "start", "made"}

Whichever process of the job comes first makes it (``O_CREAT | O_EXCL | O_NOFOLLOW``,
relative to the directory's descriptor); the others read it. Reading, judging and making are
one step under an exclusive lock on the directory (``flock``, bounded wait), so two ranks never
make two secrets, and nobody reads a half-written file. The file records its maker's pid and
start time (``/proc/<pid>/stat``), as the job file does: a file whose maker no longer runs (a
job killed before it could clean up) is stale and is replaced by a fresh secret, so the
stragglers of an old job with the same key cannot join a new one; the maker removes it when it
leaves the job (:func:`release`), and every :func:`derive` removes the stale ones of other jobs.

Ranks on several hosts share no private file: a job whose store is beyond loopback gets no
derived secret, and refuses to start without ``RINGWEAVE_SECRET``, saying how to set one.

Not here: the handshake that uses the secret (runtime/auth.py), the directory's rules
(runtime/jobfile.py), when a job derives one (runtime/init.py, runtime/launch.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import secrets
import time
from typing import Iterator, Mapping

from runtime import auth, jobfile, private
from runtime.errors import AuthenticationError, JobFileError

SUFFIX = ".secret"
LOCK_TIMEOUT_S = 10.0  # the lock is held for a read and at most one small write: milliseconds
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class JobSecret:
    """A derived secret and where it lives."""
    secret: bytes     # what auth uses: the 64 hex digits, encoded
    path: str         # e.g. "/run/user/1000/ringweave-1000/3f2a...c1.secret"
    made_here: bool   # this process made the file, and removes it (release)


def slurm_step(env: Mapping[str, str]) -> str:
    """``"<SLURM_JOB_ID>.<step>"`` for a SLURM job step, else ``""``: two steps of one job never
    share a derived secret (a tool started with ``srun --overlap`` is a step of its own:
    :func:`lookup` finds the job's secret without it)."""
    job = env.get("SLURM_JOB_ID")
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    return f"{job}.{step}" if job and step else ""


def file_name(job: str, port: int, step: str) -> str:
    """The secret file's name for the job ``job`` whose store is on ``port``."""
    key = json.dumps([job, int(port), step]).encode()
    return hashlib.sha256(key).hexdigest()[:32] + SUFFIX


def derive(job: str, port: int, master_addr: str, who: str, env: Mapping[str, str] | None = None,
           lock_timeout_s: float = LOCK_TIMEOUT_S) -> JobSecret:
    """The secret of ``job`` (store at ``master_addr:port``), from its private file, made here
    if no running process of the job made it yet.

    Args:
        who: names the caller in errors, e.g. ``"rank 1"``.
        env: where the SLURM step is read (default ``os.environ``).
    Raises:
        AuthenticationError: the store is beyond loopback (no file is shared across hosts), or
            the private directory is unusable (another user's, open to others, missing);
            the message says how to set ``RINGWEAVE_SECRET`` instead.
    """
    if not auth.is_loopback(master_addr):
        raise AuthenticationError(f"{who}: {auth.SECRET_ENV} is unset and the job's store at {master_addr}:{port} "
                                  f"is beyond this host: {auth.HOW_TO_SET}")
    step = slurm_step(os.environ if env is None else env)
    name = file_name(job, port, step)
    try:
        with _directory(create=True) as dfd, _locked(dfd, lock_timeout_s):
            _remove_stale(dfd)  # this job's own file too, if its maker is gone
            record = _valid(_read(name, dfd))
            made = record is None
            if made:
                record = {"secret": secrets.token_hex(32), "job": job, "port": int(port), "step": step,
                          "pid": os.getpid(), "start": jobfile.process_start(os.getpid()), "made": time.time()}
                _create(name, dfd, record)
    except (JobFileError, OSError) as exc:
        raise AuthenticationError(f"{who}: {auth.SECRET_ENV} is unset and the job's private secret file could not "
                                  f"be made in {jobfile.job_dir()} ({exc}); {auth.HOW_TO_SET}") from None
    return JobSecret(record["secret"].encode(), os.path.join(jobfile.job_dir(), name), made)


def release(js: JobSecret | None) -> bool:
    """Removes the file of ``js`` if this process made it and it is still the one it made (a
    later job's file with the same key is left alone). Returns whether it removed it; never raises
    for a directory or file that is gone."""
    if js is None or not js.made_here:
        return False
    name = os.path.basename(js.path)
    try:
        with _directory(create=False) as dfd, _locked(dfd, LOCK_TIMEOUT_S):
            record = _valid(_read(name, dfd))
            if record is None or record["secret"].encode() != js.secret or record["pid"] != os.getpid():
                return False
            return _unlink(name, dfd)
    except (JobFileError, OSError):
        return False


def lookup(job: str, port: int) -> bytes | None:
    """The derived secret of the running job ``job`` whose store is on ``port`` (any step), for a
    tool on the job's host; the newest if several; None where there is none we may read."""
    try:
        with _directory(create=False) as dfd, _locked(dfd, LOCK_TIMEOUT_S):
            found = []
            for name in _names(dfd):
                record = _valid(_read(name, dfd))
                if record is not None and record["job"] == job and record["port"] == port:
                    found.append((record["made"], record["secret"]))
    except (JobFileError, OSError):
        return None
    return max(found)[1].encode() if found else None


# -- the file and its directory ------------------------------------------------------------------


@contextlib.contextmanager
def _directory(create: bool) -> Iterator[int]:
    """The private directory's descriptor, checked (jobfile.open_dir); closed after."""
    dfd = jobfile.open_dir(create=create)
    try:
        yield dfd
    finally:
        os.close(dfd)


@contextlib.contextmanager
def _locked(dfd: int, timeout_s: float) -> Iterator[None]:
    """Holds an exclusive ``flock`` on the directory. Raises JobFileError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise JobFileError(f"{jobfile.job_dir()} stayed locked for {timeout_s:g} s") from None
            time.sleep(0.005)
    try:
        yield
    finally:
        fcntl.flock(dfd, fcntl.LOCK_UN)


def _names(dfd: int) -> list[str]:
    return [n for n in os.listdir(dfd) if n.endswith(SUFFIX) and not n.startswith(".")]


def _read(name: str, dfd: int) -> dict | None:
    """The record in ``name`` (jobfile's checks: ours, 0600, a regular file, JSON); None when it
    is absent or unreadable as a record."""
    try:
        return jobfile._read(name, dfd)
    except JobFileError:
        return None


def _valid(record: dict | None) -> dict | None:
    """``record`` if it holds a secret and its maker still runs, else None (stale or damaged)."""
    if record is None or not isinstance(record.get("secret"), str) or not _HEX64.match(record["secret"]):
        return None
    if type(record.get("pid")) is not int or type(record.get("port")) is not int:
        return None
    if not isinstance(record.get("job"), str) or not isinstance(record.get("made"), (int, float)):
        return None
    return record if jobfile._running(record["pid"], record.get("start")) else None


def _remove_stale(dfd: int) -> None:
    """Removes the secret files whose makers no longer run, and any that is not a valid record
    (under the lock nothing is half-written: such a file's maker died writing it)."""
    for name in _names(dfd):
        if _valid(_read(name, dfd)) is None:
            _unlink(name, dfd)


def _create(name: str, dfd: int, record: dict) -> None:
    """Makes ``name`` (exclusively, mode 0600, no link followed) holding ``record``."""
    fd = private.create_file(name, dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(record).encode())
    except BaseException:
        _unlink(name, dfd)
        raise


def _unlink(name: str, dfd: int) -> bool:
    return jobfile._unlink(name, dfd)
