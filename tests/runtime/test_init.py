"""Joining a job: environment parsing, rendezvous through a store, the real launcher."""

import asyncio
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import runtime
from runtime.errors import RingweaveError
from runtime.init import read_env
from runtime.store import MemoryStore

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (3, 4, 1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (2, 8, 0, 4)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2, None, None)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
      "SLURM_STEP_ID": "0"}, (5, 8, 1, 4)),
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (0, 2, None, None)),
])
def test_read_env(env, expected):
    got = read_env(env)
    assert (got["rank"], got["world_size"], got["local_rank"], got["local_world_size"]) == expected


def test_read_env_rejects_garbage():
    with pytest.raises(RingweaveError, match="RANK='x'"):
        read_env({"RANK": "x", "WORLD_SIZE": "2"})


async def test_init_through_a_shared_store_runs_ranks_in_one_loop():
    store = MemoryStore(10)
    n = 3

    async def rank(r):
        rt = await runtime.init(r, n, store=store, timeout_s=10)
        assert runtime.current() is rt  # the task's own runtime
        x = np.full(8, r, np.int64)
        for peer in range(n):
            if peer != r:
                await rt.actor.send(peer, "x", x)
        total = x.copy()
        for peer in range(n):
            if peer != r:
                y = np.empty(8, np.int64)
                await rt.actor.recv_into(peer, "x", y)
                total += y
        assert len(set(rt.nodes)) == 1  # one machine
        await rt.close()
        return int(total[0])

    assert await asyncio.gather(*(rank(r) for r in range(n))) == [3, 3, 3]


async def test_world_size_one_needs_no_store_or_port():
    rt = await runtime.init(0, 1)
    assert rt.world.size == 1 and rt.world.rank == 0
    await runtime.shutdown(rt)


def launch(tmp_path, source: str, n: int) -> str:
    """Runs ``source`` on ``n`` ranks under our launcher; returns their prefixed output."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(source))
    out = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", str(n), str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_job_through_the_launcher_authenticates_and_exchanges(tmp_path):
    stdout = launch(tmp_path, """
        import asyncio, os, numpy as np, runtime
        async def main():
            assert os.environ["RINGWEAVE_SECRET"]          # the launcher's contract: it made a secret
            rt = await runtime.init()
            w = rt.world
            right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
            x = np.full(1 << 16, w.rank, np.float32); y = np.empty_like(x)
            fut = asyncio.ensure_future(rt.actor.recv_into(left, "ring", y))
            await rt.actor.send(right, "ring", x); await fut
            assert (y == left).all()
            print(f"rank {w.rank} got {int(y[0])} from {left}")
            await runtime.shutdown()
        asyncio.run(main())
    """, 3)
    for r in range(3):
        assert f"[rank {r}] rank {r} got {(r - 1) % 3} from {(r - 1) % 3}" in stdout


def test_under_the_launcher_init_after_shutdown_forms_generation_1(tmp_path):
    """A second init() of each rank (after shutdown) counts generation 1 in the launcher's store:
    its own namespace, so neither the addresses nor the shutdown's counter meet generation 0's."""
    stdout = launch(tmp_path, """
        import asyncio, numpy as np, runtime
        async def main():
            for _ in range(2):
                rt = await runtime.init()
                x = np.full(4, rt.rank, np.int64); y = np.empty_like(x)
                await rt.actor.send((rt.rank + 1) % rt.world_size, "t", x)
                await rt.actor.recv_into((rt.rank - 1) % rt.world_size, "t", y)
                print(f"generation {rt.generation} in {rt.store.prefix} got {int(y[0])}", flush=True)
                await runtime.shutdown()
        asyncio.run(main())
    """, 2)
    for r in range(2):
        for generation, prefix in ((0, "restart/0"), (1, "restart/0/gen/1")):
            assert f"[rank {r}] generation {generation} in {prefix} got {(r - 1) % 2}" in stdout, stdout


def test_ranks_started_by_hand_with_torchrun_variables(tmp_path):
    """No launcher: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT, started in any order."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "hand.py"
    script.write_text(textwrap.dedent("""
        import asyncio, runtime
        async def main():
            rt = await runtime.init()
            await rt.actor.send((rt.rank + 1) % rt.world_size, "t", {"from": rt.rank})
            msg = await rt.actor.recv((rt.rank - 1) % rt.world_size, "t")
            print("ok", rt.rank, msg["from"])
            await runtime.shutdown()
        asyncio.run(main())
    """))
    procs = []
    for r in (1, 0):  # the non-host starts first and retries until rank 0's store is up
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("RINGWEAVE_STORE_HOSTED", None)
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=50) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "ok 1 0" in outs[0][0] and "ok 0 1" in outs[1][0]


async def test_a_world_size_without_a_rank_is_refused(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RingweaveError, match="rank is None and world size 4: give both"):
        await runtime.init(world_size=4, master_port=1)
