"""Strangers on the listening ports, before they authenticate (SECURITY.md, "Bounded before
authenticated"): a flood of idle connections, connections that send only a prefix, refusals
by the hundred, silence, and a rank whose event loop is busy.

Each test here failed before the listeners moved to their own thread with a bound
(runtime/acceptor.py): the flood made ``accept`` fail with EMFILE, which ended the accept task
and left the rank without descriptors, so the job's next file open failed and the job exited 1;
a prefix cost a 64 KiB buffer; each refusal logged the stranger's ``who`` whole; a silent
connection was logged with an empty reason; and a tool waited on the rank's loop, so a busy
loop made ``tools.status`` report a healthy rank as not answering.

The same attacks at full size (1,100 and 20,000 connections, 3,000 prefixes, a tight loop of
shared-memory collectives) are in bench/security.py, with results in bench/results/security.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

from runtime import auth, jobfile, net, wire
from runtime.store_server import StoreServer
from runtime.testing import make_runtimes
from tests.security.netutil import fd_count, prefix
from tests.security.jobutil import REPO, LaunchedJob, iters, rank_addresses, wait_until
from tools.status import ask

pytestmark = pytest.mark.timeout(90)
SECRET = b"listener-test-secret"
FD_LIMIT = 160  # descriptors of every process of the flooded job (RLIMIT_NOFILE)
FLOOD = 300  # idle connections to each port of it: more than FD_LIMIT
PREFIXES = 400  # prefix-only connections to each listener of the memory test
PREFIX_PEAK_BOUND = 8 * 1024**2  # Python memory those may cost at the peak, all listeners together


async def idle_connections(host: str, port: int, n: int) -> list:
    """``n`` connections that never say a word (the kernel completes them from the backlog)."""
    loop = asyncio.get_running_loop()

    async def one():
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return sock

    return list(await asyncio.gather(*(one() for _ in range(n))))


def _lower_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))


async def test_a_flood_of_idle_connections_with_few_descriptors_leaves_the_job_running(tmp_path):
    """Every process of a 2-rank job may hold 160 descriptors; 300 idle connections go to each
    listening port (the store's and the ranks'). The job keeps running (and opening files), each
    rank still answers a tool, and the job ends with exit 0."""
    run = LaunchedJob(tmp_path, 2, preexec_fn=_lower_fd_limit)
    out, job = run.out, run.id
    socks = []
    try:
        await run.wait_running()
        info = jobfile.find(job)
        secret = info["secret"].encode()
        ranks = await rank_addresses(info)
        ports = [(info["master_addr"], info["master_port"]), *ranks.values()]
        for host, port in ports:
            socks += await idle_connections(host, port, FLOOD)
        rank1 = int((out / "pid.1").read_text())
        held = fd_count(rank1)  # strangers hold at most a quarter of the limit (runtime/acceptor.FD_SHARE)
        assert held < FD_LIMIT // 4 + 40, held
        before = iters(out)
        await asyncio.to_thread(wait_until, lambda: all(iters(out)[r] > before[r] + 3 for r in range(2)), 20,
                                "the job to go on under the flood")  # each iteration report opens a file
        for r, (host, port) in ranks.items():
            assert await ask(host, port, secret, job, "ringweave.ping", timeout_s=10) == r
        assert run.launcher.poll() is None, run.text()[-3000:]
    finally:
        for s in socks:
            s.close()
        code, text = await run.stop()
    assert code == 0, text[-3000:]
    assert "dropped the oldest connection in the handshake" in text, text[-3000:]


EMFILE_RANK = r"""
import asyncio, logging, os, resource, sys
from runtime.actor import Actor
logging.basicConfig(level=logging.WARNING)
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

async def main():
    actor = Actor(0, 2, secret=b"emfile-secret", job="emfile")
    _, port = await actor.listen("127.0.0.1", 0)
    hog = []
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass  # EMFILE: every descriptor is taken
    print(port, flush=True)
    await asyncio.sleep(1.5)  # a tool connects meanwhile: accept fails, the listener backs off
    for fd in hog:
        os.close(fd)
    await asyncio.to_thread(sys.stdin.readline)  # until the test is done
    await actor.close()

asyncio.run(main())
"""


async def test_a_listener_out_of_descriptors_backs_off_and_keeps_listening(tmp_path):
    """A rank whose process has no descriptor left: accept fails with EMFILE; the listener logs
    it, backs off and, once descriptors are free again, the tool waiting in the backlog is
    answered (before: the rank's accept task died at the first EMFILE; no one got in again)."""
    (tmp_path / "rank.py").write_text(EMFILE_RANK)
    rank = subprocess.Popen([sys.executable, str(tmp_path / "rank.py")], cwd=str(REPO), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        port = int(await asyncio.to_thread(rank.stdout.readline))
        assert await ask("127.0.0.1", port, b"emfile-secret", "emfile", "ringweave.ping", timeout_s=10) == 0
    finally:
        _, err = await asyncio.to_thread(rank.communicate, "\n", 20)
    assert "accept out of descriptors or memory" in err and "Too many open files" in err, err[-2000:]


async def test_connections_that_send_only_a_prefix_allocate_little():
    """400 connections to a store and to a rank each send a prefix and stop: half announce a
    60,000-byte header (refused from the prefix: the handshake's limit is 1 KiB), half a 1 KiB
    one (kept, within the bound on handshakes, until dropped). Python's memory at the peak stays
    under PREFIX_PEAK_BOUND (before: 64 KiB per connection announcing it, 24 MB here)."""
    srv = await StoreServer("127.0.0.1", 0, secret=SECRET).start()
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    socks = []
    tracemalloc.start()
    try:
        loop = asyncio.get_running_loop()
        for host, port in [(srv.host, srv.port), rts[1].actor.address]:
            for i, sock in enumerate(await idle_connections(host, port, PREFIXES)):
                socks.append(sock)
                await loop.sock_sendall(sock, prefix(60_000 if i % 2 else 1000, 0))
        await asyncio.sleep(0.5)  # the listeners read them
        _, peak = tracemalloc.get_traced_memory()
        print(f"\n   {2 * PREFIXES} prefix-only connections: Python memory peak {peak / 2**20:.1f} MiB")
        assert peak < PREFIX_PEAK_BOUND, peak
        assert await ask(*rts[1].actor.address, SECRET, "test", "ringweave.ping", timeout_s=5) == 1
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
        for rt in rts:
            await rt.close()
        await srv.close()


async def test_refusals_are_cut_short_and_rate_limited(caplog):
    """200 strangers with a wrong MAC and a 900-character ``who`` each: the log keeps a few
    short lines (before: 200 lines of the whole ``who``; with a 60 KB one, 12 MB of stderr)."""
    caplog.set_level(logging.WARNING)
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    try:
        host, port = rts[0].actor.address

        async def stranger():
            sock = await net.connect(host, port, 5)
            try:
                with pytest.raises(Exception):
                    await auth.connect(sock, b"wrong", "test", {"tool": "x" * 900}, "rank 0")
            finally:
                sock.close()

        await asyncio.gather(*(stranger() for _ in range(200)))
        await asyncio.sleep(0.1)
    finally:
        for rt in rts:
            await rt.close()
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage() or "not logged" in r.getMessage()]
    assert 1 <= len(lines) <= 25, len(lines)  # runtime/acceptor.LOG_LINES per 10 s, then one line counting
    assert max(len(line) for line in lines) < 400, max(lines, key=len)
    assert any("more refusals" in line for line in lines), lines[-3:]


async def test_a_silent_connection_is_dropped_naming_the_deadline(caplog):
    rts = await make_runtimes(2, "tcp", secret=SECRET, handshake_timeout_s=0.3)
    try:
        sock = await net.connect(*rts[0].actor.address, 5)
        try:
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(5):
                while await loop.sock_recv(sock, 4096):  # the hello, then the close
                    pass
        finally:
            sock.close()
    finally:
        for rt in rts:
            await rt.close()
    assert "no handshake within 0.3 s" in caplog.text, caplog.text[-2000:]


async def test_the_oldest_handshake_is_dropped_for_a_new_connection():
    """With room for 8 handshakes, 12 silent connections: the first 4 are dropped at once (not
    at the 10 s deadline), and a tool that comes after them is answered."""
    rts = await make_runtimes(2, "tcp", secret=SECRET, max_handshaking=8)
    socks = []
    try:
        host, port = rts[0].actor.address
        loop = asyncio.get_running_loop()
        for _ in range(12):
            socks += await idle_connections(host, port, 1)
            await asyncio.sleep(0.02)  # accepted in this order
        t0 = time.monotonic()

        async def closed(sock) -> bool:
            try:
                async with asyncio.timeout(3):
                    while await loop.sock_recv(sock, 4096):
                        pass
                return True
            except TimeoutError:
                return False

        assert await asyncio.gather(*(closed(s) for s in socks[:4])) == [True] * 4
        assert time.monotonic() - t0 < 3
        assert await ask(host, port, SECRET, "test", "ringweave.ping", timeout_s=5) == 0
    finally:
        for s in socks:
            s.close()
        for rt in rts:
            await rt.close()


async def test_tools_are_answered_while_the_loop_is_stalled():
    """The ranks' event loop is blocked for 2.5 s (a long native call, or a tight loop of
    shared-memory collectives that seldom yields); a tool on another thread still completes its
    handshake and gets ``ringweave.status`` in time (before: 'not answering')."""
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    try:
        host, port = rts[1].actor.address
        got: dict = {}

        def tool():
            t0 = time.monotonic()
            try:
                got["status"] = asyncio.run(ask(host, port, SECRET, "test", "ringweave.status", timeout_s=2.0))
            except Exception as exc:  # noqa: BLE001 - the assert below shows it
                got["error"] = repr(exc)
            got["s"] = time.monotonic() - t0

        thread = threading.Thread(target=tool)
        thread.start()
        time.sleep(2.5)  # the stall: this thread runs every rank's loop
        thread.join(10)
        assert "status" in got, got
        assert got["status"]["rank"] == 1 and got["status"]["calls"] == [], got
        assert got["s"] < 2.0, got
    finally:
        for rt in rts:
            await rt.close()


def test_handshake_frames_are_read_into_a_small_buffer():
    """The handshake's header limit (1 KiB) is checked from the 16-byte prefix."""
    assert auth.HANDSHAKE_BUFFER_NBYTES == wire.PREFIX_NBYTES + 1024
    with pytest.raises(Exception, match="limit 1..1024"):
        wire.parse_prefix(prefix(1025, 0), 0, max_header_nbytes=auth.HANDSHAKE_MAX_HEADER_NBYTES)
