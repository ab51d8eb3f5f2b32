"""Joining a job: ``rt = await runtime.init()`` and ``await runtime.shutdown()``.

Where the numbers come from, first found wins::

    arguments of init()  >  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE  (torchrun, our launcher)
                         >  OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE  (mpirun)
                         >  PMI_RANK / PMI_SIZE                              (MPICH, Intel MPI)
                         >  SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID      (srun)
    MASTER_ADDR (default 127.0.0.1), MASTER_PORT (required when WORLD_SIZE > 1)

Steps (each under ``timeout_s``):

1. the store: with ``RINGWEAVE_STORE_HOSTED=1`` (our launcher hosts it) every
   rank connects to MASTER_ADDR:MASTER_PORT; otherwise rank 0 hosts it there and
   all ranks connect. Keys go under ``restart/<RINGWEAVE_RESTART>/`` so an
   attempt never reads the last one's keys.
2. listen on port 0 (loopback when MASTER_ADDR is loopback, else every interface),
   publish ``addr/<rank>`` = {host, port, node} where ``node`` names the machine
   (hostname + boot id: ranks with the same node share memory).
3. read every rank's address; connect to lower ranks, accept higher ones.

The current runtime is kept per task context (``contextvars``), so several
runtimes can live in one event loop (runtime.testing) and collectives called
without ``group=`` use the world of the runtime of the calling task.

Not here: the store itself (store.py, store_tcp.py), the mesh (actor.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import errno
import logging
import os
import signal
import socket
import sys

import msgpack

from runtime import auth
from runtime.actor import Actor
from runtime.errors import ClosedError, ConnectError, PeerLostError, RingweaveError
from runtime.env import timeout_s as env_timeout_s
from runtime.group import ProcessGroup, Runtime
from runtime.shm import shm_usable
from runtime.store import PrefixStore

log = logging.getLogger("ringweave.init")

_current: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("ringweave_runtime", default=None)
_process_default: Runtime | None = None

_ENV_SOURCES = [  # (rank, size, local rank, local size)
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
]


def _int_env(name: str, env) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    digits = value.split("(")[0].split(",")[0]  # SLURM_NTASKS_PER_NODE may read "4(x2)"
    try:
        return int(digits)
    except ValueError:
        raise RingweaveError(f"environment variable {name}={value!r} is not an integer") from None


def read_env(env=None) -> dict:
    """Rank, sizes and master address from the environment (see module docstring)."""
    env = os.environ if env is None else env
    out = {"rank": None, "world_size": None, "local_rank": None, "local_world_size": None}
    for names in _ENV_SOURCES:
        rank, size = _int_env(names[0], env), _int_env(names[1], env)
        if rank is not None and size is not None:
            out.update(rank=rank, world_size=size, local_rank=_int_env(names[2], env),
                       local_world_size=_int_env(names[3], env))
            break
    out["master_addr"] = env.get("MASTER_ADDR") or "127.0.0.1"
    out["master_port"] = _int_env("MASTER_PORT", env)
    out["restart"] = _int_env("RINGWEAVE_RESTART", env) or 0
    out["job"] = env.get("RINGWEAVE_JOB") or "ringweave"
    out["store_hosted"] = env.get("RINGWEAVE_STORE_HOSTED") == "1"
    return out


def node_id() -> str:
    """Names this machine: ranks with equal node ids can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _advertised_host(master_addr: str) -> str:
    """The address of this host that the master can reach (RINGWEAVE_HOST overrides)."""
    if os.environ.get("RINGWEAVE_HOST"):
        return os.environ["RINGWEAVE_HOST"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(master_addr), 9))  # no packet is sent for UDP connect
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def die_with_launcher(env=None) -> bool:
    """When started by our launcher (RINGWEAVE_LAUNCHER_PID), asks the kernel to send this
    process SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG), so that a launcher killed
    with SIGKILL, which cannot stop its ranks itself, leaves none behind. Returns whether it
    was armed. If the launcher is already gone, SIGTERM is raised at once.

    The variable is taken out of ``env``: it names this process's parent only. A child of
    the rank (a worker, a nested job) that inherited it would find its parent is not that
    pid and SIGTERM itself at its own init."""
    env = os.environ if env is None else env
    pid = env.pop("RINGWEAVE_LAUNCHER_PID", None)
    if not pid or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
            return False
    except (OSError, AttributeError, ValueError):
        return False
    if os.getppid() != int(pid):  # the launcher died before we armed it
        os.kill(os.getpid(), signal.SIGTERM)
    return True


async def init(rank: int | None = None, world_size: int | None = None, *, master_addr: str | None = None,
               master_port: int | None = None, local_rank: int | None = None,
               local_world_size: int | None = None, secret: bytes | str | None = None,
               job: str | None = None, timeout_s: float | None = None, store=None) -> Runtime:
    """Joins the job and returns this rank's :class:`Runtime` (``rt.world`` is the world group).

    Args override the environment. ``store`` may be any async Store shared by
    all ranks (tests); then no server is hosted or contacted.

    Raises:
        RingweaveError: missing or inconsistent rank / size / port.
        ConnectError, StoreTimeoutError, AuthenticationError: the rendezvous failed;
            the message names the address and the ranks missing.
    """
    global _process_default
    die_with_launcher()
    env = read_env()
    rank = env["rank"] if rank is None else rank
    world_size = env["world_size"] if world_size is None else world_size
    if rank is None and world_size is None:  # nothing says otherwise: a single process
        rank, world_size = 0, 1
    elif rank is None or world_size is None:
        raise RingweaveError(f"rank is {rank!r} and world size {world_size!r}: give both (arguments, or RANK "
                             f"and WORLD_SIZE / their mpirun or srun equivalents), or neither for one process")
    if not 0 <= rank < world_size:
        raise RingweaveError(f"rank {rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size})")
    local_rank = env["local_rank"] if local_rank is None else local_rank
    local_world_size = env["local_world_size"] if local_world_size is None else local_world_size
    master_addr = master_addr or env["master_addr"]
    master_port_arg = master_port
    master_port = env["master_port"] if master_port is None else master_port
    job = job or env["job"]
    timeout_s = env_timeout_s() if timeout_s is None else timeout_s  # RINGWEAVE_TIMEOUT_S, read now
    if isinstance(secret, str):
        secret = secret.encode()
    secret = secret if secret is not None else auth.secret_from_env()

    loopback = auth.is_loopback(master_addr)
    server = None
    own_store = store is None
    if store is None:
        if world_size > 1 and master_port is None:
            raise RingweaveError("MASTER_PORT is not set: rank 0's store address is needed for WORLD_SIZE > 1")
        from runtime.store import MemoryStore
        from runtime.store_tcp import StoreServer, TCPStore
        if world_size == 1 and master_port is None:
            store = MemoryStore(timeout_s)
        else:
            if rank == 0 and not env["store_hosted"]:
                server = StoreServer(master_addr if loopback else "0.0.0.0", master_port, secret=secret, job=job)
                try:
                    await server.start()
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE:
                        raise
                    source = ("the master_port argument" if master_port_arg is not None
                              else env.get("master_port_source", "MASTER_PORT"))
                    raise ConnectError(f"rank 0 cannot host the rendezvous store on {master_addr}:{master_port}: "
                                       f"port {master_port} (set by {source}={master_port}) is in use by another "
                                       f"program; choose another port") from exc
            try:
                store = await TCPStore.connect(master_addr, master_port, secret=secret, job=job,
                                               timeout_s=timeout_s, who={"rank": rank})
            except BaseException:
                if server is not None:
                    await server.close()
                raise
    prefixed = PrefixStore(f"restart/{env['restart']}", store, owns_store=own_store)
    actor = Actor(rank, world_size, secret=secret, job=job)
    try:
        if world_size > 1:
            host = "127.0.0.1" if loopback else _advertised_host(master_addr)
            _, port = await actor.listen("127.0.0.1" if loopback else "0.0.0.0", 0)
            me = {"host": host, "port": port, "node": node_id(), "shm": shm_usable()}
            await prefixed.set(f"addr/{rank}", msgpack.packb(me))
            keys = [f"addr/{r}" for r in range(world_size)]
            await prefixed.wait(keys, timeout_s)
            peers = {r: msgpack.unpackb(await prefixed.get(f"addr/{r}")) for r in range(world_size)}
            await actor.connect_mesh({r: (p["host"], p["port"]) for r, p in peers.items()}, timeout_s)
            nodes = [peers[r]["node"] for r in range(world_size)]
            # Shared memory only where every rank allows it: one rank with RINGWEAVE_SHM=0
            # would otherwise pick other algorithms than its peers (a mismatch, or a wait).
            shm_everywhere = all(peers[r].get("shm", False) for r in range(world_size))
        else:
            nodes = [node_id()]
            shm_everywhere = True
    except BaseException:
        await actor.close()
        await prefixed.close()
        if server is not None:
            await server.close()
        raise
    rt = Runtime(actor, prefixed, timeout_s=timeout_s, local_rank=local_rank or 0,
                 local_world_size=local_world_size or 1)
    rt.nodes = nodes
    if not shm_everywhere:
        rt.shm_enabled = False
        if shm_usable():
            log.warning("rank %d: shared memory is off for this job: some ranks have RINGWEAVE_SHM=0 "
                        "or no writable /dev/shm", rank)
    rt.store_server = server
    _current.set(rt)
    _process_default = rt
    log.debug("rank %d of %d joined job %r", rank, world_size, job)
    return rt


def set_current(rt: Runtime | None) -> None:
    """Makes ``rt`` the runtime of the calling task context (runtime.testing uses it)."""
    _current.set(rt)


def current() -> Runtime:
    """The runtime of the calling task, else the last one ``init`` made in this process.

    Raises:
        ClosedError: no runtime (call ``await runtime.init()`` first).
    """
    rt = _current.get() or _process_default
    if rt is None or rt._closed:
        raise ClosedError("no ringweave runtime: call `await runtime.init()` first")
    return rt


def world() -> ProcessGroup:
    """The world group of :func:`current`."""
    return current().world


ABORT_KEY = "abort"  # in the attempt's store namespace: the first rank that aborted (read by the launcher)
ABORT_RECORD_TIMEOUT_S = 1.0  # the store write of an abort is best effort: the peers are told either way
_FROM_CONTEXT = object()  # shutdown(exc=...) default: the exception being handled, if any (sys.exc_info)


def abort_reason(exc: BaseException | None) -> BaseException | None:
    """The exception a rank leaves the job because of, or None when leaving is orderly: no
    exception, ``SystemExit`` with code 0 or None, ``GeneratorExit``."""
    if exc is None or isinstance(exc, GeneratorExit):
        return None
    if isinstance(exc, SystemExit) and exc.code in (None, 0):
        return None
    return exc


async def shutdown(rt: Runtime | None = None, timeout_s: float = 30.0, *, exc=_FROM_CONTEXT) -> None:
    """Leaves the job.

    Orderly (no exception): waits (bounded by ``timeout_s``) for every rank to arrive here, so
    the rank hosting the store does not close it under the others, then closes everything. The
    wait ends early when a peer aborts or is lost: nobody else will come.

    Because of an exception: ``exc``, by default the exception being handled or unwinding
    where this is called (``sys.exc_info()``: ``try: ... finally: await runtime.shutdown()``
    leaves in an orderly way after a clean run and aborts after an error). Then this is
    :func:`abort`: no rendezvous, every peer told at once. ``exc=None`` forces the orderly way.
    """
    global _process_default
    if exc is _FROM_CONTEXT:
        exc = sys.exc_info()[1]
    reason = abort_reason(exc)
    if reason is not None:
        await abort(reason, rt)
        return
    rt = rt or _current.get() or _process_default
    if rt is None or rt._closed:
        return
    try:
        if rt.world_size > 1 and rt.store is not None and not rt.actor.lost_peers():
            # Everyone arrives before anyone leaves: a rank that closed early would look
            # like a lost peer to a rank still finishing its last collective.
            await _rendezvous(rt, timeout_s)
    except (RingweaveError, OSError) as exc:
        log.warning("rank %d: shutdown rendezvous failed: %s", rt.rank, exc)
    finally:
        await _close(rt)


async def _rendezvous(rt: Runtime, timeout_s: float) -> None:
    """Waits until every rank has reached shutdown, or a peer aborts or is lost (then at once).

    Raises:
        StoreTimeoutError: not every rank came within ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    gone = loop.create_future()  # a peer aborted or was lost: it will never arrive

    def on_lost(peer: int, exc: BaseException) -> None:
        if not gone.done():
            gone.set_result(exc)

    rt.actor.add_lost_listener(on_lost)
    if await rt.store.add("shutdown", 1) == rt.world_size:
        await rt.store.set("shutdown/all", b"1")
    everyone = loop.create_task(rt.store.get("shutdown/all", timeout_s))
    try:
        await asyncio.wait([everyone, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not everyone.done():
            everyone.cancel()
            await asyncio.gather(everyone, return_exceptions=True)
    if everyone.done() and not everyone.cancelled():
        everyone.result()  # raises the store's timeout, if that is how it ended
    elif gone.done():
        log.info("rank %d: leaving without the others: %s", rt.rank, gone.result())


async def abort(exc: BaseException | None = None, rt: Runtime | None = None) -> None:
    """Leaves the job at once because of ``exc`` (what ``torch.distributed``'s abort does for
    a process group, for the whole runtime): records it in the store (the first rank that
    aborts is the job's root cause, which the launcher reports), tells every peer with the
    goodbye frame (each raises :class:`PeerAbortedError` naming this rank and ``exc``'s type
    and message, in whatever it waits on, within milliseconds), and closes. No rendezvous.

    A rank that leaves because of a peer's failure (``exc`` a PeerLostError) does not record
    itself as the root cause. Idempotent; a closed or absent runtime is left alone.
    """
    rt = rt or _current.get() or _process_default
    if rt is None or rt._closed:
        return
    if exc is None:
        exc = RingweaveError(f"rank {rt.rank} called runtime.abort()")
    if not isinstance(exc, PeerLostError) and rt.store is not None and rt.world_size > 1:
        record = msgpack.packb({"rank": rt.rank, "type": type(exc).__name__, "message": str(exc)[:2000]})
        try:  # before the peers hear of it: a peer that fails because of it must not look like the cause
            async with asyncio.timeout(ABORT_RECORD_TIMEOUT_S):
                await rt.store.compare_set(ABORT_KEY, None, record)
        except (RingweaveError, OSError, TimeoutError) as store_exc:
            log.debug("rank %d: could not record the abort in the store: %s", rt.rank, store_exc)
    log.info("rank %d: aborting the job: %s: %s", rt.rank, type(exc).__name__, exc)
    await _close(rt, exc)


async def _close(rt: Runtime, reason: BaseException | None = None) -> None:
    """Closes ``rt`` (its goodbye carries ``reason``), then the store server it hosts, if any."""
    global _process_default
    server = getattr(rt, "store_server", None)
    try:
        await rt.close(reason)
    finally:
        if server is not None:
            # The other ranks' store clients leave after the rendezvous; close the server
            # once they have (bounded), so none of them sees it closing under a request.
            deadline = asyncio.get_running_loop().time() + 5.0
            while server.statistics().clients > 0 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            await server.close()
        if _process_default is rt:
            _process_default = None
        if _current.get() is rt:
            _current.set(None)
