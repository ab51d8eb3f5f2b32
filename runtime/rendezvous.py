"""The rendezvous seam: how a process finds its job's store, its rank and its generation.

``await rdzv.next_rendezvous(timeout_s)`` returns a :class:`Membership` (the generation's store,
rank, world size, generation, local rank and size, the store's host, the job's secret), as
torch elastic's ``RendezvousHandler.next_rendezvous`` does for torchrun; ``runtime.init`` only
wires an actor to it. Calling it again forms the next generation. :func:`from_env` picks the
implementation that the environment (or init's arguments) describes, without any I/O::

    StoreRendezvous     a store the caller gives (ranks as tasks of one process, tests)
    SingleRendezvous    one process alone: an in-memory store
    LauncherRendezvous  our launcher (RINGWEAVE_STORE_HOSTED=1), which hosts the store
    TorchrunRendezvous  torchrun (TORCHELASTIC_RUN_ID): rank 0 hosts it on a port every rank derives
    SlurmRendezvous     srun (SLURM_*, PMI under SLURM): rank 0 hosts it on the step's first node
    MpirunRendezvous    mpirun (OMPI_*, PMI_*): the first rank on mpirun's host hosts it
    EnvRendezvous       RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT by hand: rank 0 hosts it

Membership is fixed here: every generation has the same ranks. Each member counts the
generations it joined in the store (``rdzv/joins/<rank>``), so members that call equally
often agree; generation 0 keeps the attempt's namespace ``restart/<n>`` (where the launcher and
tools look), generation g > 0 has ``restart/<n>/gen/<g>``, and rank 0 records the latest in
``job/info``. A member out of step waits for addresses nobody publishes and times out naming them.

Not here: where the numbers come from under a scheduler (scheduler.py), the store (store.py,
store_tcp.py), the job's secret (jobsecret.py), wiring an actor to a membership (init.py).
"""

from __future__ import annotations

import abc
import asyncio
import errno
import logging
import os
import socket
import subprocess
from dataclasses import dataclass, field
from typing import ClassVar, Mapping

import msgpack

from runtime import auth, env, jobsecret, scheduler
from runtime.errors import ClosedError, ConnectError, RingweaveError, StoreTimeoutError, ranks_in_words
from runtime.store import MemoryStore, PrefixStore, Store
from runtime.store_server import StoreServer
from runtime.store_tcp import TCPStore

log = logging.getLogger("ringweave.rendezvous")

JOB_INFO_KEY = "job/info"  # {world_size, restart, generation}: set by rank 0, outside any namespace (tools)
JOINS_KEY = "rdzv/joins"  # in the attempt's namespace, + /<rank>: the generations that rank has joined
SERVER_LINGER_S = 5.0  # a store host that leaves waits this long at most for the others' clients to go


def attempt_prefix(restart: int) -> str:
    """The namespace of attempt ``restart`` (runtime/launch.py's ``attempt_prefix``)."""
    return f"restart/{restart}"


def generation_prefix(restart: int, generation: int) -> str:
    """The namespace of one generation: the attempt's own for 0, ``restart/<n>/gen/<g>`` after."""
    return attempt_prefix(restart) if generation == 0 else f"{attempt_prefix(restart)}/gen/{generation}"


@dataclass(frozen=True)
class Seat:
    """This process in its job as its environment (or init's arguments) describes it: read
    without I/O, before any generation forms."""
    rank: int                            # e.g. 3
    world_size: int                      # e.g. 4
    local_rank: int | None = None        # e.g. 1 (None: unknown)
    local_world_size: int | None = None  # ranks on this node, e.g. 2 (None: unknown)
    master_addr: str = "127.0.0.1"       # the store's host, e.g. "n01"
    master_port: int | None = None       # e.g. 15042 (None: no store to meet at)
    hosts_store: bool = False            # this process hosts the store
    job: str = "ringweave"               # e.g. "slurm-5042"
    restart: int = 0                     # attempts before this one
    addr_source: str = "default"         # where master_addr came from, e.g. "MASTER_ADDR"
    port_source: str = "unset"           # where master_port came from, e.g. "MASTER_PORT"
    threads: dict = field(default_factory=dict)  # thread variables the launcher implies, e.g. {"OMP_NUM_THREADS": "2"}
    nodelist: tuple[str, ...] = ()       # SLURM: the step's hosts, e.g. ("n01", "n02")


@dataclass(frozen=True)
class Membership:
    """What one generation gives a member: the same ranks and sizes on every member of it."""
    store: Store             # the generation's namespace of the job's store
    rank: int                # e.g. 3
    world_size: int          # e.g. 4
    generation: int          # 0, then 1, 2, ... one per next_rendezvous
    local_rank: int          # 0 where unknown
    local_world_size: int    # 1 where unknown
    master_addr: str         # the store's host as resolved (loopback: the ranks listen on loopback)
    job: str                 # e.g. "ringweave"
    restart: int             # the attempt, e.g. 0
    secret: bytes | None     # the job's secret (given, from RINGWEAVE_SECRET, or derived)


def not_joined_error(m: Membership, exc: StoreTimeoutError, timeout_s: float) -> StoreTimeoutError:
    """The timeout of a member of generation ``m`` waiting for the others' addresses (``addr/<rank>``
    keys of ``exc.keys``), said as ranks that have not joined: no store key in the message."""
    missing = sorted({int(k.rsplit("/", 1)[1]) for k in exc.keys if k.rsplit("/", 1)[-1].isdigit()})
    joined = [r for r in range(m.world_size) if r not in missing]
    generation = f", generation {m.generation}" if m.generation else ""
    where = f" (store at {m.master_addr})" if m.master_addr else ""
    return StoreTimeoutError(
        f"rank {m.rank} of {m.world_size} waited {exc.waited_s:.1f} s (timeout {timeout_s:g} s) for the others to "
        f"join job {m.job!r}{generation}{where}; not joined: {ranks_in_words(missing)} "
        f"(joined: {ranks_in_words(joined)}). Start all {m.world_size} ranks with the same MASTER_ADDR, MASTER_PORT "
        f"and WORLD_SIZE, or give them more time (RINGWEAVE_TIMEOUT_S)", keys=exc.keys, waited_s=exc.waited_s)


class Rendezvous(abc.ABC):
    """Forms generations of one job's members (see the module docstring).

    Legal call order: ``next_rendezvous* -> shutdown -> end``; ``next_rendezvous`` after
    ``shutdown`` raises :class:`ClosedError`, and ``shutdown`` again does nothing.
    """

    kind: ClassVar[str]
    process_of_job: ClassVar[bool] = True  # a rank of a real job: init limits threads and watches the parent

    def __init__(self, seat: Seat, *, secret: bytes | None = None):
        self.seat = seat
        self._secret = secret  # None: RINGWEAVE_SECRET, read at the first generation
        self._store: Store | None = None  # the job's store, once met
        self.master_addr = seat.master_addr  # resolved at the first generation
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.seat.rank}, world_size={self.seat.world_size}, job={self.seat.job!r})"

    @property
    def hosts_store(self) -> bool:
        """Whether this process hosts the job's store now."""
        return False

    async def next_rendezvous(self, timeout_s: float) -> Membership:
        """Forms this member's next generation: meets the job's store (the first time), then
        counts the generation in it and returns its namespace.

        Args:
            timeout_s: the bound of every wait (the store's connect, its requests).
        Returns:
            the generation's :class:`Membership`.
        Raises:
            RingweaveError: MASTER_ADDR does not resolve. ConnectError: the store's port is
                taken, or nothing answered in time. AuthenticationError: what answered is not
                this job's store, or a job beyond loopback has no secret. ClosedError: shut down.
        Cancellation: a store request that already left may have counted the generation.
        """
        if self._closed:
            raise ClosedError(f"{self!r} was shut down")
        if self._store is None:
            if self._secret is None:
                self._secret = auth.secret_from_env()
            self._store = await self._meet(timeout_s)
        seat = self.seat
        generation = await self._store.add(f"{attempt_prefix(seat.restart)}/{JOINS_KEY}/{seat.rank}", 1) - 1
        if self.process_of_job and seat.rank == 0 and seat.world_size > 1:  # how tools find the job (tools/status)
            await self._store.set(JOB_INFO_KEY, msgpack.packb(
                {"world_size": seat.world_size, "restart": seat.restart, "generation": generation}))
        view = PrefixStore(generation_prefix(seat.restart, generation), self._store)
        return Membership(view, seat.rank, seat.world_size, generation, seat.local_rank or 0,
                          seat.local_world_size or 1, self.master_addr, seat.job, seat.restart, self._secret)

    @abc.abstractmethod
    async def _meet(self, timeout_s: float) -> Store:
        """The job's store, reached (and hosted, where this process hosts it) once."""

    async def shutdown(self, linger_s: float = SERVER_LINGER_S) -> None:
        """Releases what the rendezvous holds (the store it made, the server it hosts once the
        other members' clients have left, within ``linger_s``). Idempotent."""
        self._closed = True


class StoreRendezvous(Rendezvous):
    """Fixed members meeting in a store the caller gives and keeps (ranks as tasks of one
    process share one; see runtime/testing.py): nothing is hosted, nothing closed."""
    kind = "store"
    process_of_job = False

    def __init__(self, seat: Seat, store: Store, *, secret: bytes | None = None):
        super().__init__(seat, secret=secret)
        self._given = store

    async def _meet(self, timeout_s: float) -> Store:
        """See base class."""
        return self._given


class SingleRendezvous(Rendezvous):
    """One process alone (no variables, or WORLD_SIZE=1 with no MASTER_PORT): an in-memory store."""
    kind = "single"

    async def _meet(self, timeout_s: float) -> Store:
        """See base class."""
        return MemoryStore(timeout_s)

    async def shutdown(self, linger_s: float = SERVER_LINGER_S) -> None:
        """See base class."""
        self._closed = True
        if self._store is not None:
            await self._store.close()


class TCPRendezvous(Rendezvous):
    """Fixed members meeting at the TCP store at MASTER_ADDR:MASTER_PORT, which one of them
    hosts (``seat.hosts_store``) or our launcher does. A job on loopback without a secret
    derives one (runtime/jobsecret.py); beyond loopback it refuses."""
    kind = "tcp"

    def __init__(self, seat: Seat, *, secret: bytes | None = None):
        super().__init__(seat, secret=secret)
        self.server: StoreServer | None = None
        self._secret_file: jobsecret.JobSecret | None = None

    @classmethod
    def detect(cls, environ: Mapping[str, str], placement: scheduler.Placement) -> bool:
        """Whether ``environ`` (read as ``placement``) is this implementation's launcher."""
        raise NotImplementedError

    @property
    def hosts_store(self) -> bool:
        """See base class."""
        return self.server is not None

    async def _meet(self, timeout_s: float) -> Store:
        """See base class."""
        seat = self.seat
        if seat.world_size > 1:
            self.master_addr = await self._resolve_master(seat.master_addr, seat.addr_source)
        who = f"rank {seat.rank}"
        if not self._secret:  # no job runs unauthenticated by accident (runtime/jobsecret.py)
            self._secret_file = await asyncio.to_thread(jobsecret.derive, seat.job, seat.master_port,
                                                        self.master_addr, who)
            self._secret = self._secret_file.secret
            log.info("rank %d: %s is unset; the job's secret is %s %s (this user's alone)", seat.rank, auth.SECRET_ENV,
                     "made in" if self._secret_file.made_here else "read from", self._secret_file.path)
        try:
            if seat.hosts_store:
                self.server = await self._host(seat.master_port)
            return await TCPStore.connect(self.master_addr, seat.master_port, secret=self._secret, job=seat.job,
                                          timeout_s=timeout_s, who={"rank": seat.rank})
        except BaseException:
            await self._release(linger_s=0)
            raise

    async def _host(self, port: int) -> StoreServer:
        """The store's server on ``port`` (every interface unless the store's host is loopback).

        Raises:
            ConnectError: the port is taken, naming it and where it came from.
        """
        seat = self.seat
        listen = self.master_addr if auth.is_loopback(self.master_addr) else "0.0.0.0"
        server = StoreServer(listen, port, secret=self._secret, job=seat.job)
        try:
            await server.start()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            given = seat.port_source in ("MASTER_PORT", "the master_port argument")
            how = f"set by {seat.port_source}={port}" if given else f"from {seat.port_source}"
            raise ConnectError(f"rank {seat.rank} cannot host the rendezvous store on {self.master_addr}:{port}: "
                               f"port {port} ({how}) is in use by another program or job; choose "
                               f"another port with MASTER_PORT") from exc
        return server

    async def _resolve_master(self, addr: str, source: str) -> str:
        """``addr`` if it resolves (or may later: a temporary DNS failure is left to the connect's
        retries).

        Raises:
            RingweaveError: the name does not resolve (a permanent DNS error), naming it and
                where it came from; nothing is retried.
        """
        try:
            await asyncio.get_running_loop().getaddrinfo(addr, None, type=socket.SOCK_STREAM)
            return addr
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_AGAIN:
                return addr
            replaced = await self._unresolved(addr)
            if replaced:
                return replaced
            raise RingweaveError(f"MASTER_ADDR {addr!r} ({source}) does not resolve: {exc.strerror}; "
                                 f"set MASTER_ADDR to a name or address of the store's host") from None

    async def _unresolved(self, addr: str) -> str | None:
        """Another address for a store host whose name does not resolve (None: there is none)."""
        return None

    async def shutdown(self, linger_s: float = SERVER_LINGER_S) -> None:
        """See base class."""
        self._closed = True
        await self._release(linger_s)

    async def _release(self, linger_s: float) -> None:
        """Closes the store's client and server and releases a derived secret (a failed first
        generation may be tried again: the secret is then derived again)."""
        store, self._store = self._store, None
        server, self.server = self.server, None
        try:
            if store is not None:
                await store.close()
        finally:
            if self._secret_file is not None:
                jobsecret.release(self._secret_file)  # removed when this rank leaves, if it made it
                self._secret_file = self._secret = None
            if server is not None:
                # The other ranks' store clients leave after the shutdown rendezvous; close the server
                # once they have (bounded), so none of them sees it closing under a request.
                loop = asyncio.get_running_loop()
                deadline = loop.time() + linger_s
                while server.statistics().clients > 0 and loop.time() < deadline:
                    await asyncio.sleep(0.01)
                await server.close()


class LauncherRendezvous(TCPRendezvous):
    """Under ``python -m runtime.launch`` (RINGWEAVE_STORE_HOSTED=1): the launcher hosts the
    store at MASTER_ADDR:MASTER_PORT and keeps it across restarts (RINGWEAVE_RESTART)."""
    kind = "launcher"

    @classmethod
    def detect(cls, environ: Mapping[str, str], placement: scheduler.Placement) -> bool:
        """See base class."""
        return env.STORE_HOSTED.get(environ)


class TorchrunRendezvous(TCPRendezvous):
    """A worker of torchrun (TORCHELASTIC_RUN_ID, with RANK, WORLD_SIZE, LOCAL_*, GROUP_RANK,
    MASTER_ADDR, MASTER_PORT). MASTER_PORT is torchrun's own store's, which is never read: it
    is unauthenticated. Rank 0 hosts our store on MASTER_ADDR's host (127.0.0.1 on one node) at
    a port every worker derives from TORCHELASTIC_RUN_ID, MASTER_ADDR and MASTER_PORT
    (scheduler.torchrun_port), or RINGWEAVE_STORE_PORT. Each torchrun attempt starts a new store."""
    kind = "torchrun"

    @classmethod
    def detect(cls, environ: Mapping[str, str], placement: scheduler.Placement) -> bool:
        """See base class."""
        return placement.launcher == "torchrun"

    async def _host(self, port: int) -> StoreServer:
        """See base class; a taken port names RINGWEAVE_STORE_PORT, MASTER_PORT being torchrun's."""
        try:
            return await super()._host(port)
        except ConnectError as exc:
            if not isinstance(exc.__cause__, OSError):
                raise
            raise ConnectError(
                f"rank {self.seat.rank} cannot host the rendezvous store on {self.master_addr}:{port}: port "
                f"{port} ({self.seat.port_source}) is in use by another program or job; set "
                f"{env.STORE_PORT.name} to a free port, the same for every rank (MASTER_PORT is torchrun's "
                f"own store's)") from exc.__cause__


class SlurmRendezvous(TCPRendezvous):
    """A task of srun (SLURM_*, or PMI inside a SLURM step; scheduler.py derives the store's
    host and port): rank 0 hosts the store, and a node name that does not resolve is replaced
    by the NodeAddr slurmctld has for it (``NodeName=n1 NodeAddr=10.0.0.5``)."""
    kind = "slurm"

    @classmethod
    def detect(cls, environ: Mapping[str, str], placement: scheduler.Placement) -> bool:
        """See base class."""
        return placement.launcher in ("slurm", "slurm-batch") or bool(placement.nodelist)

    async def _unresolved(self, addr: str) -> str | None:
        """See base class."""
        return await asyncio.to_thread(slurm_node_addr, addr) if addr in self.seat.nodelist else None


def slurm_node_addr(name: str) -> str | None:
    """The NodeAddr of SLURM node ``name`` (``scontrol show node``), None where unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "node", name, "-o"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    addr = scheduler.parse_slurm_node_addr(out)
    return addr if addr and addr != name else None


class MpirunRendezvous(TCPRendezvous):
    """A rank of mpirun (Open MPI's OMPI_*, or PMI_* of MPICH / Intel MPI): the store is
    hosted by the first local rank on mpirun's own host, which every rank finds in Open MPI's
    contact URI (scheduler.py), else by rank 0."""
    kind = "mpirun"

    @classmethod
    def detect(cls, environ: Mapping[str, str], placement: scheduler.Placement) -> bool:
        """See base class."""
        return placement.launcher in ("openmpi", "pmi")


class EnvRendezvous(TCPRendezvous):
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by hand (or init's arguments): rank 0
    hosts the store at MASTER_ADDR:MASTER_PORT and the others connect, retrying until their timeout."""
    kind = "env"

    @classmethod
    def detect(cls, environ: Mapping[str, str], placement: scheduler.Placement) -> bool:
        """See base class."""
        return True


IMPLEMENTATIONS: tuple[type[TCPRendezvous], ...] = (  # the first that detects its launcher wins
    LauncherRendezvous, TorchrunRendezvous, SlurmRendezvous, MpirunRendezvous, EnvRendezvous)


def from_env(environ: Mapping[str, str] | None = None, *, rank: int | None = None, world_size: int | None = None,
             master_addr: str | None = None, master_port: int | None = None, local_rank: int | None = None,
             local_world_size: int | None = None, job: str | None = None, store: Store | None = None,
             secret: bytes | None = None, cores: int | None = None) -> Rendezvous:
    """The rendezvous ``environ`` (``os.environ`` by default) describes, the arguments winning
    over it (as ``runtime.init``'s do); ``store``: a store the caller gives (StoreRendezvous);
    ``cores``: this process's CPUs, for Open MPI's thread count. No I/O.

    Raises:
        RingweaveError: a process that must not join as it is (scheduler.Placement.problem),
            rank or world size missing or out of range, no MASTER_PORT for WORLD_SIZE > 1, a
            variable that does not parse; the message names it.
    """
    environ = os.environ if environ is None else environ
    p = scheduler.placement(environ, scheduler.usable_cores() if cores is None else cores)
    placed_by_env = rank is None and world_size is None and master_addr is None
    if p.problem and placed_by_env:
        raise RingweaveError(p.problem)
    rank = p.rank if rank is None else rank
    world_size = p.world_size if world_size is None else world_size
    if rank is None and world_size is None:  # nothing says otherwise: a single process
        rank, world_size = 0, 1
    elif rank is None or world_size is None:
        raise RingweaveError(f"rank is {rank!r} and world size {world_size!r}: give both (arguments, or RANK "
                             f"and WORLD_SIZE / their mpirun or srun equivalents), or neither for one process")
    if not 0 <= rank < world_size:
        raise RingweaveError(f"rank {rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size})")
    store_hosted = env.STORE_HOSTED.get(environ)
    seat = Seat(rank, world_size, p.local_rank if local_rank is None else local_rank,
                p.local_world_size if local_world_size is None else local_world_size,
                master_addr or p.master_addr, p.master_port if master_port is None else master_port,
                p.hosts_store if placed_by_env and p.hosts_store is not None else rank == 0 and not store_hosted,
                job or p.job or "ringweave", p.restart,
                p.master_addr_source if master_addr is None else "the master_addr argument",
                p.master_port_source if master_port is None else "the master_port argument",
                scheduler.thread_settings(p, environ), p.nodelist)
    if store is not None:
        return StoreRendezvous(seat, store, secret=secret)
    if world_size > 1 and seat.master_port is None:
        raise RingweaveError("MASTER_PORT is not set: rank 0's store address is needed for WORLD_SIZE > 1")
    port_derived = p.master_port is not None and p.master_port_source != "MASTER_PORT"
    if world_size == 1 and (seat.master_port is None or port_derived and master_port is None):
        return SingleRendezvous(seat, secret=secret)  # one process: no server (unless a MASTER_PORT asks for one)
    return next(cls for cls in IMPLEMENTATIONS if cls.detect(environ, p))(seat, secret=secret)
