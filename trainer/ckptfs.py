"""The checkpoints' file system: every directory opened once and checked, everything below it
reached through its descriptor, never through a link.

What it is. A checkpoint root holds the job's most precious data, often in a shared file
system, so it follows the job file's rules (runtime/private.py):

* :func:`open_root` opens the root with ``O_DIRECTORY | O_NOFOLLOW`` and checks it through
  the descriptor: owned by this user and writable by nobody else (a root made before these
  rules, mode 0755, still loads); a root it makes is mode 0700 whatever the umask. Anything
  else is a :class:`CheckpointError` that says why and what to do;
* a :class:`Dir` reaches its entries one name at a time, relative to its descriptor: directories
  made 0700 and opened with the same checks, files made 0600 with ``O_EXCL | O_NOFOLLOW`` and
  read as regular files of this user only, renames and removals between descriptors;
* :func:`remove_checkpoint` is the one way a checkpoint is deleted (pruning, a failed save):
  only a step or temporary directory of this user, never a link;
* :func:`npy_offset` and :func:`map_npy` open a piece: its .npy header parsed without pickle and
  compared with what the metadata says, its size with the header plus the elements, before
  anything of that size is allocated; then the elements, memory-mapped.

So a link planted anywhere under a root is never followed, and a root or step directory another
user made is never trusted. What it is not: the layout of a checkpoint and its metadata
(trainer/checkpoint.py, trainer/ckptschema.py).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import stat
from pathlib import Path

import numpy as np

from runtime import owndir, private
from trainer.ckptschema import CheckpointError

__all__ = ["Dir", "open_root", "open_dir", "remove_checkpoint", "step_names", "npy_offset", "map_npy", "write_atomic"]

log = logging.getLogger("ringweave.checkpoint")

RULES = private.Rules(
    "a checkpoint directory", private.NOT_WRITABLE, CheckpointError,
    owner_risk="another user may have made it to plant checkpoints or to read yours",
    fix="use a directory of your own (--checkpoint-dir), named by its real path",
    mode_fix="chmod go-w it if everything in it is yours, or use another directory")

STEP = re.compile(r"step-(\d{8,16})\Z")  # a committed checkpoint: step-00000040
TMP = re.compile(r"\.tmp-(old-)?step-\d{8,16}\Z")  # a save in progress, or the step it replaces
ENTRY = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9_.][A-Za-z0-9_.+-]{0,254}\Z")  # one name below a root: no '/', '.', '..'
MAX_JSON_NBYTES = 256 * 2**20  # metadata of a very large model is tens of MiB


class Dir:
    """A checked directory's descriptor and its path (for messages); a context manager that
    closes it. Names given to its methods are single entries or ``a/b`` walks, one checked
    directory at a time.

    Step and rank directories are made 0700 (``mkdir(name, dir_fd=...)``) and opened with the
    root's checks; files are made 0600 with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and read with
    ``O_NOFOLLOW | O_NONBLOCK`` (regular files of this user only: a FIFO never blocks); renames
    are ``os.replace`` between descriptors, removals ``shutil.rmtree(name, dir_fd=...)``, which
    unlinks a link instead of following it (Python 3.11's fd-based walk)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, Path(path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Dir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- directories ------------------------------------------------------------------------

    def sub(self, name: str) -> "Dir":
        """The checked subdirectory ``name`` (FileNotFoundError when there is none)."""
        _entry(name, self.path)
        return Dir(private.open_dir(name, RULES, dir_fd=self.fd, label=str(self.path / name)), self.path / name)

    def make(self, name: str) -> "Dir":
        """A new subdirectory ``name``, mode 0700 (FileExistsError when the name is taken)."""
        _entry(name, self.path)
        fd = private.open_dir(name, RULES, dir_fd=self.fd, create=True, exclusive=True, label=str(self.path / name))
        return Dir(fd, self.path / name)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def holds(self, sub: "Dir", name: str) -> bool:
        """Whether ``name`` here is still the directory open as ``sub`` (nothing swapped in)."""
        return private.same_entry(sub.fd, name, self.fd)

    def replace(self, src: str, dst: str) -> None:
        _entry(src, self.path)
        _entry(dst, self.path)
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    # ---- files --------------------------------------------------------------------------------

    def write_new(self, name: str, write) -> None:
        """A new file ``name`` (0600, O_EXCL, never through a link): ``write(f)``, then fsync."""
        _entry(name, self.path)
        fd = private.create_file(name, self.fd)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())

    def open_file(self, relpath: str) -> tuple[int, os.stat_result]:
        """Opens ``relpath`` (``name`` or ``dir/name``) for reading: each directory on the way is
        checked, the file must be a regular file of this user. Returns (descriptor, stat).

        Raises:
            CheckpointError: a link, a FIFO, another owner, a name that leaves this directory,
                or a file that is missing.
        """
        *dirs, name = relpath.split("/")
        label = self.path / relpath
        stack = []
        try:
            parent = self
            for d in dirs:
                parent = parent.sub(d)
                stack.append(parent)
            _entry(name, parent.path)
            return private.open_file(name, parent.fd, RULES, label=str(label))
        except FileNotFoundError:
            raise CheckpointError(f"{label} is missing") from None
        finally:
            for d in stack:
                d.close()

    def read_json(self, relpath: str, limit: int = MAX_JSON_NBYTES):
        """The JSON in file ``relpath`` (at most ``limit`` bytes; NaN and infinities parse).

        Raises:
            CheckpointError: what open_file raises, a larger file, or text that is not JSON.
        """
        fd, st = self.open_file(relpath)
        with os.fdopen(fd, "rb") as f:
            if st.st_size > limit:
                raise CheckpointError(f"{self.path / relpath} is {st.st_size} bytes, more than the {limit} a "
                                      f"checkpoint's JSON may have")
            raw = f.read(st.st_size + 1)  # read(n) allocates n bytes first: the file's size, not the limit
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's stack
            raise CheckpointError(f"{self.path / relpath} is not JSON: {one_line(exc)}") from None


def one_line(exc: BaseException, limit: int = 120) -> str:
    """An exception's message on one line, cut to ``limit`` characters (it may quote a file)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _entry(name: str, where: Path) -> None:
    if not ENTRY.match(name):
        raise CheckpointError(f"{name[:80]!r} is not a name inside {where} (one entry, no '/' or '..')")


def open_dir(path, *, create: bool = False) -> Dir:
    """The directory ``path`` (a checkpoint root or a checkpoint), opened once and checked;
    with ``create``, made (mode 0700; its parents as ``mkdir -p``) when missing.

    Raises:
        CheckpointError: another owner, writable by group or others, a link, not a directory.
        FileNotFoundError: missing, and not ``create``.
    """
    path = Path(path)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    return Dir(private.open_dir(path, RULES, create=create), path)


def open_root(path, *, create: bool = False) -> Dir | None:
    """The checkpoint root ``path`` (open_dir), None when it is missing and not ``create``.
    Says once per root when it is readable by others (made before roots were 0700)."""
    try:
        root = open_dir(path, create=create)
    except FileNotFoundError:
        return None
    mode = stat.S_IMODE(os.fstat(root.fd).st_mode)
    if mode & 0o077:
        _warn_once(f"checkpoint directory {root.path} has mode {mode:04o}: other users may read its checkpoints "
                   f"(chmod 700 it)")
    return root


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def step_names(root: Dir) -> list[tuple[int, str]]:
    """(step, name) of every ``step-SSSSSSSS`` directory of ``root`` that is this user's (not a
    link), oldest first. One of another user (left from a time the root was open to others) is
    not trusted, listed or pruned: it is logged once."""
    found = []
    for name in root.names():
        m = STEP.match(name)
        st = root.lstat(name) if m else None
        if st is None or not stat.S_ISDIR(st.st_mode):
            continue
        if st.st_uid != os.geteuid():
            _warn_once(f"ignoring {root.path / name}: it belongs to uid {st.st_uid}, not to this user")
            continue
        found.append((int(m.group(1)), name))
    return sorted(found)


def remove_checkpoint(root: Dir, name: str) -> bool:
    """Removes the checkpoint (or temporary) directory ``name`` of ``root``, walked by descriptor
    (links inside are unlinked, never followed); a link or file of this user with such a name is
    unlinked. Returns whether it is gone; anything of another user is left, and logged.

    Raises:
        CheckpointError: ``name`` is not a checkpoint's (``step-S``, ``.tmp-step-S``) name.
    """
    if not (STEP.match(name) or TMP.match(name)):
        raise CheckpointError(f"{name[:80]!r} in {root.path} is not a checkpoint's name; not removed")
    st = root.lstat(name)
    if st is None:
        return False
    if st.st_uid != os.geteuid():
        log.warning("not removing %s: it belongs to uid %d, not to this user", root.path / name, st.st_uid)
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=root.fd, ignore_errors=True)
    else:
        os.unlink(name, dir_fd=root.fd)
    return root.lstat(name) is None


def npy_offset(ckpt: Dir, relpath: str, dtype: np.dtype, count: int, name: str) -> int:
    """Where the data of the .npy file ``relpath`` starts, after checking that it is a regular
    file of this user, that its header (parsed without pickle) says ``dtype`` and ``(count,)``,
    and that its size is that header plus exactly ``count`` elements. Reads the header only.

    Raises:
        CheckpointError: any of these is not so (names the file and the array ``name``).
    """
    fd, st = ckpt.open_file(relpath)
    file = ckpt.path / relpath
    with os.fdopen(fd, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"format version {version}")
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, found = read(f)
            offset = f.tell()
        except Exception as exc:  # NumPy's parser on bytes that are no header: ValueError, SyntaxError, TokenError ...
            raise CheckpointError(f"{file} ({name}) is not a .npy array: {one_line(exc)}") from None
    want = np.lib.format.descr_to_dtype(np.lib.format.dtype_to_descr(dtype))  # bfloat16 is stored as V2
    if found != want or fortran or shape != (count,):
        raise CheckpointError(f"{file} ({name}) holds {found} {shape}, the metadata says {dtype} ({count},)")
    if st.st_size != offset + count * dtype.itemsize:
        raise CheckpointError(f"{file} ({name}) is {st.st_size} bytes; a header of {offset} and {count} "
                              f"{dtype} elements make {offset + count * dtype.itemsize}")
    return offset


def map_npy(ckpt: Dir, relpath: str, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
    """The ``count`` elements of a .npy file ``npy_offset`` checked, memory-mapped read-only (a
    rank reads only the pages it copies)."""
    fd, st = ckpt.open_file(relpath)
    try:
        if st.st_size != offset + count * dtype.itemsize:
            raise CheckpointError(f"{ckpt.path / relpath} changed while it was read")
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)


def write_atomic(out, write) -> Path:
    """``write(f)`` into a new file beside ``out`` (runtime/owndir.py's ``replacing``: 0600,
    O_EXCL, a fresh random name, relative to the opened parent directory, fsynced), renamed to
    ``out``. For outputs a user names (an exported .npz): the parent is the user's choice and is
    not required to be theirs alone."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dfd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with owndir.replacing(dfd, out.name, "wb", durable=True) as f:
            write(f)
    finally:
        os.close(dfd)
    return out
