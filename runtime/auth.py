"""Who may talk to a job: the secret, the connect handshake, the listening policy.

Every connection (rank to rank, client to store) starts with the same
three-frame handshake on the raw socket, before any protocol object exists::

    acceptor  -> connector   hello  {n: nonce_a(16 bytes), job: str, auth: bool}
    connector -> acceptor    auth   {n: nonce_c, who: map, mac: HMAC(secret, "c" | nonce_a | nonce_c | who)}
    acceptor  -> connector   ok     {mac: HMAC(secret, "a" | nonce_c | nonce_a)}     (or "denied" and close)

Both sides prove they hold the secret; the secret itself never crosses the
wire, and a recorded handshake cannot be replayed (fresh nonces each side).
Reads are exact (a prefix, then exactly the header it announces), so after the
handshake the socket holds nothing we have not consumed and can be handed to a
transport. Every step runs under a deadline, so a client that connects and says
nothing (slow loris) is dropped.

Nothing a stranger announces is allocated: each side reads the handshake's
frames into one buffer of :data:`HANDSHAKE_BUFFER_NBYTES` made before the first
byte arrives; a frame whose header is longer than that, or that has a payload,
is refused from its 16-byte prefix. Values a stranger chose (its ``who``, a
frame kind) appear in errors cut to :data:`wire.SHOWN_CHARS` characters.

:func:`dial` is the whole connector side in one call (connect with retries,
then the handshake); rank-to-rank connections and store clients both use it.

This module does not encrypt anything: see SECURITY.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import secrets
import socket
from typing import Any, Awaitable, Callable

import msgpack

from runtime import env, net, wire
from runtime.errors import AuthenticationError, BadFrameError, ConnectError

log = logging.getLogger("ringweave.auth")

SECRET_ENV = env.SECRET.name
HANDSHAKE_TIMEOUT_S: float = env.HANDSHAKE_TIMEOUT.get({})  # 10 s: RINGWEAVE_HANDSHAKE_TIMEOUT_S unset

SCHEMA: wire.Schema = {
    "hello": {"n": (bytes, True), "job": (str, True), "auth": (bool, True)},
    "auth": {"n": (bytes, True), "who": (dict, True), "mac": (bytes, True)},
    "ok": {"mac": (bytes, True)},
    "denied": {"why": (str, True)},
}
_DENIED_MAC = "authentication failed"  # what an acceptor answers a wrong MAC
_MAX_HANDSHAKE_PAYLOAD = 0  # handshake frames carry no payload
HANDSHAKE_MAX_HEADER_NBYTES = 1024  # the largest is an "auth" of ~150 bytes (a store client's host name: <= 255)
HANDSHAKE_BUFFER_NBYTES = wire.PREFIX_NBYTES + HANDSHAKE_MAX_HEADER_NBYTES

_warned_unauthenticated = False
HOW_TO_SET = (f"set {SECRET_ENV} to the same value for every rank, e.g. export {SECRET_ENV}=$(python -c "
              f"'import secrets; print(secrets.token_hex(32))') before srun (and mpirun -x {SECRET_ENV})")


def handshake_timeout(given: float | None = None) -> float:
    """``given``, or else ``RINGWEAVE_HANDSHAKE_TIMEOUT_S`` as it is now (:data:`HANDSHAKE_TIMEOUT_S`
    when unset): how long a connection has to finish the handshake. Listeners (a rank's, the
    store's) read it when they are made, connectors when they dial.

    Raises:
        SettingError: the variable is not a positive, finite number of seconds.
    """
    return env.HANDSHAKE_TIMEOUT.get() if given is None else given


def make_secret() -> str:
    """A fresh per-job secret (hex, 256 bits)."""
    return secrets.token_hex(32)


_taken_secret: bytes | None = None  # what secret_from_env took out of os.environ


def secret_from_env() -> bytes | None:
    """The job's secret from ``RINGWEAVE_SECRET``, which is taken out of ``os.environ`` as it is
    read: processes this one starts (data loaders, tools, anything) do not inherit it unless
    given it (:func:`export_secret`). Later calls return the value taken, unless the variable
    was set again."""
    global _taken_secret
    value = env.SECRET.pop()
    if value:
        _taken_secret = value.encode()
    return _taken_secret


def export_secret(environ: dict) -> dict:
    """Puts the secret this process took (:func:`secret_from_env`) into ``environ``, the
    environment of a process that must join the job too (a nested launcher, say); returns it."""
    if _taken_secret:
        environ[SECRET_ENV] = _taken_secret.decode()
    return environ


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IPv4 or IPv6 literal, or a name) is loopback only: a name counts when
    every address it resolves to is loopback (``localhost`` -> 127.0.0.1 and ::1). ``0.0.0.0``,
    ``::`` and names that do not resolve are not. Names resolve through ``getaddrinfo``, so IPv6
    loopback (``::1``) counts too."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback  # a literal; "%" scopes an IPv6 one
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    try:
        return bool(addrs) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs)
    except ValueError:
        return False


def check_policy(secret: bytes | None, listen_host: str, what: str) -> None:
    """The rule of docs/design.md ("Starting a job") for a listener made without a secret: allowed
    only on loopback. ``runtime.init`` and the launcher never make one (a job started without
    ``RINGWEAVE_SECRET`` derives its secret: runtime/jobsecret.py); in-process ranks of tests do.

    Raises:
        AuthenticationError: no secret and ``listen_host`` is not a loopback address.
    """
    global _warned_unauthenticated
    if secret:
        return
    if not is_loopback(listen_host):
        raise AuthenticationError(f"{what} would listen on {listen_host!r} without a secret: {HOW_TO_SET}")
    if not _warned_unauthenticated:
        _warned_unauthenticated = True
        log.warning("%s is unauthenticated (%s unset); allowed only because it listens on loopback",
                    what, SECRET_ENV)


def _mac(secret: bytes | None, *parts: bytes) -> bytes:
    if not secret:
        return b""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def _who_bytes(who: dict) -> bytes:
    return msgpack.packb(who, use_bin_type=True)


async def recv_exact(sock: socket.socket, nbytes: int, where: str, during: str = "the handshake") -> memoryview:
    """Reads exactly ``nbytes`` from a connected non-blocking socket, and not one byte more:
    what follows stays in the socket for whoever reads next (a transport, after the handshake).

    Args:
        where: names the peer in the error, e.g. ``"store at 10.0.0.1:29500"``.
        during: what the read was part of, for the error, e.g. ``"the reply"``.
    Returns:
        a memoryview over a fresh buffer of exactly ``nbytes`` bytes.
    Raises:
        ConnectError: the peer closed the connection first; names ``where``,
            ``during`` and how many of the bytes had come.
        OSError: the connection broke (e.g. ConnectionResetError).
    """
    loop = asyncio.get_running_loop()
    buf = bytearray(nbytes)
    mv = memoryview(buf)
    got = 0
    while got < nbytes:
        n = await loop.sock_recv_into(sock, mv[got:])
        if n == 0:
            raise ConnectError(f"{where}: connection closed during {during} ({got} of {nbytes} bytes)")
        got += n
    return mv


async def _recv_into(sock: socket.socket, mv: memoryview, where: str) -> None:
    """Fills ``mv`` from the socket (exactly; see :func:`recv_exact`)."""
    loop = asyncio.get_running_loop()
    got, nbytes = 0, mv.nbytes
    while got < nbytes:
        n = await loop.sock_recv_into(sock, mv[got:])
        if n == 0:
            raise ConnectError(f"{where}: connection closed during the handshake ({got} of {nbytes} bytes)")
        got += n


async def _recv_frame(loop, sock, where: str, buf: bytearray | None = None) -> dict:
    """One handshake frame, read into ``buf`` (HANDSHAKE_BUFFER_NBYTES; a fresh one if None)."""
    mv = memoryview(buf if buf is not None else bytearray(HANDSHAKE_BUFFER_NBYTES))
    await _recv_into(sock, mv[:wire.PREFIX_NBYTES], where)
    hlen, _ = wire.parse_prefix(mv, _MAX_HANDSHAKE_PAYLOAD, where=f" from {where}",
                                max_header_nbytes=HANDSHAKE_MAX_HEADER_NBYTES)
    head = mv[wire.PREFIX_NBYTES:wire.PREFIX_NBYTES + hlen]
    await _recv_into(sock, head, where)
    return wire.parse_header(head, SCHEMA, where=f" from {where}")


async def _send_frame(loop, sock, header: dict) -> None:
    await loop.sock_sendall(sock, wire.encode_head(header))


async def accept(sock: socket.socket, secret: bytes | None, job: str, where: str,
                 timeout_s: float | None = None, admit=None) -> dict:
    """Runs the acceptor side on a connected non-blocking socket.

    Args:
        timeout_s: the handshake's deadline (None: :func:`handshake_timeout`).
        admit: optional ``admit(who) -> refusal message | None``, asked after the
            MAC checks out and before ``ok`` (e.g. a rank that is already connected).
    Returns:
        the connector's ``who`` map (for ranks: ``{"rank": r}``).
    Raises:
        AuthenticationError: wrong MAC, wrong job, or no MAC where one is required.
        BadFrameError, ConnectError, TimeoutError: a broken or silent connector.
    """
    loop = asyncio.get_running_loop()
    nonce_a = secrets.token_bytes(16)
    buf = bytearray(HANDSHAKE_BUFFER_NBYTES)  # all this connection may cost before it authenticates
    async with asyncio.timeout(handshake_timeout(timeout_s)):
        await _send_frame(loop, sock, {"k": "hello", "n": nonce_a, "job": job, "auth": bool(secret)})
        msg = await _recv_frame(loop, sock, where, buf)
        if msg["k"] != "auth":
            raise BadFrameError(f"handshake from {where}: expected 'auth', got {wire.shown(msg['k'])}")
        who = msg["who"]
        expected = _mac(secret, b"c", nonce_a, msg["n"], job.encode(), _who_bytes(who))
        if not hmac.compare_digest(expected, msg["mac"]):
            await _send_frame(loop, sock, {"k": "denied", "why": _DENIED_MAC})
            raise AuthenticationError(f"{where} ({wire.shown(who)}) failed authentication for job {job!r}")
        refusal = admit(who) if admit is not None else None
        if refusal:
            await _send_frame(loop, sock, {"k": "denied", "why": refusal})
            raise AuthenticationError(f"{where} ({wire.shown(who)}) refused: {refusal}")
        await _send_frame(loop, sock, {"k": "ok", "mac": _mac(secret, b"a", msg["n"], nonce_a)})
    return who


async def connect(sock: socket.socket, secret: bytes | None, job: str, who: dict, where: str,
                  timeout_s: float | None = None) -> None:
    """Runs the connector side on a connected non-blocking socket; ``timeout_s`` is the
    handshake's deadline (None: :func:`handshake_timeout`).

    Raises:
        AuthenticationError: the acceptor refused us, belongs to another job, or
            could not prove it holds the secret.
    """
    loop = asyncio.get_running_loop()
    buf = bytearray(HANDSHAKE_BUFFER_NBYTES)
    async with asyncio.timeout(handshake_timeout(timeout_s)):
        hello = await _recv_frame(loop, sock, where, buf)
        if hello["k"] != "hello":
            raise BadFrameError(f"handshake from {where}: expected 'hello', got {wire.shown(hello['k'])}")
        if hello["job"] != job:
            raise AuthenticationError(f"{where} belongs to job {wire.shown(hello['job'])}, not {job!r}")
        if hello["auth"] and not secret:
            raise AuthenticationError(f"{where} requires a secret and {SECRET_ENV} is unset")
        if secret and not hello["auth"]:  # it cannot prove it holds ours: not this job's (another user's program?)
            raise AuthenticationError(f"{where} runs without a secret, so it is none of this job's processes "
                                      f"(another program may hold the port); refusing it")
        nonce_c = secrets.token_bytes(16)
        await _send_frame(loop, sock, {"k": "auth", "n": nonce_c, "who": who,
                                       "mac": _mac(secret, b"c", hello["n"], nonce_c, job.encode(),
                                                   _who_bytes(who))})
        reply = await _recv_frame(loop, sock, where, buf)
        if reply["k"] == "denied":
            why = reply["why"][:4 * wire.SHOWN_CHARS]
            hint = " (our secrets differ: another job's, or another program on its port)" * (why == _DENIED_MAC)
            raise AuthenticationError(f"{where} refused us: {why}{hint}")
        if reply["k"] != "ok" or not hmac.compare_digest(
                _mac(secret, b"a", nonce_c, hello["n"]), reply["mac"]):
            raise AuthenticationError(f"{where} could not prove it holds the job's secret")


async def dial(host: str, port: int, *, secret: bytes | None, job: str, who: dict, what: str,
               timeout_s: float, handshake_timeout_s: float | None = None,
               retry_dropped: bool = False, wrap: Callable[[socket.socket], Awaitable[Any]] | None = None):
    """Connects to ``what`` at ``host:port`` (retrying refused connects until
    ``timeout_s``, :func:`net.connect`), then runs the connector side of the handshake.

    Args:
        who: how we name ourselves to the acceptor, e.g. ``{"rank": 3}``.
        what: names the acceptor in errors, e.g. ``"store"``, ``"rank 2"``; the
            handshake's ``where`` is ``f"{what} at {host}:{port}"``.
        handshake_timeout_s: the handshake must be done in this time (None: the
            setting, :func:`handshake_timeout`).
        retry_dropped: for a server that accepts and then drops connections while
            it is busy (the store at ``max_clients``) or restarting: a connection
            that is closed, breaks or falls silent during the handshake (or in
            ``wrap``) is made again, with backoff, until ``timeout_s`` has passed,
            and each handshake gets at most what is left of ``timeout_s``. Without
            it (a rank dialling a peer) such a failure is raised as it is.
        wrap: optional ``await wrap(sock)`` that makes of the authenticated socket
            what the caller keeps (a stream pair, a connection); it runs here so
            that the socket is closed if it fails.
    Returns:
        what ``wrap`` returned; without ``wrap``, the socket (the caller owns it).
    Raises:
        ConnectError: nothing accepted in ``timeout_s``; without ``retry_dropped``, the
            acceptor closed the connection during the handshake; with it, the last
            handshake failed when the time was up. Names the address.
        AuthenticationError, BadFrameError: as :func:`connect`; never retried.
        TimeoutError, OSError: without ``retry_dropped``, the handshake timed out or the
            connection broke (and whatever ``wrap`` raises).
    Cancellation: the socket is closed.
    """
    where = f"{what} at {host}:{port}"
    handshake_timeout_s = handshake_timeout(handshake_timeout_s)
    backoff = net.Backoff(timeout_s)
    while True:
        sock = await net.connect(host, port, backoff.remaining(0.01) if retry_dropped else timeout_s, what=what)
        try:
            if retry_dropped:
                handshake_s = min(handshake_timeout_s, backoff.remaining(0.05))
            else:
                handshake_s = handshake_timeout_s
            await connect(sock, secret, job, who, where, timeout_s=handshake_s)
            return sock if wrap is None else await wrap(sock)
        except (ConnectError, OSError, TimeoutError) as exc:
            sock.close()
            if not retry_dropped:
                raise
            if not await backoff.wait_next_try():  # accepted, then dropped: a busy or restarting server
                raise ConnectError(f"could not connect to {where} in {timeout_s:g} s ({backoff.tries} tries; "
                                   f"last error: {type(exc).__name__}: {exc})") from None
        except BaseException:
            sock.close()
            raise
