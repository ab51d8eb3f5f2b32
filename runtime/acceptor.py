"""The listening side of a rank or of the store, up to the end of the handshake, on a thread of
its own: accepting, bounding and authenticating strangers, so that neither a flood of
connections nor a busy event loop decides who gets in.

The thread runs a small event loop of its own that accepts, runs ``auth.accept`` under its
deadline and hands each authenticated socket to the owner's loop (``call_soon_threadsafe``). The
owner never touches a socket that has not authenticated, and a handshake never waits for the
owner's loop, which a tight loop of collectives may keep busy for long stretches
(bench/results/security.md#toolsstatus-while-the-ranks-run-collectives-back-to-back).

Bounds (SECURITY.md states them, tests/security checks them): at most ``max_handshaking``
connections in the handshake at once (never more than a quarter of RLIMIT_NOFILE), one more drops
the oldest; before it authenticates, a connection costs a task and one handshake buffer of
``auth.HANDSHAKE_BUFFER_NBYTES``, never what a stranger announces; ``accept`` failing for want of
descriptors or memory backs off and keeps listening; each refusal is logged in one line, up to
``LOG_LINES`` per ``LOG_WINDOW_S``, and the rest are counted.

Tools (``who = {"tool": name}``) are served here too, request by request (``serve_tool``): their
handlers are read-only and thread-safe, so ``tools.status`` answers while the rank's loop is busy
or stalled. At most ``MAX_TOOLS`` at once; each request, its answer and the taking of the reply
have ``TOOL_IDLE_S`` each, so a tool that stops talking cannot keep a slot.

Life (grammar): ``Acceptor(...) -> start -> (deliver | serve_tool)* -> close -> end``. ``close``
stops and joins the thread and closes every socket it still holds, handed over or not. The
listening socket is the owner's, closed after ``close``.

Not here: the handshake itself (auth.py), what the owner does with a connection (actor.py,
store_server.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgpack

from runtime import auth, net, wire
from runtime.errors import AuthenticationError, BadFrameError, ConnectError

log = logging.getLogger("ringweave.acceptor")

LOG_LINES = 20  # refusals logged per listener per window; the rest are counted
LOG_WINDOW_S = 10.0
MAX_TOOL_HEADER_NBYTES = 1024  # a tool's request header: {k, i, n} with a handler name
MAX_TOOL_PAYLOAD_NBYTES = 64 * 1024  # a tool's request arguments (msgpack)
MAX_TOOLS = 16  # tool connections served at once; more are refused at the handshake
TOOL_IDLE_S = 10.0  # a tool's next request (or its taking a reply) may wait this long; tools.status asks at once
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
FD_SHARE = 4  # strangers in the handshake may hold at most 1/FD_SHARE of the descriptor limit
MIN_HANDSHAKING = 8  # ... but always this many (a tiny descriptor limit still lets peers in)
JOIN_S = 5.0  # close(): how long the thread may take to end (it takes about a millisecond), then logged


def handshaking_bound(wanted: int) -> int:
    """``wanted``, capped by the process's descriptor limit (see FD_SHARE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(MIN_HANDSHAKING, min(wanted, soft // FD_SHARE))


@dataclass(frozen=True)
class AcceptorStatistics:
    handshaking: int  # connections in the handshake now, e.g. 0
    accepted: int  # connections accepted since start, e.g. 9
    authenticated: int  # handed to the owner or served as tools, e.g. 5
    refused: int  # failed or refused the handshake (deadline included), e.g. 3
    evicted: int  # dropped to make room under max_handshaking, e.g. 1
    accept_errors: int  # accept() failures (EMFILE ...), each followed by a back-off, e.g. 0
    tools: int  # tool connections served now, e.g. 0


class RefusalLog:
    """Logs refusals, at most ``lines`` per ``window_s`` seconds; counts the rest and says how
    many in one line when the next window opens (or at :meth:`flush`). Thread-safe enough:
    called from one thread."""

    def __init__(self, name: str, lines: int = LOG_LINES, window_s: float = LOG_WINDOW_S):
        self.name = name
        self._lines, self._window_s = lines, window_s
        self._start = time.monotonic()
        self._logged = self._skipped = 0

    def warning(self, message: str) -> None:
        now = time.monotonic()
        if now - self._start >= self._window_s:
            self.flush()
            self._start = now
        if self._logged < self._lines:
            self._logged += 1
            log.warning("%s: %s", self.name, message)
        else:
            self._skipped += 1

    def flush(self) -> None:
        if self._skipped:
            log.warning("%s: %d more refusals in %.0f s were not logged one by one", self.name, self._skipped,
                        self._window_s)
        self._logged = self._skipped = 0


def _why(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no handshake within {timeout_s:g} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Acceptor:
    """Accepts on ``listener`` and authenticates on a thread; see the module docstring.

    Args:
        listener: a listening, non-blocking socket (the owner keeps and closes it).
        name: names the listener in logs, e.g. ``"rank 3"``, ``"store 127.0.0.1:29500"``.
        deliver: ``deliver(sock, who, where)``, called on the owner's loop (the one running
            when :meth:`start` is called) for every connection that authenticated; it owns
            the socket from then on.
        admit: ``admit(who) -> refusal | None``, called on the thread after the MAC checks out.
        refuse: ``refuse(handshaking) -> reason | None``, called on the thread at each accept
            with the number of connections in the handshake or handed over and not yet taken by
            the owner's loop: a reason closes the new connection at once (the store's ``max_clients``).
        serve_tool: ``await serve_tool(name, args)``, run on the thread for the requests of
            tool connections; None: tools are delivered like anyone else.
        tool_schema: the frames a tool may send (needs ``q`` and ``b``).
    """

    def __init__(self, listener: socket.socket, *, secret: bytes | None, job: str, name: str,
                 deliver: Callable[[socket.socket, dict, str], None],
                 admit: Callable[[dict], str | None] | None = None,
                 refuse: Callable[[int], str | None] | None = None,
                 max_handshaking: int = 64, handshake_timeout_s: float | None = None,
                 serve_tool: Callable[[str, list], Awaitable[Any]] | None = None,
                 tool_schema: wire.Schema | None = None):
        if max_handshaking < 1:
            raise ValueError(f"max_handshaking must be at least 1, got {max_handshaking}")
        self.listener = listener
        self.name = name
        self._secret, self._job = secret, job
        self._deliver, self._admit, self._refuse = deliver, admit, refuse
        self.max_handshaking = handshaking_bound(max_handshaking)
        self.handshake_timeout_s = auth.handshake_timeout(handshake_timeout_s)  # None: the setting, read now
        self._serve_tool, self._tool_schema = serve_tool, tool_schema
        self.tool_idle_s = TOOL_IDLE_S  # read when made, so a test may lower the module's figure
        self._log = RefusalLog(name)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the thread's
        self._owner: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._ready = threading.Event()
        self._handshaking: dict[asyncio.Task, socket.socket] = {}  # oldest first
        self._tools: set[asyncio.Task] = set()
        self._in_transit: set[socket.socket] = set()  # handed to the owner's loop, not yet taken
        self._lock = threading.Lock()  # guards _in_transit and _closed between the two threads
        self._closed = False
        self._accepted = self._authenticated = self._refused = self._evicted = self._accept_errors = 0

    # -- life cycle (owner's thread) ----------------------------------------------------------
    def start(self) -> "Acceptor":
        self._owner = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"ringweave-accept {self.name}", daemon=True)
        self._thread.start()
        self._ready.wait()
        return self

    def close(self) -> None:
        """Stops accepting, cancels every handshake and tool connection, joins the thread and
        closes the sockets it still holds. Idempotent; returns within about a millisecond."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_transit, self._in_transit = self._in_transit, set()
        loop, main = self._loop, self._main
        if loop is not None and main is not None and self._thread is not None and self._thread.is_alive():
            try:
                loop.call_soon_threadsafe(main.cancel)
            except RuntimeError:  # its loop has already closed
                pass
            self._thread.join(JOIN_S)
            if self._thread.is_alive():
                log.error("%s: the acceptor's thread did not end within %g s of close(); left running",
                          self.name, JOIN_S)
        for sock in in_transit:
            sock.close()
        self._log.flush()

    def statistics(self) -> AcceptorStatistics:
        return AcceptorStatistics(len(self._handshaking), self._accepted, self._authenticated, self._refused,
                                  self._evicted, self._accept_errors, len(self._tools))

    @property
    def handshaking(self) -> int:
        return len(self._handshaking)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._main = loop.create_task(self._accept_loop())
            loop.call_soon(self._ready.set)
            try:
                loop.run_until_complete(self._main)
            except asyncio.CancelledError:
                pass
        finally:
            self._ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        backoff_s = 0.01
        try:
            async with asyncio.TaskGroup() as tg:
                while True:
                    try:
                        sock, addr = await loop.sock_accept(self.listener)
                    except OSError as exc:
                        self._accept_errors += 1
                        if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                            continue  # the stranger left before we took it: nothing to wait for
                        what = "out of descriptors or memory" if exc.errno in _OUT_OF_RESOURCES else "failed"
                        self._log.warning(f"accept {what} ({exc}); listening again in {backoff_s * 1000:.0f} ms")
                        await asyncio.sleep(backoff_s)
                        backoff_s = min(1.0, backoff_s * 2)
                        continue
                    backoff_s = 0.01
                    try:
                        self._admit_new(tg, sock, addr)
                    except Exception:  # a bug here must not stop the listener
                        log.exception("%s: accepting a connection failed", self.name)
                        sock.close()
                    # sock_accept does not yield while connections wait in the backlog: let the
                    # handshakes (and the dropped ones, which close their sockets) have their turn
                    await asyncio.sleep(0)
        finally:
            for sock in self._handshaking.values():
                sock.close()
            self._handshaking.clear()

    def _admit_new(self, tg: asyncio.TaskGroup, sock: socket.socket, addr) -> None:
        """A connection just accepted: refuse it, or start its handshake (dropping the oldest
        one in the handshake when they are max_handshaking already)."""
        self._accepted += 1
        where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        reason = self._refuse(len(self._handshaking) + len(self._in_transit)) if self._refuse is not None else None
        if reason:
            self._refused += 1
            self._log.warning(f"refused a connection from {where}: {reason}")
            sock.close()
            return
        if len(self._handshaking) >= self.max_handshaking:
            oldest = next(iter(self._handshaking))
            del self._handshaking[oldest]
            oldest.cancel()  # it closes its socket, once the loop has dropped its reader
            self._evicted += 1
            self._log.warning(f"dropped the oldest connection in the handshake to accept {where}: "
                              f"{self.max_handshaking} at once is the limit")
        task = tg.create_task(self._handshake(sock, where))
        task.add_done_callback(lambda t: t.cancelled() and sock.close())  # cancelled before it ran
        self._handshaking[task] = sock

    async def _handshake(self, sock: socket.socket, where: str) -> None:
        """Runs the acceptor side, then hands the socket on (or serves the tool). Never raises
        but CancelledError; the socket is closed unless handed on."""
        task = asyncio.current_task()
        handed = False
        try:
            try:
                net.tune(sock)
                who = await auth.accept(sock, self._secret, self._job, where, self.handshake_timeout_s,
                                        admit=self._admit_who)
            except (AuthenticationError, BadFrameError, ConnectError, TimeoutError, OSError) as exc:
                self._refused += 1
                self._log.warning(f"refused a connection from {where} during the handshake: "
                                  f"{_why(exc, self.handshake_timeout_s)}")
                return
            except Exception:  # a bug in the handshake must not stop the listener
                self._refused += 1
                log.exception("%s: the handshake with %s failed", self.name, where)
                return
            self._authenticated += 1
            self._handshaking.pop(task, None)
            await asyncio.sleep(0)  # lets the loop drop its reader on the socket before anyone else reads it
            if self._serve_tool is not None and "tool" in who:
                self._tools.add(task)
                try:
                    await self._serve_tool_connection(sock, who, where)
                finally:
                    self._tools.discard(task)
                return
            handed = self._hand_over(sock, who, where)
        finally:
            self._handshaking.pop(task, None)
            if not handed:
                sock.close()

    def _admit_who(self, who: dict) -> str | None:
        if self._serve_tool is not None and "tool" in who and len(self._tools) >= MAX_TOOLS:
            return f"{MAX_TOOLS} tool connections at once is the limit"
        return self._admit(who) if self._admit is not None else None

    def _hand_over(self, sock: socket.socket, who: dict, where: str) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._in_transit.add(sock)
        try:
            self._owner.call_soon_threadsafe(self._take, sock, who, where)
        except RuntimeError:  # the owner's loop is closed
            with self._lock:
                self._in_transit.discard(sock)
            return False
        return True

    def _take(self, sock: socket.socket, who: dict, where: str) -> None:
        """On the owner's loop: the socket is the owner's now (unless close() took it first)."""
        with self._lock:
            if sock not in self._in_transit:
                return  # closed by close()
            self._in_transit.discard(sock)
        try:
            self._deliver(sock, who, where)
        except BaseException:
            sock.close()
            raise

    # -- tools, served on the thread ------------------------------------------------------------
    async def _serve_tool_connection(self, sock: socket.socket, who: dict, where: str) -> None:
        """Requests (``q {i, n}`` + msgpack args) and replies (``r {i, e?}`` + msgpack result) until
        the tool says goodbye (``b``), closes, breaks the format, or is quiet for ``tool_idle_s``
        (a request not whole by then, a reply not taken)."""
        loop = asyncio.get_running_loop()
        what = f"tool {wire.shown(who.get('tool'))} at {where}"
        head = memoryview(bytearray(wire.PREFIX_NBYTES + MAX_TOOL_HEADER_NBYTES))
        try:
            while True:
                async with asyncio.timeout(self.tool_idle_s):  # the next request, whole
                    if not await _fill(sock, head[:wire.PREFIX_NBYTES]):
                        return
                    hlen, plen = wire.parse_prefix(head, MAX_TOOL_PAYLOAD_NBYTES, where=f" from {what}",
                                                   max_header_nbytes=MAX_TOOL_HEADER_NBYTES)
                    header_mv = head[wire.PREFIX_NBYTES:wire.PREFIX_NBYTES + hlen]
                    payload = memoryview(bytearray(plen))
                    if not await _fill(sock, header_mv) or not await _fill(sock, payload):
                        return
                header = wire.parse_header(header_mv, self._tool_schema, where=f" from {what}")
                if header["k"] == "b":
                    return
                try:
                    args = msgpack.unpackb(payload, raw=False, strict_map_key=False)
                    async with asyncio.timeout(self.tool_idle_s):  # a handler waiting on a stalled loop
                        result = await self._serve_tool(header["n"], list(args) if isinstance(args, (list, tuple))
                                                        else [args])
                    reply, body = {"k": "r", "i": header["i"]}, msgpack.packb(result, use_bin_type=True)
                except TimeoutError:
                    reply, body = {"k": "r", "i": header["i"], "e": f"TimeoutError: no answer within "
                                                                    f"{self.tool_idle_s:g} s"}, b""
                except Exception as exc:  # the tool gets the error; the listener goes on
                    reply, body = {"k": "r", "i": header["i"], "e": f"{type(exc).__name__}: {exc}"}, b""
                async with asyncio.timeout(self.tool_idle_s):  # a tool that does not read its replies
                    await loop.sock_sendall(sock, wire.encode_head(reply, len(body)) + body)
        except TimeoutError:
            self._log.warning(f"dropped {what}: quiet for {self.tool_idle_s:g} s (a tool's slot is held "
                              f"only while it talks)")
        except (BadFrameError, OSError) as exc:
            self._log.warning(f"dropped {what}: {exc}")


async def _fill(sock: socket.socket, mv: memoryview) -> bool:
    """Reads exactly ``mv.nbytes``; False if the peer closed first."""
    loop = asyncio.get_running_loop()
    got = 0
    while got < mv.nbytes:
        n = await loop.sock_recv_into(sock, mv[got:])
        if n == 0:
            return False
        got += n
    return True
