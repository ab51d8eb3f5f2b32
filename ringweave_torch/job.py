"""The ringweave job behind torch.distributed: one per process, and the store torch is given.

``runtime.init()`` forms the job, as for any ringweave program, on the loop thread of a
``collectives.Communicator`` (:func:`job`). torch's own rendezvous is answered from it:

* scheme ``ringweave://`` (``init_process_group(..., init_method="ringweave://")``): forms the job
  and yields a torch store over the job's store (:class:`JobStore`), with its rank and size;
* ``env://`` (torch's default) under our launcher (``RINGWEAVE_STORE_HOSTED=1``): the same. There
  torch's own ``env://`` cannot work, since rank 0 would host a TCPStore on MASTER_PORT, which the
  launcher's store holds; elsewhere (torchrun, hand-set variables) ``env://`` stays torch's.

The backend ignores the store torch passes it: its ranks meet through the job (sub-groups are
made on the job's runtime). What torch keeps in its store (Gloo's rendezvous, barriers) lives in
the job's store under ``torch/``. The job lives until the process ends (``Communicator`` closes,
or aborts after an uncaught exception, at exit) or :func:`shutdown`; ``destroy_process_group()``
leaves torch's groups only.

Not here: the process groups (backend.py).
"""

from __future__ import annotations

import importlib
import os
import threading
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from collectives import Communicator
from runtime.store import PrefixStore

torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module (the package's
# attribute of that name is its function)

__all__ = ["JobStore", "job", "formed", "shutdown", "install", "align", "subgroup"]

STORE_PREFIX = "torch/"  # torch's keys in the job's store
_lock = threading.Lock()
_job: Communicator | None = None
_stores: list["JobStore"] = []  # every JobStore made (a few per process)
_base = 1  # the ringweave gid of torch's group "1" (its default group "0" is the world, gid 0)


def job(rank: int | None = None, world_size: int | None = None) -> Communicator:
    """This process's ringweave job, formed by ``runtime.init()`` on first use: from RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT and ringweave's own variables, as our launcher sets them
    (``rank`` and ``world_size``, where given, win). Its ``Communicator`` also runs ringweave's
    own calls, on arrays and tensors, in the same job."""
    global _job
    with _lock:
        if _job is None:
            _job = Communicator(rank, world_size)
        return _job


def formed() -> Communicator | None:
    """The job, if this process formed it already (None: not yet)."""
    return _job


def shutdown(timeout: float = 30.0) -> None:
    """Leaves the job now (``Communicator.close``) instead of at exit. Idempotent."""
    global _job
    with _lock:
        comm, _job = _job, None
    if comm is not None:
        comm.close(timeout)


def align(comm: Communicator) -> None:
    """Puts torch's group names and the job's group ids in step, when torch makes its default
    group: every rank pads its runtime's groups to the largest count among the ranks."""
    global _base
    count = np.array([len(comm.runtime.groups)], np.int64)
    comm.all_reduce(count, op="max")
    _pad(comm, int(count[0]))
    _base = int(count[0])


def subgroup(comm: Communicator, ranks: list[int], name: str):
    """The job's group for torch's group ``name`` of ``ranks``, made on the members only.

    torch names a group made by ``new_group`` with a count that every rank advances, members or
    not; a member pads its runtime with groups it is no member of (never used) up to the id that
    count gives, so the members agree on the group's id, whichever groups they skipped.

    Raises:
        NotImplementedError: a name that is no count (``use_local_synchronization=True``).
        RuntimeError: the job has more groups than torch made (groups made outside torch).
    """
    try:
        want = _base + int(name) - 1
    except ValueError:
        raise NotImplementedError(f"ringweave: torch group {name!r} was made by new_group(..., "
                                  f"use_local_synchronization=True) or split_group, which the ringweave backend "
                                  f"does not support; call new_group on every rank") from None
    if len(comm.runtime.groups) > want:
        raise RuntimeError(f"ringweave: torch's group {name} of ranks {ranks} would be group {want}, but the job has "
                           f"{len(comm.runtime.groups)} already: groups were made on the job outside torch")
    _pad(comm, want)
    return comm.new_group(ranks)


def _pad(comm: Communicator, count: int) -> None:
    others = [r for r in range(comm.world_size) if r != comm.rank][:1]  # a group this rank is no member of
    while others and len(comm.runtime.groups) < count:
        comm.new_group(others)


class JobStore(dist.Store):
    """A torch store over the job's store (``runtime.store``), under :data:`STORE_PREFIX`: what
    torch's rendezvous hands ``init_process_group`` when ringweave formed the job. Blocking calls,
    run on the job's loop; waits are bounded by the store timeout torch sets."""

    def __init__(self, comm: Communicator, timeout: timedelta | None = None):
        super().__init__()
        _stores.append(self)  # torch's C++ side holds it past the Python reference: keep it alive here
        self._comm = comm
        self._store = PrefixStore(STORE_PREFIX, comm.runtime.store)
        if timeout is not None:
            self.set_timeout(timeout)

    def _run(self, fn, *args):
        return self._comm.submit(fn, *args).wait()

    def _timeout_s(self, timeout=None) -> float:
        return (timeout or self.timeout).total_seconds()

    def set(self, key: str, value) -> None:
        self._run(self._store.set, key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._run(self._store.get, key, self._timeout_s())

    def add(self, key: str, amount: int) -> int:
        return self._run(self._store.add, key, int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected = _bytes(expected)  # torch's "" is "only where the key is missing", ours is None
        return self._run(self._store.compare_set, key, expected or None, _bytes(desired))

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        self._run(self._store.wait, list(keys), self._timeout_s(timeout))

    def check(self, keys) -> bool:
        return self._run(self._store.check, list(keys))

    def delete_key(self, key: str) -> bool:
        return self._run(self._store.delete_key, key)

    def num_keys(self) -> int:
        return self._run(self._store.num_keys)

    def clone(self) -> "JobStore":
        return JobStore(self._comm, self.timeout)

    deleteKey, getNumKeys = delete_key, num_keys  # the names torch's C++ side calls them by


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _rendezvous(url: str, timeout: timedelta = dist.constants.default_pg_timeout, rank: int = -1,
                world_size: int = -1, **kwargs):
    """torch's rendezvous (a generator of ``(store, rank, world size)``), answered by the job;
    ``rank`` and ``world_size`` are those given to ``init_process_group`` (-1: none)."""
    comm = job(rank if rank >= 0 else None, world_size if world_size > 0 else None)
    yield JobStore(comm, timeout), comm.rank, comm.world_size
    raise RuntimeError("ringweave's rendezvous cannot be repeated in one process (torch asked a second time)")


def install() -> None:
    """Answers ``ringweave://``, and ``env://`` under our launcher. Idempotent."""
    handlers = torch_rendezvous._rendezvous_handlers
    if "ringweave" not in handlers:
        torch_rendezvous.register_rendezvous_handler("ringweave", _rendezvous)
    torchs = handlers["env"]
    if getattr(torchs, "ringweave", False):
        return

    def env(url: str, timeout: timedelta = dist.constants.default_pg_timeout, **kwargs):
        if os.environ.get("RINGWEAVE_STORE_HOSTED") == "1":  # our launcher's store holds MASTER_PORT
            return _rendezvous(url, timeout, **kwargs)
        return torchs(url, timeout=timeout, **kwargs)
    env.ringweave = True
    handlers["env"] = env
