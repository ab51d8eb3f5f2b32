"""Directories and files that are this user's alone, reached without following links.

What it is: the rules the job file (runtime/jobfile.py) and the checkpoints
(trainer/ckptfs.py) share, so that another local user can neither plant nor read
nor redirect what a job writes:

* a directory is opened once with ``O_DIRECTORY | O_NOFOLLOW`` and checked through
  that descriptor (:func:`open_dir`): a real directory, owned by this user, with
  no mode bit of ``rules.forbid`` (0o077: nothing for group or others; 0o022:
  nobody else may write). A directory we make is mode 0700 whatever the umask;
* everything below it is reached relative to that descriptor, one name at a time:
  new files with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600
  (:func:`create_file`), files read with ``O_NOFOLLOW | O_NONBLOCK`` and accepted
  only when fstat shows a regular file of this user (:func:`open_file`: a FIFO
  planted in a file's place cannot block the reader);
* renames are ``os.replace(src, dst, src_dir_fd=fd, dst_dir_fd=fd)``, removals
  ``shutil.rmtree(name, dir_fd=fd)`` (Python 3.11's fd-based walk, which unlinks a
  symbolic link instead of following it).

Every refusal raises ``rules.error`` with one line: the path, what was found and
what to do.

Not here: where the files live and what is in them (their modules).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

__all__ = ["Rules", "PRIVATE", "NOT_WRITABLE", "open_dir", "check_dir", "create_file", "open_file", "same_entry"]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)  # a planted FIFO cannot block us

PRIVATE = 0o077  # no access at all for group or others
NOT_WRITABLE = 0o022  # group and others may read, never write


@dataclass(frozen=True)
class Rules:
    """What a directory must be, and what a refusal says.

    Example (the job file's): ``Rules("the job files' directory", PRIVATE, JobFileError,
    owner_risk="another user may have made it to read the job's secret",
    fix="remove it, or set XDG_RUNTIME_DIR", mode_fix="remove it, or chmod 700 it ...")``.
    """

    what: str  # what the directory is, e.g. "the job files' directory"
    forbid: int  # mode bits it must not have, PRIVATE or NOT_WRITABLE
    error: type  # the exception raised, e.g. JobFileError
    owner_risk: str  # why another owner matters
    fix: str  # what to do about a link or another owner
    mode_fix: str  # what to do about a mode with forbidden bits

    def rule(self) -> str:
        if self.forbid & 0o044:
            return "it must be 0700 (no access for group or others)"
        return "group and others must not write in it"


def open_dir(name, rules: Rules, *, dir_fd: int | None = None, create: bool = False, exclusive: bool = False,
             label: str | None = None) -> int:
    """Opens directory ``name`` (relative to ``dir_fd`` when given) once, without following a
    link, and checks it through the descriptor; makes it (mode 0700) first when ``create``.
    Returns the descriptor (the caller closes it).

    Raises:
        rules.error: not a directory we may trust (another owner, forbidden mode bits, a link).
        FileNotFoundError: it does not exist and ``create`` is false.
        FileExistsError: it exists and ``exclusive`` (with ``create``) asked for a new one.
    """
    label = label or os.fspath(name)
    made = False
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            made = True
        except FileExistsError:
            if exclusive:
                raise
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ENOTDIR / ELOOP: a symbolic link or a file
        if _is_link(name, dir_fd):
            raise rules.error(f"{label} is a symbolic link; {rules.what} must be a real directory owned by this "
                              f"user: {rules.fix}") from None
        raise rules.error(f"cannot open {label} as a directory: {exc.strerror or exc}") from None
    try:
        if made:
            os.fchmod(fd, 0o700)  # whatever the umask left
        check_dir(fd, label, rules)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_dir(fd: int, label: str, rules: Rules) -> os.stat_result:
    """Checks an open directory: this user's, none of ``rules.forbid``'s bits, rwx for its owner."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise rules.error(f"{label} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                          f"{rules.owner_risk}; {rules.fix}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & rules.forbid or mode & 0o700 != 0o700:
        raise rules.error(f"{label} has mode {mode:04o}; {rules.rule()}: {rules.mode_fix}")
    return st


def create_file(name: str, dir_fd: int, *, mode: int = 0o600, read: bool = False) -> int:
    """A new file ``name`` in ``dir_fd`` (never an existing one, never through a link), exactly
    ``mode`` whatever the umask. Returns its descriptor, open for writing (and reading when ``read``).

    Raises:
        FileExistsError: something, a link too, already has that name.
    """
    flags = NEW_FILE_FLAGS & ~os.O_WRONLY | os.O_RDWR if read else NEW_FILE_FLAGS
    fd = os.open(name, flags, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(name: str, dir_fd: int, rules: Rules, *, label: str | None = None) -> tuple[int, os.stat_result]:
    """Opens file ``name`` of ``dir_fd`` for reading, without following a link and without
    blocking; accepts only a regular file of this user with none of ``rules.forbid``'s bits.
    Returns (descriptor, its stat); the caller closes the descriptor.

    Raises:
        FileNotFoundError: no such file.
        rules.error: a link, a FIFO or other non-regular file, another owner, forbidden bits.
    """
    label = label or name
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symbolic link; ENXIO and the like: not a file to read
        raise rules.error(f"cannot open {label} safely: {exc.strerror or exc} (a symbolic link is never "
                          f"followed)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & rules.forbid:
            kind = "regular file" if stat.S_ISREG(st.st_mode) else "non-regular file (a FIFO, device or directory)"
            raise rules.error(f"{label} is not a regular file of this user without {rules.forbid:04o} mode bits "
                              f"(a {kind}, uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def same_entry(fd: int, name: str, dir_fd: int) -> bool:
    """Whether ``name`` in ``dir_fd`` is still the very file or directory open as ``fd`` (not a
    link, not something put in its place)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return os.path.samestat(st, os.fstat(fd))


def _is_link(name, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
