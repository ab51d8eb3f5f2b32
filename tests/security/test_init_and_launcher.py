"""Joining a job and starting one, when the caller is careless (runtime/init.py, runtime/auth.py,
runtime/launch.py, runtime/launch_config.py):

* ``init()`` twice: a clear error (before: a second runtime, or an ExceptionGroup, by timing);
* a failed rendezvous raises the documented AuthenticationError / ConnectError, not an
  ExceptionGroup of them;
* the secret leaves ``os.environ`` once read: what the rank starts does not inherit it;
* the launcher refuses an ``-n`` far past the machine's cores without ``--force``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

import runtime
from runtime import auth, launch, launch_config
from runtime.errors import AuthenticationError, ConnectError, RingweaveError
from runtime.launch_outcome import EXIT_USAGE
from runtime.scheduler import usable_cores
from runtime.store import MemoryStore

pytestmark = pytest.mark.timeout(60)


async def test_init_twice_is_a_clear_error():
    rt = await runtime.init(0, 1)
    try:
        with pytest.raises(RingweaveError, match="init\\(\\) was called again"):
            await runtime.init(0, 1)
        assert runtime.current() is rt
    finally:
        await runtime.shutdown(rt)
    rt = await runtime.init(0, 1)  # after shutdown, again
    await runtime.shutdown(rt)


async def test_two_inits_at_once_make_one_runtime():
    results = await asyncio.gather(runtime.init(0, 1), runtime.init(0, 1), return_exceptions=True)
    made = [r for r in results if isinstance(r, runtime.RankRuntime)]
    refused = [r for r in results if isinstance(r, BaseException)]
    try:
        assert len(made) == 1 and len(refused) == 1, results
        assert type(refused[0]) is RingweaveError and "init() was called again" in str(refused[0]), refused
    finally:
        for rt in made:
            await runtime.shutdown(rt)
    # the first one still joining (it waits for a rank 1 that never comes): the second is refused
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first, second = await asyncio.gather(runtime.init(0, 2, master_port=port, timeout_s=1),
                                         runtime.init(0, 2, master_port=port, timeout_s=1), return_exceptions=True)
    assert isinstance(first, RingweaveError) and "init() was called again" not in str(first), repr(first)
    assert type(second) is RingweaveError and "still joining" in str(second), repr(second)


async def test_a_rank_with_the_wrong_secret_gets_authentication_error_not_a_group():
    """Rank 1 has another secret than rank 0: rank 1's dial is refused (AuthenticationError),
    rank 0 waits for rank 1 in vain (ConnectError naming it). Neither is an ExceptionGroup."""
    store = MemoryStore(10)

    async def rank(r):
        try:
            rt = await runtime.init(r, 2, store=store, timeout_s=2, secret=b"right" if r == 0 else b"wrong")
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            return exc
        await rt.close()
        return rt

    got = await asyncio.gather(*(rank(r) for r in range(2)))
    assert type(got[1]) is AuthenticationError and "refused us" in str(got[1]), repr(got[1])
    assert type(got[0]) is ConnectError and "rank 1 did not connect" in str(got[0]), repr(got[0])


async def test_the_secret_leaves_the_environment_once_read(monkeypatch):
    secret = "e" * 64
    monkeypatch.setenv(auth.SECRET_ENV, secret)
    rt = await runtime.init(0, 1)
    try:
        assert auth.SECRET_ENV not in os.environ
        child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({auth.SECRET_ENV!r}))"],
                               capture_output=True, text=True, timeout=30)
        assert child.stdout.strip() == "None"  # a data loader, a tool: not the job's secret
        assert auth.secret_from_env() == secret.encode()  # still known to this process
        assert auth.export_secret({})[auth.SECRET_ENV] == secret  # given on purpose to a child that joins
    finally:
        await runtime.shutdown(rt)


def test_the_launcher_refuses_a_huge_n_without_force():
    bound = launch_config.nproc_bound(usable_cores())
    with pytest.raises(ValueError, match="pass --force"):
        launch_config.parse_args(["-n", str(bound + 1), "train.py"])
    assert launch_config.parse_args(["-n", str(bound), "train.py"]).nproc == bound
    assert launch_config.parse_args(["-n", "100000", "--force", "train.py"]).nproc == 100000
    assert launch.main(["-n", "100000", "train.py"]) == EXIT_USAGE  # nothing was started
    assert launch_config.nproc_bound(2) == 64 and launch_config.nproc_bound(64) == 256
