"""Acceptor.close is bounded: a thread that does not end (its loop stuck in a callback) is waited
for JOIN_S, then logged by the listener's name, and close returns instead of hanging."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import pytest

from runtime import acceptor
from runtime.acceptor import Acceptor

pytestmark = pytest.mark.timeout(60)


def test_close_returns_and_logs_when_the_thread_is_stuck(monkeypatch, caplog):
    monkeypatch.setattr(acceptor, "JOIN_S", 0.2)
    release = threading.Event()

    async def main():
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            listener.setblocking(False)
            acc = Acceptor(listener, secret=b"acceptor-close-secret", job="acceptor-close", name="listener X",
                           deliver=lambda sock, who, where: sock.close()).start()
            acc._loop.call_soon_threadsafe(release.wait, 20.0)  # the thread's loop stands still
            try:
                with caplog.at_level(logging.ERROR, logger="ringweave.acceptor"):
                    acc.close()
                stuck_after_close = acc._thread.is_alive()
            finally:
                release.set()
                acc._thread.join(20.0)
            return stuck_after_close, acc._thread.is_alive()
        finally:
            listener.close()

    stuck_after_close, alive_at_end = asyncio.run(main())
    assert stuck_after_close  # close returned while the thread was still stuck: it did not wait for it
    assert not alive_at_end
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("listener X" in m and "did not end within 0.2 s" in m for m in errors), errors
