"""Another local user, for the security tests: code run in a forked child that has dropped to
uid/gid ``nobody`` (only root can do that, so the tests that use it skip otherwise).

    result = as_stranger(fn, *args)           # fn(*args) as nobody; its JSON-able result
    with Stranger(fn, *args) as s:            # fn(*args) as nobody in the background ...
        ...                                   # ... until the block ends (SIGTERM)
    s.result                                  # what fn returned (or printed as its last words)

The child runs the parent's already-loaded code (no exec: the test's Python may live where
``nobody`` cannot read), writes its result as JSON to a pipe and leaves with ``os._exit``.

Not here: the attacks themselves (each test file writes its own).
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import traceback

import pytest

try:
    NOBODY = pwd.getpwnam("nobody")
except KeyError:  # pragma: no cover - every Linux has it
    NOBODY = None

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or NOBODY is None,
    reason="needs root (and a 'nobody' user): the test plays another local user by forking a child "
           "that drops to uid nobody with setgid/setuid")


def _drop() -> None:
    os.setgroups([])
    os.setgid(NOBODY.pw_gid)
    os.setuid(NOBODY.pw_uid)
    assert os.geteuid() == NOBODY.pw_uid


class Stopped(BaseException):
    """Raised in a background stranger when the test stops it: ``fn`` catches it and returns
    what it found."""


def _stop(*_) -> None:
    raise Stopped()


class Stranger:
    """``fn(*args)`` run as uid nobody in a forked child; see the module docstring. Stopping it
    raises :class:`Stopped` inside ``fn``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args
        self.pid = 0
        self._r = None
        self.result = None

    def start(self) -> "Stranger":
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the test
            code = 0
            try:
                os.close(r)
                signal.signal(signal.SIGTERM, _stop)
                _drop()
                out = {"ok": self.fn(*self.args)}
            except BaseException as exc:  # noqa: BLE001 - the parent reports it
                out = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-2000:]}
                code = 1
            try:
                os.write(w, json.dumps(out, default=repr).encode())
            finally:
                os._exit(code)
        os.close(w)
        self.pid, self._r = pid, r
        return self

    def stop(self, signal_first: bool = True) -> object:
        if signal_first:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        return self.wait()

    def wait(self) -> object:
        chunks = []
        while True:
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self._r)
        self._r = None
        os.waitpid(self.pid, 0)
        raw = b"".join(chunks)
        out = json.loads(raw) if raw else {"error": "the stranger died without a word"}
        if "error" in out:
            raise AssertionError(f"the stranger failed: {out['error']}\n{out.get('tb', '')}")
        self.result = out["ok"]
        return self.result

    def __enter__(self) -> "Stranger":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self._r is not None:
            self.stop()


def as_stranger(fn, *args):
    """Runs ``fn(*args)`` as uid nobody and returns its (JSON-able) result."""
    return Stranger(fn, *args).start().wait()
