"""runtime.env.get gives what os.environ.get gives, including after changes between calls."""

from __future__ import annotations

import os

import pytest

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


def test_timeout_is_read_when_a_runtime_is_made_not_at_import(monkeypatch):
    """RINGWEAVE_TIMEOUT_S set after `import runtime` still applies, to collectives and to
    point-to-point alike (it was read once at import for the first and per actor for the second)."""
    import asyncio

    import runtime

    async def made():
        rt = await runtime.init(rank=0, world_size=1)
        try:
            return rt.timeout_s, rt.actor.default_timeout_s
        finally:
            await runtime.shutdown(rt)

    monkeypatch.delenv("RINGWEAVE_TIMEOUT_S", raising=False)
    assert asyncio.run(made()) == (env.DEFAULT_TIMEOUT_S,) * 2
    monkeypatch.setenv("RINGWEAVE_TIMEOUT_S", "7.5")
    assert asyncio.run(made()) == (7.5, 7.5)


def test_a_bad_timeout_names_the_variable(monkeypatch):
    for raw, why in [("abc", "is not a number of seconds"), ("0", "must be a positive"),
                     ("-3", "must be a positive"), ("nan", "must be a positive")]:
        monkeypatch.setenv("RINGWEAVE_TIMEOUT_S", raw)
        with pytest.raises(ValueError, match=f"RINGWEAVE_TIMEOUT_S={raw!r}.*{why}"):
            env.timeout_s()
    monkeypatch.setenv("RINGWEAVE_TIMEOUT_S", " ")
    assert env.timeout_s() == env.DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("name, read, default_us", [
    ("RINGWEAVE_INLINE_WAIT_US", env.inline_wait_s, env.DEFAULT_INLINE_WAIT_US),
    ("RINGWEAVE_SPIN_US", env.spin_s, env.DEFAULT_SPIN_US),
])
def test_a_microseconds_setting_is_read_and_a_bad_one_names_the_variable(monkeypatch, name, read, default_us):
    monkeypatch.setenv(name, "250")
    assert read() == 250e-6
    monkeypatch.setenv(name, "0")
    assert read() == 0.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}={bad!r}"):
            read()
    monkeypatch.delenv(name)
    assert read() == default_us / 1e6
