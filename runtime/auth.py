"""Who may talk to a job: the secret, the connect handshake, the listening policy.

Every connection (rank to rank, client to store) starts with the same
three-frame handshake on the raw socket, before any protocol object exists::

    acceptor  -> connector   hello  {n: nonce_a(16 bytes), job: str, auth: bool}
    connector -> acceptor    auth   {n: nonce_c, who: map, mac: HMAC(secret, "c" | nonce_a | nonce_c | who)}
    acceptor  -> connector   ok     {mac: HMAC(secret, "a" | nonce_c | nonce_a)}     (or "denied" and close)

Both sides prove they hold the secret; the secret itself never crosses the
wire, and a recorded handshake cannot be replayed (fresh nonces each side).
Reads are exact (a prefix, then exactly the header and payload it announces),
so after the handshake the socket holds nothing we have not consumed and can
be handed to a transport. Every step runs under a deadline, so a client that
connects and says nothing (slow loris) is dropped.

This module does not encrypt anything: see SECURITY.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket

import msgpack

from runtime import wire
from runtime.errors import AuthenticationError, BadFrameError, ConnectError

log = logging.getLogger("ringweave.auth")

SECRET_ENV = "RINGWEAVE_SECRET"
HANDSHAKE_TIMEOUT_S = 10.0

SCHEMA: wire.Schema = {
    "hello": {"n": (bytes, True), "job": (str, True), "auth": (bool, True)},
    "auth": {"n": (bytes, True), "who": (dict, True), "mac": (bytes, True)},
    "ok": {"mac": (bytes, True)},
    "denied": {"why": (str, True)},
}
_MAX_HANDSHAKE_PAYLOAD = 0  # handshake frames carry no payload

_warned_unauthenticated = False


def make_secret() -> str:
    """A fresh per-job secret (hex, 256 bits)."""
    return secrets.token_hex(32)


def secret_from_env() -> bytes | None:
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_policy(secret: bytes | None, listen_host: str, what: str) -> None:
    """The rule of DESIGN.md: no secret is allowed only when listening on loopback.

    Raises:
        AuthenticationError: no secret and ``listen_host`` is not a loopback address.
    """
    global _warned_unauthenticated
    if secret:
        return
    if not is_loopback(listen_host):
        raise AuthenticationError(
            f"{what} would listen on {listen_host!r} without a secret; set {SECRET_ENV} "
            f"(python -m runtime.launch makes one) or listen on loopback")
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


async def _recv_exact(loop, sock, nbytes: int, where: str) -> memoryview:
    buf = bytearray(nbytes)
    mv = memoryview(buf)
    got = 0
    while got < nbytes:
        n = await loop.sock_recv_into(sock, mv[got:])
        if n == 0:
            raise ConnectError(f"{where}: connection closed during the handshake ({got} of {nbytes} bytes)")
        got += n
    return mv


async def _recv_frame(loop, sock, where: str) -> dict:
    prefix = await _recv_exact(loop, sock, wire.PREFIX_NBYTES, where)
    hlen, _ = wire.parse_prefix(prefix, _MAX_HANDSHAKE_PAYLOAD, where=f" from {where}")
    head = await _recv_exact(loop, sock, hlen, where)
    return wire.parse_header(head, SCHEMA, where=f" from {where}")


async def _send_frame(loop, sock, header: dict) -> None:
    await loop.sock_sendall(sock, wire.encode_head(header))


async def accept(sock: socket.socket, secret: bytes | None, job: str, where: str,
                 timeout_s: float = HANDSHAKE_TIMEOUT_S, admit=None) -> dict:
    """Runs the acceptor side on a connected non-blocking socket.

    Args:
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
    async with asyncio.timeout(timeout_s):
        await _send_frame(loop, sock, {"k": "hello", "n": nonce_a, "job": job, "auth": bool(secret)})
        msg = await _recv_frame(loop, sock, where)
        if msg["k"] != "auth":
            raise BadFrameError(f"handshake from {where}: expected 'auth', got {msg['k']!r}")
        who = msg["who"]
        expected = _mac(secret, b"c", nonce_a, msg["n"], job.encode(), _who_bytes(who))
        if not hmac.compare_digest(expected, msg["mac"]):
            await _send_frame(loop, sock, {"k": "denied", "why": "authentication failed"})
            raise AuthenticationError(f"{where} ({who}) failed authentication for job {job!r}")
        refusal = admit(who) if admit is not None else None
        if refusal:
            await _send_frame(loop, sock, {"k": "denied", "why": refusal})
            raise AuthenticationError(f"{where} ({who}) refused: {refusal}")
        await _send_frame(loop, sock, {"k": "ok", "mac": _mac(secret, b"a", msg["n"], nonce_a)})
    return who


async def connect(sock: socket.socket, secret: bytes | None, job: str, who: dict, where: str,
                  timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Runs the connector side on a connected non-blocking socket.

    Raises:
        AuthenticationError: the acceptor refused us, belongs to another job, or
            could not prove it holds the secret.
    """
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s):
        hello = await _recv_frame(loop, sock, where)
        if hello["k"] != "hello":
            raise BadFrameError(f"handshake from {where}: expected 'hello', got {hello['k']!r}")
        if hello["job"] != job:
            raise AuthenticationError(f"{where} belongs to job {hello['job']!r}, not {job!r}")
        if hello["auth"] and not secret:
            raise AuthenticationError(f"{where} requires a secret and {SECRET_ENV} is unset")
        nonce_c = secrets.token_bytes(16)
        await _send_frame(loop, sock, {"k": "auth", "n": nonce_c, "who": who,
                                       "mac": _mac(secret, b"c", hello["n"], nonce_c, job.encode(),
                                                   _who_bytes(who))})
        reply = await _recv_frame(loop, sock, where)
        if reply["k"] == "denied":
            raise AuthenticationError(f"{where} refused us: {reply['why']}")
        if reply["k"] != "ok" or not hmac.compare_digest(
                _mac(secret, b"a", nonce_c, hello["n"]), reply["mac"]):
            raise AuthenticationError(f"{where} could not prove it holds the job's secret")
