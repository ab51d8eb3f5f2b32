"""Strangers on every listening port of a running job: the job goes on, memory stays bounded.

A real job (``python -m runtime.launch -n 4``, a fresh secret made by the
launcher) runs all_reduces in a loop and checks every result. The test finds
its ports the way ``tools.status`` does (the launcher's job file, then the
ranks' addresses in the store) and checks, for the store and each of the 4
ranks:

* only loopback: every socket the launcher and the ranks listen on is 127.0.0.1
  (from /proc/<pid>/net/tcp, as ``ss -ltnp`` shows it);
* a client with a wrong secret, and one that answers the challenge without a
  MAC, are refused (``denied``), and one with the right secret is accepted;
* garbage, a truncated frame, a 4 GiB header length, an 8 EiB payload length,
  and, after an authenticated handshake, a 1 TiB payload length: each
  connection is closed by the server, nothing of that size is allocated;
* slow loris: 20 connections per port trickling one byte a second are all
  dropped by the handshake deadline (RINGWEAVE_HANDSHAKE_TIMEOUT_S, 2 s in this
  job, so that the test does not wait out the default 10 s; the setting's own
  test is test_handshake_timeout.py).

All of it runs at once while the job runs. Then the job must still be making
progress with correct results, every process's RSS must have grown by less
than RSS_BOUND and its open file descriptors returned to where they were, and
the job must end with exit 0. The figures are printed.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import time

import msgpack
import pytest

from runtime import auth, jobfile, net, wire
from runtime.errors import AuthenticationError
from tests.security.jobutil import LaunchedJob, iters, rank_addresses
from tests.security.netutil import (HUGE_HEADER, HUGE_PAYLOAD, fd_count, is_loopback, listening, prefix,
                                    rss_bytes, truncated_frame)

RSS_BOUND = 16 * 1024**2       # growth allowed per process over the whole attack
SLOW_LORIS_PER_PORT = 20
HANDSHAKE_DEADLINE_S = 2.0     # the job's RINGWEAVE_HANDSHAKE_TIMEOUT_S (10 s unset)

async def read_until_closed(sock, timeout_s: float) -> float:
    """Reads (and drops) until the server closes; returns when, in seconds. Raises TimeoutError."""
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    buf = bytearray(65536)
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                n = await loop.sock_recv_into(sock, buf)
            except (ConnectionResetError, BrokenPipeError):
                break
            if n == 0:
                break
    return time.monotonic() - t0


async def send_then_closed(host, port, data: bytes, shut: bool = False) -> float:
    """Sends ``data`` (then half-closes if ``shut``); the server must close within the deadline."""
    sock = await net.connect(host, port, 5)
    try:
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, data)
            if shut:
                sock.shutdown(1)
        except (ConnectionResetError, BrokenPipeError):
            return 0.0
        return await read_until_closed(sock, HANDSHAKE_DEADLINE_S + 3)
    finally:
        sock.close()


async def refused_wrong_secret(host, port, job) -> str:
    sock = await net.connect(host, port, 5)
    try:
        with pytest.raises(AuthenticationError, match="refused us") as info:
            await auth.connect(sock, b"not-the-secret", job, {"tool": "attacker"}, f"{host}:{port}")
        return str(info.value)
    finally:
        sock.close()


async def refused_without_mac(host, port) -> str:
    """Answers the server's challenge with an empty MAC (a client that has no secret)."""
    loop = asyncio.get_running_loop()
    sock = await net.connect(host, port, 5)
    try:
        hello = await auth._recv_frame(loop, sock, "server")
        assert hello["k"] == "hello" and hello["auth"] is True, hello
        await loop.sock_sendall(sock, wire.encode_head(
            {"k": "auth", "n": secrets.token_bytes(16), "who": {"tool": "attacker"}, "mac": b""}))
        reply = await auth._recv_frame(loop, sock, "server")
        assert reply["k"] == "denied", reply
        await read_until_closed(sock, 5)
        return reply["why"]
    finally:
        sock.close()


async def huge_after_handshake(host, port, secret, job, store: bool) -> float:
    """Authenticates with the right secret, then announces a 1 TiB payload."""
    sock = await net.connect(host, port, 5)
    try:
        await auth.connect(sock, secret, job, {"tool": "attacker"}, f"{host}:{port}")
        header = {"k": "set", "i": 1, "key": "x"} if store else {"k": "q", "i": 1, "n": "ringweave.status"}
        packed = msgpack.packb(header, use_bin_type=True)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, prefix(len(packed), 2**40) + packed + b"\0" * 4096)
        return await read_until_closed(sock, 10)
    finally:
        sock.close()


async def slow_loris(host, port, n: int) -> list[float]:
    """``n`` connections sending one byte a second; returns when the server dropped each."""
    loop = asyncio.get_running_loop()

    async def one() -> float:
        sock = await net.connect(host, port, 5)
        t0 = time.monotonic()
        try:
            trickle = prefix(30, 0) + b"\x00" * 30
            for i in range(int(HANDSHAKE_DEADLINE_S) + 5):
                try:
                    await loop.sock_sendall(sock, trickle[i:i + 1])
                    async with asyncio.timeout(1.0):
                        while await loop.sock_recv(sock, 4096):
                            pass  # the server's hello; b"" is the close
                        return time.monotonic() - t0
                except TimeoutError:
                    continue
                except (ConnectionResetError, BrokenPipeError):
                    return time.monotonic() - t0
            return float("inf")
        finally:
            sock.close()

    return await asyncio.gather(*(one() for _ in range(n)))


async def accepted_with_secret(host, port, secret, job) -> None:
    sock = await net.connect(host, port, 5)
    try:
        await auth.connect(sock, secret, job, {"tool": "test"}, f"{host}:{port}")
    finally:
        sock.close()


@pytest.mark.timeout(120)
async def test_strangers_on_every_port_leave_the_job_running(tmp_path):
    run = LaunchedJob(tmp_path, 4, max_time_s=100,
                      env={**os.environ, "RINGWEAVE_HANDSHAKE_TIMEOUT_S": f"{HANDSHAKE_DEADLINE_S:g}"})
    launcher, out, job = run.launcher, run.out, run.id
    try:
        await run.wait_running()
        info = jobfile.find(job)
        secret, master = info["secret"].encode(), (info["master_addr"], info["master_port"])
        ranks = await rank_addresses(info)
        pids = {"launcher (store)": launcher.pid}
        pids.update({f"rank {r}": int((out / f"pid.{r}").read_text()) for r in range(4)})
        ports = {"store": master, **{f"rank {r}": a for r, a in ranks.items()}}

        # -- listening on loopback only
        print(f"\n== job {job}: listening sockets (from /proc/<pid>/net/tcp)")
        for who, pid in pids.items():
            addrs = listening(pid)
            print(f"   {who:18s} pid {pid:6d}: {addrs}")
            assert addrs and all(is_loopback(a) for a in addrs), (who, addrs)

        await asyncio.sleep(1.0)  # warm: the collectives' buffers are allocated
        rss0 = {who: rss_bytes(pid) for who, pid in pids.items()}
        fd0 = {who: fd_count(pid) for who, pid in pids.items()}
        iters0 = iters(out)

        # -- every attack on every port, all at once
        t0 = time.monotonic()
        attacks = {}
        for name, (host, port) in ports.items():
            store = name == "store"
            attacks[name] = asyncio.gather(
                refused_wrong_secret(host, port, job),
                refused_without_mac(host, port),
                send_then_closed(host, port, os.urandom(64 * 1024)),
                send_then_closed(host, port, truncated_frame(), shut=True),
                send_then_closed(host, port, HUGE_HEADER),
                send_then_closed(host, port, HUGE_PAYLOAD),
                huge_after_handshake(host, port, secret, job, store),
                slow_loris(host, port, SLOW_LORIS_PER_PORT),
                accepted_with_secret(host, port, secret, job),
            )
        results = dict(zip(attacks, await asyncio.gather(*attacks.values())))
        attack_s = time.monotonic() - t0
        print(f"   all attacks on {len(ports)} ports done in {attack_s:.1f} s")
        for name, (wrong, nomac, garbage, trunc, hhead, hpay, hauth, loris, _) in results.items():
            print(f"   {name:8s} wrong secret: refused ({wrong.split(': ', 1)[-1]}); no MAC: denied ({nomac}); "
                  f"closed after garbage {garbage:.3f} s, truncated {trunc:.3f} s, 4 GiB header {hhead:.3f} s, "
                  f"8 EiB payload {hpay:.3f} s, 1 TiB payload after auth {hauth:.3f} s; "
                  f"slow loris x{len(loris)} dropped after {min(loris):.1f}-{max(loris):.1f} s")
            assert max(loris) <= HANDSHAKE_DEADLINE_S + 2.5, (name, loris)
            assert max(garbage, trunc, hhead, hpay, hauth) < HANDSHAKE_DEADLINE_S + 1, name

        # -- the job went on, memory and descriptors bounded
        await asyncio.sleep(0.5)
        iters1 = iters(out)
        assert launcher.poll() is None, run.text()[-3000:]
        assert all(iters1[r] > iters0[r] for r in range(4)), (iters0, iters1)
        print(f"   all_reduce iterations per rank before / after the attacks: {iters0} / {iters1}")
        settle = time.monotonic() + 5
        while time.monotonic() < settle and any(fd_count(p) > fd0[w] + 1 for w, p in pids.items()):
            await asyncio.sleep(0.1)
        for who, pid in pids.items():
            rss, fds = rss_bytes(pid), fd_count(pid)
            print(f"   {who:18s} RSS {rss0[who] / 2**20:7.1f} -> {rss / 2**20:7.1f} MiB "
                  f"(+{(rss - rss0[who]) / 2**20:5.1f}, bound {RSS_BOUND / 2**20:.0f}), fds {fd0[who]} -> {fds}")
            assert rss - rss0[who] < RSS_BOUND, who
            assert fds <= fd0[who] + 1, (who, fd0[who], fds)
    finally:
        code, text = await run.stop()
    assert code == 0, text[-3000:]
    # every listener logged its refusals (runtime/acceptor.py), the store's among them
    assert re.search(r"rank \d: refused a connection", text) and re.search(r"store \S+: refused a connection", text), \
        text[-3000:]
