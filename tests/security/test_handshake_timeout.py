"""RINGWEAVE_HANDSHAKE_TIMEOUT_S: how long a new connection has to finish the handshake. Unset it
is 10 s; a listener (a rank's, the store's) reads it when it is made and drops a connection that
says nothing at that deadline; a given ``handshake_timeout_s`` wins; a bad value is a
SettingError naming the variable and its value, raised where the listener is made.
(tests/security/test_security_job.py runs a launched job under a short setting.)"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from runtime import auth, env, net
from runtime.actor import Actor
from runtime.errors import SettingError
from runtime.store_server import StoreServer
from runtime.testing import make_runtimes

NAME = env.HANDSHAKE_TIMEOUT.name  # RINGWEAVE_HANDSHAKE_TIMEOUT_S
SECRET = b"handshake-timeout-test-secret"


def test_unset_it_is_ten_seconds(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert NAME == "RINGWEAVE_HANDSHAKE_TIMEOUT_S" and env.HANDSHAKE_TIMEOUT.default == "10"
    assert auth.HANDSHAKE_TIMEOUT_S == 10.0 and auth.handshake_timeout() == 10.0
    assert StoreServer(secret=SECRET).handshake_timeout_s == 10.0
    monkeypatch.setenv(NAME, " ")  # blank counts as unset
    assert auth.handshake_timeout() == 10.0


@pytest.mark.parametrize("raw,must", [("0", "positive"), ("-2", "positive"), ("nan", "finite"), ("inf", "finite"),
                                      ("2s", "is not a number of seconds")])
def test_a_bad_value_is_refused_where_a_listener_is_made(monkeypatch, raw, must):
    monkeypatch.setenv(NAME, raw)
    said = re.escape(f"{NAME}={raw!r}") + f".*{must}"
    with pytest.raises(SettingError, match=said):
        StoreServer(secret=SECRET)
    with pytest.raises(SettingError, match=said):
        Actor(0, 2, secret=SECRET)
    with pytest.raises(SettingError, match=said):
        auth.handshake_timeout()
    assert StoreServer(secret=SECRET, handshake_timeout_s=3.0).handshake_timeout_s == 3.0  # given: not read


async def closed_after(host: str, port: int) -> float:
    """Connects and says nothing; returns when the listener closed the connection (seconds), having
    sent its hello first."""
    loop = asyncio.get_running_loop()
    sock = await net.connect(host, port, 5)
    began, got = time.monotonic(), b""
    try:
        async with asyncio.timeout(8):
            while chunk := await loop.sock_recv(sock, 4096):
                got += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    assert got, "the listener sent no hello"
    return time.monotonic() - began


async def test_listeners_drop_a_silent_connection_at_the_setting_read_when_made(monkeypatch):
    monkeypatch.setenv(NAME, "0.4")
    store = await StoreServer(secret=SECRET).start()
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    try:
        monkeypatch.setenv(NAME, "30")  # read when made: the listeners keep 0.4 s
        rank_host, rank_port = rts[1].actor.peers.address
        took = await asyncio.gather(closed_after("127.0.0.1", store.port), closed_after(rank_host, rank_port))
        assert store.handshake_timeout_s == 0.4 and rts[1].actor.peers.acceptor.handshake_timeout_s == 0.4
        # at the deadline: not before it, and far from 30 s or the 10 s default (load allowed for)
        assert all(0.35 < t < 3.0 for t in took), took
        # the ranks' own connections finished their handshakes well inside it: the job is connected
        assert sorted(rts[0].actor.conns) == [1] and sorted(rts[1].actor.conns) == [0]
    finally:
        await asyncio.gather(*(rt.close() for rt in rts))
        await store.close()
