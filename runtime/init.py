"""Joining a job: ``rt = await runtime.init()`` and ``await runtime.shutdown()``.

init asks a rendezvous (runtime/rendezvous.py: chosen from the arguments and the environment,
or given) for a generation's membership (store, rank, world size) and wires this rank's actor
to it, each step under ``timeout_s``:

1. limits the thread pools the launcher implies and, in a multi-rank job, watches its parent
   (runtime/lifeline.py); a rank of our launcher also dies with it (``die_with_launcher``);
2. listens on port 0 (loopback when the store's host is loopback, else every interface) and
   publishes ``addr/<rank>`` = {host, port, node, shm} in the generation's namespace, where
   ``node`` names the machine (hostname + boot id: ranks with the same node share memory);
3. reads every rank's address, connects to lower ranks and accepts higher ones, and turns
   shared memory off unless every rank allows it.

A process that must not join as it is (a SLURM batch script, a multi-node job whose store
host is unknown, a MASTER_ADDR that does not resolve, a store port another program holds)
gets a RingweaveError saying why at once. ``shutdown`` waits for every rank, then closes;
``abort`` leaves at once and tells every peer why.

The current runtime is kept per task context (``contextvars``), so several runtimes can live in
one event loop (runtime.testing) and collectives called without ``group=`` use the world of the
runtime of the calling task.

Not here: finding the store, rank and generation (rendezvous.py), the store itself (store.py,
store_tcp.py), the mesh (actor.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import logging
import os
import signal
import socket
import sys
import weakref

import msgpack

from runtime import auth, env, lifeline, rendezvous as rdzv, scheduler, trace, warmup
from runtime.actor import Actor
from runtime.errors import ClosedError, PeerLostError, RingweaveError, StoreTimeoutError
from runtime.group import ProcessGroup
from runtime.rankruntime import RankRuntime
from runtime.sharedmem.segments import shm_usable

try:  # limits BLAS / OpenMP pools already loaded when the launcher implies a thread count
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - a dependency of scikit-learn
    threadpool_limits = None

log = logging.getLogger("ringweave.init")

_current: contextvars.ContextVar[RankRuntime | None] = contextvars.ContextVar("ringweave_runtime", default=None)
_process_default: RankRuntime | None = None

def read_env(environ=None) -> dict:
    """Rank, sizes, the store's address and what else the launcher implies, from the
    environment (see runtime/scheduler.py); never raises for a process that must not join
    (``"problem"`` says why), only for a malformed variable."""
    environ = os.environ if environ is None else environ
    p = scheduler.placement(environ, scheduler.usable_cores())
    return {"rank": p.rank, "world_size": p.world_size, "local_rank": p.local_rank,
            "local_world_size": p.local_world_size, "master_addr": p.master_addr,
            "master_addr_source": p.master_addr_source, "master_port": p.master_port,
            "master_port_source": p.master_port_source,
            "master_port_derived": p.master_port is not None and p.master_port_source != "MASTER_PORT",
            "restart": p.restart, "job": p.job or "ringweave",
            "store_hosted": env.STORE_HOSTED.get(environ),
            "hosts_store": p.hosts_store, "launcher": p.launcher, "problem": p.problem,
            "threads": scheduler.thread_settings(p, environ), "nodelist": p.nodelist}


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
    if env.HOST.get():
        return env.HOST.get()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(master_addr), 9))  # no packet is sent for UDP connect
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def die_with_launcher(environ=None) -> bool:
    """When started by our launcher (RINGWEAVE_LAUNCHER_PID), asks the kernel to send this
    process SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG), so that a launcher killed
    with SIGKILL, which cannot stop its ranks itself, leaves none behind. Returns whether it
    was armed. If the launcher is already gone, SIGTERM is raised at once.

    The variable is taken out of ``environ``: it names this process's parent only. A child of
    the rank (a worker, a nested job) that inherited it would find its parent is not that
    pid and SIGTERM itself at its own init."""
    environ = os.environ if environ is None else environ
    pid = env.LAUNCHER_PID.pop(environ)
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
               job: str | None = None, timeout_s: float | None = None, store=None,
               rendezvous: rdzv.Rendezvous | None = None) -> RankRuntime:
    """Joins the job and returns this rank's :class:`RankRuntime` (``rt.world`` is the world group).

    Args override the environment. ``store`` may be any async Store shared by
    all ranks (tests); then no server is hosted or contacted. The secret is taken
    out of ``os.environ`` (``auth.secret_from_env``): processes this rank starts
    do not inherit it unless given it (``auth.export_secret``). ``rendezvous``: one
    of the caller's (runtime/rendezvous.py), instead of all of these: each call forms
    its next generation (``rt.generation``), and the caller shuts it down at the end.

    Once per event loop (like ``torch.distributed.init_process_group`` per process): a second
    call while the runtime it made is open, or while another call is still joining, raises at
    once (call :func:`shutdown` first). Threads with loops of their own (the blocking facade,
    collectives/blocking.py) each have theirs; with ``store=`` or ``rendezvous=``, one loop may
    hold several, one per task (tests, runtime.testing).

    While it joins, the warm-ups the layers above registered (runtime/warmup.py: the imports and
    kernels of the collectives) run once per process on a worker thread, so the first call does
    not stop the event loop to import or compile.

    Raises:
        RingweaveError: missing or inconsistent rank / size / port; init() called again;
            ``rendezvous`` given with any of rank, sizes, address, port, secret, job, store.
        ConnectError, StoreTimeoutError, AuthenticationError: the rendezvous failed;
            the message names the address and the ranks missing.
        AuthenticationError: no secret was given and none can be derived (the store is
            beyond this host, or the private directory is not this user's alone); the
            message says how to set ``RINGWEAVE_SECRET``.
    """
    if rendezvous is not None and any(a is not None for a in (rank, world_size, master_addr, master_port, local_rank,
                                                              local_world_size, secret, job, store)):
        raise RingweaveError("init(rendezvous=...) takes the rank, sizes, store, job and secret from the "
                             "rendezvous: give none of them")
    mine = _current.get()
    if mine is not None and not mine._closed:
        raise RingweaveError(f"init() was called again in this task while its runtime (rank {mine.rank} of "
                             f"{mine.world_size}) is open; call runtime.shutdown() first, or runtime.current()")
    shared = store is not None or rendezvous is not None  # several per loop (tests)
    loop = asyncio.get_running_loop() if not shared else None
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
        rt = await warmup.alongside(_join(rank, world_size, master_addr=master_addr, master_port=master_port,
                                          local_rank=local_rank, local_world_size=local_world_size, secret=secret,
                                          job=job, timeout_s=timeout_s, store=store, rendezvous=rendezvous))
    except BaseException:
        if loop is not None:
            del _by_loop[loop]
        raise
    if loop is not None:
        _by_loop[loop] = rt
    try:
        await warmup.joined(rt)  # what the layers above run once joined (runtime/warmup.py on_join)
    except BaseException as exc:
        await abort(exc, rt)
        raise
    return rt


async def _join(rank: int | None = None, world_size: int | None = None, *, master_addr: str | None = None,
                master_port: int | None = None, local_rank: int | None = None,
                local_world_size: int | None = None, secret: bytes | str | None = None,
                job: str | None = None, timeout_s: float | None = None, store=None,
                rendezvous: rdzv.Rendezvous | None = None) -> RankRuntime:
    """What :func:`init` does once it has checked that it may."""
    global _process_default
    die_with_launcher()
    owned = rendezvous is None  # chosen here: shut down with the runtime
    if owned:
        rendezvous = rdzv.from_env(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                                   local_rank=local_rank, local_world_size=local_world_size, job=job, store=store,
                                   secret=secret.encode() if isinstance(secret, str) else secret)
    timeout_s = env.timeout_s() if timeout_s is None else timeout_s  # RINGWEAVE_TIMEOUT_S, read now
    trace.check_dir(env.TRACE.get())  # a trace directory others may write in is refused before joining
    seat = rendezvous.seat
    if rendezvous.process_of_job:  # a process of a real job (not ranks sharing a store in one process)
        _limit_threads(seat.threads)
        if seat.world_size > 1 and env.WATCH_PARENT.get():
            lifeline.watch_parent(f"rank {seat.rank}")
    try:
        membership = await rendezvous.next_rendezvous(timeout_s)
        rt = await _wire(membership, timeout_s, rendezvous if owned else None)
    except BaseException:
        if owned:
            await rendezvous.shutdown(linger_s=0)
        raise
    _current.set(rt)
    _process_default = rt
    log.debug("rank %d of %d joined job %r (generation %d)", rt.rank, rt.world_size, membership.job,
              membership.generation)
    return rt


async def _wire(m: rdzv.Membership, timeout_s: float, owned: rdzv.Rendezvous | None) -> RankRuntime:
    """This rank's actor, connected to every member of generation ``m`` through the addresses
    they publish in its store, and the runtime over it (which shuts ``owned`` down with it)."""
    rank, world_size = m.rank, m.world_size
    actor = Actor(rank, world_size, secret=m.secret, job=m.job)
    try:
        if world_size > 1:
            loopback = auth.is_loopback(m.master_addr)
            host = "127.0.0.1" if loopback else _advertised_host(m.master_addr)
            _, port = await actor.listen("127.0.0.1" if loopback else "0.0.0.0", 0)
            me = {"host": host, "port": port, "node": node_id(), "shm": shm_usable()}
            await m.store.set(f"addr/{rank}", msgpack.packb(me))
            keys = [f"addr/{r}" for r in range(world_size)]
            try:
                await m.store.wait(keys, timeout_s)
            except StoreTimeoutError as exc:  # said as the ranks that have not joined, not as store keys
                raise rdzv.not_joined_error(m, exc, timeout_s) from None
            peers = {r: msgpack.unpackb(await m.store.get(f"addr/{r}")) for r in range(world_size)}
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
        await m.store.close()
        raise
    rt = RankRuntime(actor, m.store, timeout_s=timeout_s, local_rank=m.local_rank,
                     local_world_size=m.local_world_size, nodes=nodes, generation=m.generation, rendezvous=owned)
    if not shm_everywhere:
        rt.shm_enabled = False
        if shm_usable():
            log.warning("rank %d: shared memory is off for this job: some ranks have RINGWEAVE_SHM=0 "
                        "or no writable /dev/shm", rank)
    return rt


def set_current(rt: RankRuntime | None) -> None:
    """Makes ``rt`` the runtime of the calling task context (runtime.testing uses it)."""
    _current.set(rt)


def current() -> RankRuntime:
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


async def shutdown(rt: RankRuntime | None = None, timeout_s: float = 30.0, *, exc=_FROM_CONTEXT) -> None:
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
            await _arrive_together(rt, timeout_s)
    except (RingweaveError, OSError) as exc:
        log.warning("rank %d: shutdown rendezvous failed: %s", rt.rank, exc)
    finally:
        await _close(rt)


async def _arrive_together(rt: RankRuntime, timeout_s: float) -> None:
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


async def abort(exc: BaseException | None = None, rt: RankRuntime | None = None) -> None:
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


async def _close(rt: RankRuntime, reason: BaseException | None = None) -> None:
    """Closes ``rt`` (its goodbye carries ``reason``; the rendezvous init chose for it, with the
    store server this rank hosts, goes with it: RankRuntime.close)."""
    global _process_default
    try:
        await rt.close(reason)
    finally:
        if _process_default is rt:
            _process_default = None
        if _current.get() is rt:
            _current.set(None)
