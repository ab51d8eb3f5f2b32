"""Offload (DeepSpeed's ZeRO-Offload / ZeRO-Infinity for a CPU trainer): a rank's optimizer state,
and its fp32 master weights, in memory-mapped files on disk.

What it is: `DiskOffload`, the offload part a data-parallel strategy holds (trainer/sharding/parts.py:
`make_offload_strategy`, or `make_parallel_strategy` when TrainConfig.offload is set), over
`Offload(kind, directory, rank)`, which moves per-unit arrays into one file per rank (each at a
page-aligned offset) and pages them in and out around the optimizer step, the only time they are read:

    kind "optimizer"   every unit's optimizer state (AdamW's exp_avg and exp_avg_sq)
    kind "params"      that, and the float32 master weights (needs param_dtype lower than
                       master_dtype: the compute copy stays in memory, as in ZeRO-Offload)

    update:  prefetch(0) when the step starts; for unit i: prefetch(i + 1) (madvise WILLNEED),
             step unit i, release(i) on the writer thread (msync, then madvise DONTNEED);
             finish() waits for the writer

Between steps the offloaded bytes live in the files, and during the update at most about two
units' worth are resident. The numbers are the same bits: only their storage moved.

Files are ours alone (runtime/private.py): a fresh 0700 directory under `directory` with a random
name, opened once without following a link and checked; the 0600 file made relative to it with
O_CREAT | O_EXCL | O_NOFOLLOW; `close()` removes both through the descriptors.

What it is not: no offload of gradients or of the compute copy, no asynchronous I/O library (the
kernel's readahead and writeback do the work), no NVMe-specific tuning.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import mmap
import os
import secrets
import tempfile

import numpy as np

from runtime import private
from trainer.precision import resolve_dtype
from trainer.sharding import make_strategy

__all__ = ["Offload", "DiskOffload", "make_offload_strategy", "KINDS", "return_freed_memory"]

KINDS = ("optimizer", "params")
PAGE = mmap.PAGESIZE  # arrays start on a page: madvise works on whole pages


def return_freed_memory() -> None:
    """Asks glibc to hand the memory of freed arrays back to the system (malloc_trim). Large NumPy
    arrays freed after the first few are kept in malloc's heap (its mmap threshold grows as big blocks
    are freed), so the RAM copies offload replaced would stay resident without it. No-op elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:  # pragma: no cover - no C library to load
        trim = None
    if trim is not None:
        trim(0)


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


_RULES = private.Rules("an offload directory", private.PRIVATE, PermissionError,
                       owner_risk="another user may have swapped it in", fix="use another --offload-dir",
                       mode_fix="use another --offload-dir")


def _make_private_dir(base: str, prefix: str) -> tuple[int, int, str]:
    """A new directory ``<base>/<prefix><random>`` (mode 0700, checked). Returns (descriptor of
    base, descriptor of the new directory, its name)."""
    os.makedirs(base, exist_ok=True)
    base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for _ in range(100):
            name = f"{prefix}{secrets.token_hex(6)}"
            try:
                return base_fd, private.open_dir(name, _RULES, dir_fd=base_fd, create=True, exclusive=True,
                                                 label=os.path.join(base, name)), name
            except FileExistsError:
                continue
        raise FileExistsError(f"no free directory name {prefix}* in {base}")
    except BaseException:
        os.close(base_fd)
        raise


class Offload:
    """See the module docstring. ``adopt(units)`` with ``units[i]`` = {name: array} moves the
    arrays into the file and returns the same dicts holding memory-mapped arrays (same values)."""

    def __init__(self, kind: str, directory: str | None, rank: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"offload must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        base = directory or tempfile.gettempdir()
        self._base_fd, self._dir_fd, self._dir_name = _make_private_dir(base, f"ringweave-offload-r{rank}-")
        self.dir = os.path.join(base, self._dir_name)
        self._file_name = f"rank{rank}.{kind}"
        self.path = os.path.join(self.dir, self._file_name)
        self._mm: mmap.mmap | None = None
        self._ranges: list[tuple[int, int]] = []  # per unit: [lo, hi) of its pages in the file
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ringweave-offload-r{rank}")
        self._behind: list[concurrent.futures.Future] = []
        self.nbytes = 0  # bytes of arrays in the file

    def adopt(self, units: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        layout, offset = [], 0
        for arrays in units:
            start = offset
            spots = {}
            for name, a in arrays.items():
                spots[name] = offset
                offset += _align(a.nbytes)
            layout.append((start, offset, spots))
        size = max(offset, PAGE)
        fd = private.create_file(self._file_name, self._dir_fd, read=True)  # 0600, relative to the checked directory
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file open
        out = []
        for arrays, (start, stop, spots) in zip(units, layout):
            mapped = {}
            for name, a in arrays.items():
                m = np.frombuffer(self._mm, dtype=a.dtype, count=a.size, offset=spots[name])
                m[...] = a  # the values move; the RAM copy is dropped by the caller
                mapped[name] = m
                self.nbytes += a.nbytes
            out.append(mapped)
            self._ranges.append((start, stop))
        for i in range(len(units)):
            self._release(i)
        return out

    # ---- around the optimizer step -----------------------------------------------------

    def prefetch(self, i: int) -> None:
        """Asks the kernel to read unit i's pages now (returns at once)."""
        if self._mm is not None and 0 <= i < len(self._ranges):
            lo, hi = self._ranges[i]
            if hi > lo:
                self._mm.madvise(mmap.MADV_WILLNEED, lo, hi - lo)

    def _release(self, i: int) -> None:
        lo, hi = self._ranges[i]
        if hi > lo:
            try:
                self._mm.flush(lo, hi - lo)  # msync: the step's values are in the file
                self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)  # and no longer this process's memory
            except OSError as e:  # e.g. ENOSPC, EIO: say which unit and which file
                raise OSError(e.errno, f"writing offloaded unit {i} back failed: {e.strerror}", self.path) from e

    def release(self, i: int) -> None:
        """Writes unit i back and drops it from memory, on the writer thread (behind the step)."""
        if self._mm is not None:
            self._behind.append(self._writer.submit(self._release, i))

    def finish(self) -> None:
        """Waits for every write-back (re-raising an I/O error)."""
        behind, self._behind = self._behind, []
        for f in behind:
            f.result()

    def release_all(self) -> None:
        """Drops every unit from memory now (after something read them all: a checkpoint)."""
        self.finish()
        for i in range(len(self._ranges)):
            self._release(i)

    def close(self) -> None:
        """Stops the writer and removes the file and its directory (idempotent). The arrays stay
        readable while referenced (the mapping lives until they go)."""
        self._writer.shutdown(wait=True)
        if self._dir_fd < 0:
            return
        for name, fd, rm in ((self._file_name, self._dir_fd, os.unlink), (self._dir_name, self._base_fd, os.rmdir)):
            try:
                rm(name, dir_fd=fd)
            except OSError:  # gone, or something else put in its place: left alone
                pass
        os.close(self._dir_fd)
        os.close(self._base_fd)
        self._dir_fd = self._base_fd = -1


class DiskOffload:
    """The offload part of a strategy (trainer/sharding/parts.py's contract, the module docstring):
    at setup the per-unit arrays move to the file; the update reads each unit ahead and writes it
    back behind. ``dir``, ``path``: the file's, once adopted."""

    def __init__(self, config) -> None:
        kind = config.offload
        if kind not in KINDS:
            raise ValueError(f"TrainConfig.offload must be one of {KINDS}, got {kind!r}")
        master = resolve_dtype(config.master_dtype)
        if kind == "params" and resolve_dtype(config.param_dtype) == master:
            raise ValueError(f"offload 'params' keeps the {master} master weights on disk beside a "
                             f"compute copy in memory; with param_dtype == master_dtype they are one array: "
                             f"set --param-dtype bfloat16 (or float16), or offload 'optimizer'")
        self.kind, self.directory = kind, config.offload_dir
        self.file: Offload | None = None

    @property
    def dir(self) -> str:
        return self.file.dir

    @property
    def path(self) -> str:
        return self.file.path

    def adopt(self, s) -> None:
        """After setup: moves ``s.states[i].buffers`` (and, kind "params", ``s.master[i]``) to the file."""
        self.file = Offload(self.kind, self.directory, s.group.rank)
        units = []
        for i in range(len(s.units)):
            arrays = dict(s.states[i].buffers)
            if self.kind == "params":
                arrays["master"] = s.master[i]
            units.append(arrays)
        for i, mapped in enumerate(self.file.adopt(units)):
            if self.kind == "params":
                s.master[i] = mapped.pop("master")
            s.states[i].buffers = mapped
        del units
        return_freed_memory()  # the RAM copies just replaced

    def begin_step(self) -> None:
        self.file.prefetch(0)  # unit 0's state is read while the forward and backward run

    def before_update(self, i: int) -> None:
        self.file.prefetch(i + 1)  # read ahead one unit

    def after_update(self, i: int) -> None:
        self.file.release(i)  # written back behind (after the strategy's own work on unit i)

    def finish_update(self) -> None:
        self.file.finish()

    def after_load(self) -> None:
        self.file.release_all()

    def memory(self, mem: dict) -> dict:
        offloaded = self.file.nbytes if self.file is not None else 0
        return {**mem, "offloaded": offloaded, "resident": mem["total"] - offloaded}

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def make_offload_strategy(name: str, model, config, group, **kw):
    """The data-parallel strategy ``name`` (trainer.sharding.make_strategy's) with its optimizer
    state (``config.offload="optimizer"``) or also its master weights (``"params"``) on disk."""
    if config.offload is None:
        raise ValueError("make_offload_strategy needs TrainConfig.offload ('optimizer' or 'params')")
    return make_strategy(name, model, config, group, offload=DiskOffload(config), **kw)
