"""Shared-memory segments: the files under /dev/shm that the ranks of one host map, their names,
how they are created, mapped and unlinked, and the clean-up of what a job leaves behind.

A segment's name is ``ringweave-<job>-<token>-g<gid>d<domain>-r<rank>-<what>`` (:func:`segment_path`).
/dev/shm is listed by everyone, so the token is 64 bits no one else can predict: drawn at random for
that one file, or (a domain's segments, :func:`member_tokens`) derived from its owner's secret seed,
which only the owner's peers learn, over the job's authenticated messages. Seeing one name tells
another user nothing of the next; a peer that knows the seed knows every name the owner may use, so
the clean-up after a lost peer unlinks its names and no one else's, even another job's of the same
name (two torchrun jobs with the default run id) in its window.

The rules, each one a refusal rather than a trust:

* :meth:`Segment.create` opens with ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600: a name that
  exists (another user's file, a link, a leftover) is never opened; :meth:`Segment.create_fresh`
  tries again under a fresh token, :data:`CREATE_TRIES` times, then fails naming the names.
* :meth:`Segment.attach` opens with ``O_NOFOLLOW`` and maps only a file of this user that is at
  least as large as expected.
* Clean-up (:func:`remove_job_segments`, :func:`remove_member_segments`, the ``atexit`` hook that
  unlinks what this process still owns) unlinks only files of this user, never links.

Unlinking a name leaves the memory to the processes that map it: it lives as long as the last
mapping. :func:`shm_usable` says whether segments can be made here at all (``RINGWEAVE_SHM``).

Not here: what a segment holds and who maps which when (runtime/sharedmem/domains.py), the words
ranks post and wait on (runtime/sharedmem/waits.py).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import hmac
import logging
import mmap
import os
import re
import secrets

from runtime import env
from runtime.errors import RingweaveError

log = logging.getLogger("ringweave.shm")

SHM_DIR = "/dev/shm"
PREFIX = "ringweave-"
TOKEN_NBYTES = 8  # random bytes in each file's name (16 hex digits)
CREATE_TRIES = 8  # names tried (each with a fresh token) before a taken name fails the call


# -- names --------------------------------------------------------------------------------------


def job_prefix(job: str) -> str:
    """The file-name prefix of every segment of ``job`` (``/`` and other odd characters -> ``_``).

    >>> job_prefix("10.0.0.1:29500")
    'ringweave-10.0.0.1_29500-'
    """
    return PREFIX + re.sub(r"[^A-Za-z0-9._]", "_", job)[:80] + "-"


def segment_path(prefix: str, token: str, domain: str, grank: int, what: str) -> str:
    """The file of global rank ``grank``'s segment ``what`` ("ctl", "v<k>") in domain ``domain``
    (``<gid>d<index>``), under ``token``; ``prefix`` is the job's (:func:`job_prefix`)."""
    return os.path.join(SHM_DIR, f"{prefix}{token}-g{domain}-r{grank}-{what}")


_OWNER = re.compile(r"-r(\d+)-[^-]+$")  # ...-r<global rank>-ctl | -v<k>
_REST = re.compile(r"[^-]+-g\d+d\d+-r\d+-[^-]+")  # after the job's prefix: <token>-g<gid>d<domain>-r<rank>-<what>


def owned_here(path: str) -> bool:
    """Whether ``path`` is a file of this user (not a link): what clean-up may unlink."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not os.path.islink(path)


def job_segments(job: str, ranks=None, directory: str = SHM_DIR) -> list[str]:
    """Paths of the segments of ``job`` that still have a name and belong to this user; only
    those owned by the global ``ranks`` when given (a launcher cleans up after its own node's
    ranks only)."""
    prefix = job_prefix(job)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    keep = None if ranks is None else {int(r) for r in ranks}
    out = []
    for n in names:
        if not n.startswith(prefix) or not _REST.fullmatch(n, len(prefix)):  # not job "<job>-x"'s
            continue
        if keep is not None:
            m = _OWNER.search(n)
            if m is None or int(m.group(1)) not in keep:
                continue
        path = os.path.join(directory, n)
        if owned_here(path):
            out.append(path)
    return sorted(out)


def remove_job_segments(job: str, ranks=None, directory: str = SHM_DIR) -> list[str]:
    """Unlinks the segments of ``job`` (of its global ``ranks`` only, when given); returns them.
    The launcher calls this after each attempt. Processes that still map a segment keep their
    memory; only the name goes.
    """
    removed = []
    for path in job_segments(job, ranks, directory):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)
    return removed


def member_tokens(seed: bytes, what: str) -> list[str]:
    """The tokens a member whose seed is ``seed`` tries, in order, for its segment ``what``
    (:meth:`Segment.create_fresh`'s ``tokens``): HMAC-SHA256 of ``what`` and the try, keyed by the seed."""
    return [hmac.new(seed, f"{what}/{k}".encode(), hashlib.sha256).hexdigest()[:2 * TOKEN_NBYTES]
            for k in range(CREATE_TRIES)]


def remove_member_segments(prefix: str, domain: str, grank: int, seed: bytes) -> list[str]:
    """Unlinks whatever names global rank ``grank`` still has in domain ``domain`` of the job of
    ``prefix``: ``<prefix><token>-g<domain>-r<grank>-<what>`` with a token of its ``seed``
    (:func:`member_tokens`), files of this user only; returns them. What the survivors do for a
    lost peer, which cannot any more; a name of the same pattern under another token is another
    job's (or another process's), and stays."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    rest = re.compile(rf"([0-9a-f]+)-g{re.escape(domain)}-r{grank}-([^-]+)")  # after the prefix
    removed = []
    for n in names:
        m = rest.fullmatch(n, len(prefix)) if n.startswith(prefix) else None
        if m is not None and m.group(1) in member_tokens(seed, m.group(2)):
            path = os.path.join(SHM_DIR, n)
            if owned_here(path):
                unlink_name(path)
                removed.append(path)
    return removed


def shm_usable(directory: str = SHM_DIR) -> bool:
    """True when ``RINGWEAVE_SHM`` is not ``"0"`` and ``directory`` is a writable directory."""
    if not env.SHM.get():
        return False
    ok = _usable_dirs.get(directory)
    if ok is None:  # checked once per directory and process
        ok = _usable_dirs[directory] = os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)
    return ok


_usable_dirs: dict[str, bool] = {}


# -- segments -----------------------------------------------------------------------------------


class Segment:
    """One /dev/shm file mapped MAP_SHARED read-write (``create`` or ``attach``)."""

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap, owner: bool):
        self.path = path
        self.nbytes = nbytes
        self.mm = mm
        self.owner = owner
        self.linked = owner  # the owner's name is still in /dev/shm
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mm)) if nbytes else 0
        if owner:
            _owned_paths.add(path)

    @classmethod
    def create(cls, path: str, nbytes: int) -> "Segment":
        """Creates ``path`` (it must not exist) of ``nbytes`` zero bytes and maps it.

        Raises:
            FileExistsError: a file (or link) of that name exists.
            OSError: /dev/shm is full or not writable.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            unlink_name(path)
            raise
        os.close(fd)
        return cls(path, nbytes, mm, owner=True)

    @classmethod
    def create_fresh(cls, path_of, nbytes: int, tokens=None) -> tuple["Segment", str]:
        """Creates a segment at ``path_of(token)`` with a fresh token (the next of ``tokens``,
        else a random one); a name that is taken (someone else's file, a leftover) is tried again
        with another token, up to CREATE_TRIES times. Returns the segment and its token.

        Raises:
            RingweaveError: every name tried was taken (names them).
            OSError: /dev/shm is full or not writable.
        """
        taken = []
        tokens = iter(tokens) if tokens is not None else None
        for _ in range(CREATE_TRIES):
            token = _token() if tokens is None else next(tokens)
            path = path_of(token)
            try:
                return cls.create(path, nbytes), token
            except FileExistsError:
                taken.append(path)
                log.warning("shared-memory name %s is taken (another user's file, or a leftover); "
                            "trying a fresh name", path)
        raise RingweaveError(f"{len(taken)} fresh shared-memory names were all taken, e.g. {taken[-1]}: "
                             f"is someone creating files in {SHM_DIR} as fast as they are named?")

    @classmethod
    def attach(cls, path: str, nbytes: int) -> "Segment":
        """Maps an existing segment of this user (pages pre-faulted, so the first collective is
        not slow).

        Raises:
            FileNotFoundError: no such segment. OSError (ELOOP): the name is a link.
            RingweaveError: it is smaller than ``nbytes``, or another user's.
        """
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise RingweaveError(f"shared-memory segment {path} belongs to uid {st.st_uid}, not to this "
                                     f"user: refusing to map it")
            size = st.st_size
            if size < nbytes:
                raise RingweaveError(f"shared-memory segment {path} has {size} bytes; expected {nbytes}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, nbytes, mm, owner=False)

    def unlink(self) -> None:
        """Removes the name (the memory stays while mapped). Idempotent."""
        if self.owner and self.linked:
            self.linked = False
            _owned_paths.discard(self.path)
            unlink_name(self.path)

    def close(self) -> None:
        """Unmaps, unless arrays still view the memory (then the GC unmaps it later)."""
        try:
            self.mm.close()
        except BufferError:
            pass


def _token() -> str:
    """A fresh random token for a file name (TOKEN_NBYTES bytes, hex)."""
    return secrets.token_hex(TOKEN_NBYTES)


def unlink_name(path: str) -> None:
    """Unlinks ``path``; a name already gone is fine, any other failure is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # e.g. EPERM: another user's file in the sticky /dev/shm
        log.warning("could not remove %s: %s", path, exc)


_owned_paths: set[str] = set()  # names this process created and has not unlinked yet


@atexit.register
def _unlink_owned() -> None:
    for path in list(_owned_paths):
        unlink_name(path)
    _owned_paths.clear()
