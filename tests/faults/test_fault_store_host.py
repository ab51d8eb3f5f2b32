"""The store's host dies during rendezvous: the others fail with a clear error, not a hang.

Ranks started by hand (no launcher), as mpirun or srun would start them:
RANK, WORLD_SIZE=5, MASTER_ADDR, MASTER_PORT, RINGWEAVE_SECRET, and no
RINGWEAVE_STORE_HOSTED, so rank 0 hosts the store. Ranks 0-3 start; rank 4
never comes, so ranks 1-3 wait inside ``runtime.init()`` (for ``addr/4``). Once
all four have published their address the test kills rank 0 with SIGKILL.
Ranks 1-3 must fail within 5 s (their timeout is 60 s) with an error that
says the store at MASTER_ADDR:MASTER_PORT went away, and exit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time

import pytest

from tests.faults.harness import PRELUDE, PYTHON, REPO, REPORT_RE, alive

SECRET = "store-host-test-secret"

RENDEZVOUS = r'''
async def main():
    try:
        rt = await runtime.init()
    except RingweaveError as exc:
        report(exc)
        raise SystemExit(1)
    print(f"rank {RANK}: init returned (world {rt.world_size})", flush=True)
    await runtime.shutdown(rt)

asyncio.run(main())
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_for_addresses(port: int, n: int, timeout_s: float) -> None:
    from runtime.store_tcp import TCPStore

    store = await TCPStore.connect("127.0.0.1", port, secret=SECRET.encode(), job="ringweave",
                                   timeout_s=timeout_s, who={"tool": "test"})
    try:
        await store.wait([f"restart/0/addr/{r}" for r in range(n)], timeout_s)
    finally:
        await store.close()


@pytest.mark.timeout(60)
def test_store_host_killed_during_rendezvous(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(PRELUDE + RENDEZVOUS)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RINGWEAVE_STORE_HOSTED", "RINGWEAVE_SECRET")}
    base.update(PYTHONPATH=str(REPO), WORLD_SIZE="5", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                RINGWEAVE_SECRET=SECRET, RINGWEAVE_TIMEOUT_S="60", PYTHONUNBUFFERED="1")
    procs = {r: subprocess.Popen([PYTHON, str(script), str(out)], env=dict(base, RANK=str(r)), cwd=str(REPO),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(4)}
    try:
        asyncio.run(wait_for_addresses(port, 4, 30))  # ranks 0-3 are in init, waiting for rank 4
        (out / "fault").write_text(f"{time.monotonic()!r} 0 SIGKILL")
        procs[0].send_signal(signal.SIGKILL)
        outputs = {r: p.communicate(timeout=20)[0] for r, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    print("\n== rank 0 (hosting the store) killed while ranks 1-3 wait in init for rank 4")
    for r in (1, 2, 3):
        m = REPORT_RE.search("\n".join(f"[rank {r}] {line}" for line in outputs[r].splitlines()))
        assert m is not None, f"rank {r} printed no error:\n{outputs[r]}"
        error, after, message = m.group(3), float(m.group(4)), m.group(5)
        print(f"   rank {r}: {error} after {after:.3f} s: {message}")
        assert after < 5.0, (r, after, message)
        assert f"127.0.0.1:{port}" in message and "store" in message, (r, message)
        assert procs[r].returncode == 1, (r, procs[r].returncode, outputs[r])
    assert procs[0].returncode == -signal.SIGKILL
    assert not any(alive(p.pid) for p in procs.values())
