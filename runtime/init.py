"""Joining a job: ``rt = await runtime.init()`` and ``await runtime.shutdown()``.

Where the numbers come from: the arguments of init(), else the environment as
runtime/scheduler.py reads it (RANK/WORLD_SIZE as our launcher and torchrun set them,
else Open MPI's, PMI's or SLURM's variables, with MASTER_ADDR, MASTER_PORT, local
ranks and threads derived from what the scheduler knows; MASTER_ADDR / MASTER_PORT in
the environment always win). A process that must not join as it is (a SLURM batch
script that srun did not start, a multi-node job whose store host is unknown) gets a
RingweaveError saying why at once, as does a MASTER_ADDR that does not resolve, or a
store port that another program holds. In a multi-rank job every rank watches its
parent and exits when its launcher dies (runtime/lifeline.py).

Steps (each under ``timeout_s``):

0. the secret: the argument, else ``RINGWEAVE_SECRET``, else (ranks on loopback) the job's
   derived secret (runtime/jobsecret.py); a job beyond loopback without one refuses at once.
1. the store: with ``RINGWEAVE_STORE_HOSTED=1`` (our launcher hosts it) every
   rank connects to MASTER_ADDR:MASTER_PORT; otherwise rank 0 (under mpirun: the
   first rank on mpirun's host) hosts it there and all ranks connect. Rank 0 sets
   ``job/info`` (world size, restart) for tools. Keys go under
   ``restart/<RINGWEAVE_RESTART>/`` so an attempt never reads the last one's keys.
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
import subprocess
import sys
import weakref

import msgpack

from runtime import auth, lifeline, scheduler, trace
from runtime.actor import Actor
from runtime.errors import ClosedError, ConnectError, PeerLostError, RingweaveError
from runtime import env as settings
from runtime.env import timeout_s as env_timeout_s
from runtime.group import ProcessGroup, Runtime
from runtime.sharedmem.segments import shm_usable
from runtime.store import MemoryStore, PrefixStore
from runtime.store_server import StoreServer
from runtime.store_tcp import TCPStore
from runtime import jobsecret

try:  # limits BLAS / OpenMP pools already loaded when the launcher implies a thread count
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - a dependency of scikit-learn
    threadpool_limits = None

log = logging.getLogger("ringweave.init")

_current: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("ringweave_runtime", default=None)
_process_default: Runtime | None = None

def read_env(env=None) -> dict:
    """Rank, sizes, the store's address and what else the launcher implies, from the
    environment (see the module docstring and runtime/scheduler.py); never raises for a
    process that must not join (``"problem"`` says why), only for a malformed variable."""
    env = os.environ if env is None else env
    p = scheduler.placement(env, scheduler.usable_cores())
    return {"rank": p.rank, "world_size": p.world_size, "local_rank": p.local_rank,
            "local_world_size": p.local_world_size, "master_addr": p.master_addr,
            "master_addr_source": p.master_addr_source, "master_port": p.master_port,
            "master_port_source": p.master_port_source,
            "master_port_derived": p.master_port is not None and p.master_port_source != "MASTER_PORT",
            "restart": p.restart, "job": p.job or "ringweave",
            "store_hosted": settings.STORE_HOSTED.get(env),
            "hosts_store": p.hosts_store, "launcher": p.launcher, "problem": p.problem,
            "threads": scheduler.thread_settings(p, env), "nodelist": p.nodelist}


JOB_INFO_KEY = "job/info"  # {world_size, restart}, set by rank 0 outside the restart prefix


def _limit_threads(thread_vars: dict[str, str]) -> None:
    """Sets the thread variables the launcher implies (scheduler.thread_settings) for what
    loads later, and limits BLAS / OpenMP pools that numpy and friends loaded already."""
    for name, value in thread_vars.items():
        os.environ[name] = value
    if not thread_vars or threadpool_limits is None:
        return
    count = int(next(iter(thread_vars.values())))
    if "OPENBLAS_NUM_THREADS" in thread_vars and "MKL_NUM_THREADS" in thread_vars:
        threadpool_limits(limits=count, user_api="blas")
    if "OMP_NUM_THREADS" in thread_vars:
        threadpool_limits(limits=count, user_api="openmp")


async def _resolve_master(addr: str, source: str, env: dict) -> str:
    """``addr`` if it resolves (or may later: a temporary DNS failure is left to the connect's
    retries); under SLURM a node name that does not resolve is replaced by the NodeAddr
    slurmctld has for it (``NodeName=n1 NodeAddr=10.0.0.5``).

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
        node_addr = await asyncio.to_thread(_slurm_node_addr, addr) if addr in env["nodelist"] else None
        if node_addr:
            return node_addr
        raise RingweaveError(f"MASTER_ADDR {addr!r} ({source}) does not resolve: {exc.strerror}; "
                             f"set MASTER_ADDR to a name or address of the store's host") from None


def _slurm_node_addr(name: str) -> str | None:
    """The NodeAddr of SLURM node ``name`` (``scontrol show node``), None where unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "node", name, "-o"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    addr = scheduler.parse_slurm_node_addr(out)
    return addr if addr and addr != name else None


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
    if settings.HOST.get():
        return settings.HOST.get()
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
    pid = settings.LAUNCHER_PID.pop(env)
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


_JOINING = object()
_by_loop: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # event loop -> its runtime, or _JOINING


async def init(rank: int | None = None, world_size: int | None = None, *, master_addr: str | None = None,
               master_port: int | None = None, local_rank: int | None = None,
               local_world_size: int | None = None, secret: bytes | str | None = None,
               job: str | None = None, timeout_s: float | None = None, store=None) -> Runtime:
    """Joins the job and returns this rank's :class:`Runtime` (``rt.world`` is the world group).

    Args override the environment. ``store`` may be any async Store shared by
    all ranks (tests); then no server is hosted or contacted. The secret is taken
    out of ``os.environ`` (``auth.secret_from_env``): processes this rank starts
    do not inherit it unless given it (``auth.export_secret``).

    Once per event loop (like ``torch.distributed.init_process_group`` per process): a second
    call while the runtime it made is open, or while another call is still joining, raises at
    once (call :func:`shutdown` first). Threads with loops of their own (the blocking facade,
    collectives/blocking.py) each have theirs; with ``store=``, one loop may hold several, one per
    task (tests, runtime.testing).

    Raises:
        RingweaveError: missing or inconsistent rank / size / port; init() called again.
        ConnectError, StoreTimeoutError, AuthenticationError: the rendezvous failed;
            the message names the address and the ranks missing.
        AuthenticationError: no secret was given and none can be derived (the store is
            beyond this host, or the private directory is not this user's alone); the
            message says how to set ``RINGWEAVE_SECRET``.
    """
    mine = _current.get()
    if mine is not None and not mine._closed:
        raise RingweaveError(f"init() was called again in this task while its runtime (rank {mine.rank} of "
                             f"{mine.world_size}) is open; call runtime.shutdown() first, or runtime.current()")
    loop = asyncio.get_running_loop() if store is None else None  # store=: several per loop (tests)
    if loop is not None:
        held = _by_loop.get(loop)
        if held is _JOINING:
            raise RingweaveError("init() was called again while an earlier call is still joining the job; "
                                 "await that one (one runtime per event loop)")
        if held is not None and not held._closed:
            raise RingweaveError(f"init() was called again while this event loop's runtime (rank {held.rank} of "
                                 f"{held.world_size}) is open; call runtime.shutdown() first, or runtime.current()")
        _by_loop[loop] = _JOINING
    try:
        rt = await _join(rank, world_size, master_addr=master_addr, master_port=master_port,
                         local_rank=local_rank, local_world_size=local_world_size, secret=secret, job=job,
                         timeout_s=timeout_s, store=store)
    except BaseException:
        if loop is not None:
            del _by_loop[loop]
        raise
    if loop is not None:
        _by_loop[loop] = rt
    return rt


async def _join(rank: int | None = None, world_size: int | None = None, *, master_addr: str | None = None,
                master_port: int | None = None, local_rank: int | None = None,
                local_world_size: int | None = None, secret: bytes | str | None = None,
                job: str | None = None, timeout_s: float | None = None, store=None) -> Runtime:
    """What :func:`init` does once it has checked that it may."""
    global _process_default
    die_with_launcher()
    env = read_env()
    placed_by_env = rank is None and world_size is None and master_addr is None
    if env["problem"] and placed_by_env:
        raise RingweaveError(env["problem"])
    addr_source = env["master_addr_source"] if master_addr is None else "the master_addr argument"
    port_source = env["master_port_source"] if master_port is None else "the master_port argument"
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
    trace.check_dir(settings.TRACE.get())  # a trace directory others may write in is refused before joining
    if isinstance(secret, str):
        secret = secret.encode()
    secret = secret if secret is not None else auth.secret_from_env()

    loopback = auth.is_loopback(master_addr)
    server = secret_file = None
    own_store = store is None
    if store is None:  # a process of a real job (not ranks sharing a store in one process)
        _limit_threads(env["threads"])
        if world_size > 1 and settings.WATCH_PARENT.get():
            lifeline.watch_parent(f"rank {rank}")
        if world_size > 1 and master_port is None:
            raise RingweaveError("MASTER_PORT is not set: rank 0's store address is needed for WORLD_SIZE > 1")
        if world_size > 1:
            master_addr = await _resolve_master(master_addr, addr_source, env)
            loopback = auth.is_loopback(master_addr)
        if world_size == 1 and (master_port is None or env["master_port_derived"] and master_port_arg is None):
            store = MemoryStore(timeout_s)  # one process: no server (unless a MASTER_PORT asks for one)
        else:
            hosts = env["hosts_store"] if placed_by_env and env["hosts_store"] is not None else (
                rank == 0 and not env["store_hosted"])
            if not secret:  # no job runs unauthenticated by accident (runtime/jobsecret.py)
                secret_file = await asyncio.to_thread(jobsecret.derive, job, master_port, master_addr, f"rank {rank}")
                secret = secret_file.secret
                log.info("rank %d: %s is unset; the job's secret is %s %s (this user's alone)", rank, auth.SECRET_ENV,
                         "made in" if secret_file.made_here else "read from", secret_file.path)
            try:
                server, store = await _host_and_connect(rank, hosts, master_addr, master_port, port_source,
                                                        secret=secret, job=job, timeout_s=timeout_s)
            except BaseException:
                jobsecret.release(secret_file)
                raise
    prefixed = PrefixStore(f"restart/{env['restart']}", store, owns_store=own_store)
    actor = Actor(rank, world_size, secret=secret, job=job)
    try:
        if own_store and rank == 0 and world_size > 1:  # how tools find the job through its store (tools/status.py)
            await store.set(JOB_INFO_KEY, msgpack.packb({"world_size": world_size, "restart": env["restart"]}))
        if world_size > 1:
            host = "127.0.0.1" if loopback else _advertised_host(master_addr)
            _, port = await actor.listen("127.0.0.1" if loopback else "0.0.0.0", 0)
            me = {"host": host, "port": port, "node": node_id(), "shm": shm_usable()}
            await prefixed.set(f"addr/{rank}", msgpack.packb(me))
            keys = [f"addr/{r}" for r in range(world_size)]
            await prefixed.wait(keys, timeout_s)
            peers = {r: msgpack.unpackb(await prefixed.get(f"addr/{r}")) for r in range(world_size)}
            await actor.connect_peers({r: (p["host"], p["port"]) for r, p in peers.items()}, timeout_s)
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
        jobsecret.release(secret_file)
        raise
    rt = Runtime(actor, prefixed, timeout_s=timeout_s, local_rank=local_rank or 0,
                 local_world_size=local_world_size or 1, nodes=nodes)
    if not shm_everywhere:
        rt.shm_enabled = False
        if shm_usable():
            log.warning("rank %d: shared memory is off for this job: some ranks have RINGWEAVE_SHM=0 "
                        "or no writable /dev/shm", rank)
    rt.store_server = server
    rt.secret_file = secret_file  # removed when this rank leaves, if it made it
    _current.set(rt)
    _process_default = rt
    log.debug("rank %d of %d joined job %r", rank, world_size, job)
    return rt


async def _host_and_connect(rank: int, hosts: bool, master_addr: str, master_port: int, port_source: str, *,
                            secret: bytes | None, job: str, timeout_s: float):
    """Hosts the store at ``master_addr:master_port`` when ``hosts`` (every interface unless that
    address is loopback), then connects to it. Returns (the server or None, the client).

    Raises:
        ConnectError: the port is taken (naming it and ``port_source``), or nothing answered.
        AuthenticationError: what answered is not this job's store.
    """
    server = None
    if hosts:
        listen = master_addr if auth.is_loopback(master_addr) else "0.0.0.0"
        server = StoreServer(listen, master_port, secret=secret, job=job)
        try:
            await server.start()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            given = port_source in ("MASTER_PORT", "the master_port argument")
            how = f"set by {port_source}={master_port}" if given else f"from {port_source}"
            raise ConnectError(f"rank {rank} cannot host the rendezvous store on {master_addr}:{master_port}: "
                               f"port {master_port} ({how}) is in use by another program or job; choose "
                               f"another port with MASTER_PORT") from exc
    try:
        return server, await TCPStore.connect(master_addr, master_port, secret=secret, job=job,
                                              timeout_s=timeout_s, who={"rank": rank})
    except BaseException:
        if server is not None:
            await server.close()
        raise


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
        jobsecret.release(getattr(rt, "secret_file", None))
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
