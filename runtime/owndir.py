"""A directory the user names for our output (``RINGWEAVE_TRACE``, ``tools.trace -o``), made and
checked so that only its owner decides what is in it, and the files written there.

The rules of runtime/private.py (the job file's and the checkpoints'), for any path:

* the directory is opened once with ``O_DIRECTORY | O_NOFOLLOW`` and checked through that
  descriptor: owned by this user and not writable by group or others. A missing one is made with
  mode 0700 when asked (its parents as ``mkdir -p`` would). Anything else (another user's, one
  that group or others may write in, a symbolic link) raises
  :class:`~runtime.errors.PrivateDirError` naming the path, why and what to do: another user
  who may write there could plant a link under the name we are about to write, and make us
  overwrite the job owner's files;
* files are made relative to that descriptor under a fresh random name with
  ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600, then renamed onto their name (:func:`replacing`):
  nothing is ever written through a name that already exists, and a rename replaces a link
  rather than following it;
* files are read relative to a descriptor with ``O_NOFOLLOW | O_NONBLOCK``, regular files only
  (:func:`read_file`: neither a link nor a FIFO planted in the name).

Unlike the job file's directory, one that others may read or enter is accepted: a trace holds no
secret, and a user may share one on purpose. What is refused is anyone else writing there.

Not here: what is written (runtime/trace.py, tools/trace.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from typing import IO, Iterator

from runtime import private
from runtime.errors import PrivateDirError


def _rules(what: str) -> private.Rules:
    return private.Rules(what, private.NOT_WRITABLE, PrivateDirError,
                         owner_risk="its owner could plant links there that make us overwrite your files",
                         fix="use a directory of your own (a missing one is made, mode 0700)",
                         mode_fix="chmod go-w it, or use another directory (whoever may write in it could plant "
                                  "links there that make us overwrite your files)")


def open_dir(path: str, *, create: bool, what: str = "directory") -> int:
    """Opens ``path`` as a directory we may write in, making it (0700) first when ``create`` and
    it is missing (its parents as ``mkdir -p`` would). Returns the descriptor (the caller closes
    it). ``what`` names it in errors, e.g. ``"the trace directory (RINGWEAVE_TRACE)"``.

    Raises:
        PrivateDirError: not a directory of this user's that only it may write in.
        FileNotFoundError: it is missing and ``create`` is false.
    """
    if create:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return private.open_dir(path, _rules(what), create=create, label=f"{what} {path}")


@contextlib.contextmanager
def replacing(dfd: int, name: str, mode: str = "w", *, durable: bool = False) -> Iterator[IO]:
    """A new file, open for writing (``mode``: ``"w"`` or ``"wb"``), that becomes ``name`` in
    directory ``dfd`` when the block ends without an exception, replacing what had that name;
    on an exception it is removed and ``name`` is left as it was. ``durable``: the file is
    fsynced before the rename and the directory after it (a crash leaves the old file or the new)."""
    tmp = f".{name[:100]}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    fd = private.create_file(tmp, dfd)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    if durable:
        os.fsync(dfd)


def read_file(dfd: int, name: str, where: str) -> bytes:
    """The bytes of regular file ``name`` in directory ``dfd``, opened without following a link
    and without blocking on a FIFO; ``where`` names the directory in errors.

    Raises:
        PrivateDirError: ``name`` is a link, a FIFO or anything but a regular file.
        OSError: it cannot be read (FileNotFoundError: gone).
    """
    try:
        fd = os.open(name, private.READ_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symbolic link
        raise PrivateDirError(f"{os.path.join(where, name)} cannot be opened safely ({exc.strerror}): "
                              f"not following a link") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise PrivateDirError(f"{os.path.join(where, name)} is not a regular file")
        return f.read()
