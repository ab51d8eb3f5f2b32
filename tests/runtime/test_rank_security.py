"""Strangers on a rank's port: wrong secret, garbage, silence. Each is refused
and logged, and the job's own traffic goes on."""

import asyncio
import socket

import numpy as np
import pytest

from runtime import auth, net
from runtime.errors import AuthenticationError
from runtime.testing import make_runtimes

pytestmark = pytest.mark.timeout(60)
SECRET = b"s3cret-for-tests"


async def exchange(rts):
    """A round of real traffic between every pair, checked."""
    async def one(rt):
        a = rt.actor
        for peer in range(rt.world_size):
            if peer != rt.rank:
                await a.send(peer, "hi", np.full(1000, rt.rank, np.int32))
        for peer in range(rt.world_size):
            if peer != rt.rank:
                out = np.empty(1000, np.int32)
                await a.recv_into(peer, "hi", out)
                assert (out == peer).all()
    await asyncio.gather(*(one(rt) for rt in rts))


async def test_wrong_secret_is_refused_and_job_goes_on(caplog):
    rts = await make_runtimes(3, "tcp", secret=SECRET)
    try:
        host, port = rts[1].actor.address
        sock = await net.connect(host, port, 5)
        with pytest.raises(AuthenticationError, match="refused us"):
            await auth.connect(sock, b"wrong", "test", {"rank": 0}, "rank 1")
        sock.close()
        sock = await net.connect(host, port, 5)
        with pytest.raises(AuthenticationError):  # no secret at all
            await auth.connect(sock, None, "test", {"rank": 0}, "rank 1")
        sock.close()
        await asyncio.sleep(0.05)
        assert "refused a connection" in caplog.text
        await exchange(rts)
    finally:
        for rt in rts:
            await rt.close()


async def test_right_secret_but_duplicate_rank_is_refused(caplog):
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    try:
        host, port = rts[1].actor.address
        sock = await net.connect(host, port, 5)
        with pytest.raises(AuthenticationError, match="already connected"):
            await auth.connect(sock, SECRET, "test", {"rank": 0}, "rank 1")  # rank 0 is already connected
        sock.close()
        await asyncio.sleep(0.05)
        assert "already connected" in caplog.text
        await exchange(rts)
    finally:
        for rt in rts:
            await rt.close()


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", b"\x00" * 64, b"RWV\x01" + b"\xff" * 12,
                                     b"RWV\x01\x10\x00\x00\x00" + (2**60).to_bytes(8, "little")])
async def test_garbage_on_rank_port(garbage, caplog):
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    try:
        host, port = rts[0].actor.address

        def stranger():  # a blocking client, on a thread so the ranks' loop keeps running
            with socket.create_connection((host, port)) as s:
                s.sendall(garbage)
                s.settimeout(5)
                try:
                    while s.recv(4096):  # the rank sends its hello, then closes on the garbage
                        pass
                except ConnectionResetError:
                    pass

        await asyncio.to_thread(stranger)
        await exchange(rts)
    finally:
        for rt in rts:
            await rt.close()


async def test_silent_connection_is_dropped_after_the_handshake_deadline(caplog):
    rts = await make_runtimes(2, "tcp", secret=SECRET, handshake_timeout_s=0.3)
    try:
        host, port = rts[0].actor.address

        def silent():  # connects and never speaks
            with socket.create_connection((host, port)) as s:
                s.settimeout(5)
                data = b""
                while True:  # hello arrives, then EOF once the deadline passes
                    chunk = s.recv(4096)
                    if not chunk:
                        return data
                    data += chunk

        assert (await asyncio.to_thread(silent)).startswith(b"RWV")
        await exchange(rts)
    finally:
        for rt in rts:
            await rt.close()


async def test_bad_frame_from_an_authenticated_peer_closes_only_that_connection(caplog):
    rts = await make_runtimes(3, "tcp", secret=SECRET)
    try:
        conn = rts[2].actor.conns[0]
        conn._proto.transport.write(b"RWV\x01" + b"\x00" * 12)  # header of 0 bytes: a bad frame
        await asyncio.sleep(0.2)
        assert 2 in rts[0].actor.lost_peers()
        assert "bad frame" in caplog.text
        a0, a1 = rts[0].actor, rts[1].actor
        await a0.send(1, "still", b"alive")
        assert bytes(await a1.recv(0, "still")) == b"alive"
    finally:
        for rt in rts:
            await rt.close()
