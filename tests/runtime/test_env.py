"""runtime.env.get gives what os.environ.get gives, including after changes between calls."""

from __future__ import annotations

import os

from runtime import env


def test_get_follows_os_environ(monkeypatch):
    name = "RINGWEAVE_TEST_ENV_GET"
    monkeypatch.delenv(name, raising=False)
    assert env.get(name) is None and env.get(name, "d") == "d"
    monkeypatch.setenv(name, "0")
    assert env.get(name) == os.environ.get(name) == "0"
    monkeypatch.setenv(name, "héllo")
    assert env.get(name) == "héllo"
    monkeypatch.delenv(name)
    assert env.get(name, "gone") == "gone"
