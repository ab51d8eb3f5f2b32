"""The blocking facade: from a plain script through the real launcher, and from
several threads of one process (each rank a Communicator, several threads per rank)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from collectives import Communicator
from runtime.errors import ClosedError

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import numpy as np
    from collectives import Communicator

    with Communicator.from_env(timeout=30) as comm:
        x = np.ones(4, np.float32) * (comm.rank + 1)
        comm.all_reduce(x)
        out = np.empty(2 * comm.world_size, np.int64)
        h = comm.all_gather_async(out, np.array([comm.rank, 10 * comm.rank]))
        y = np.arange(3, dtype=np.float64) if comm.rank == 0 else np.zeros(3)
        comm.broadcast(y, src=0)
        h.wait(timeout=30)
        comm.barrier()
        print(f"rank {comm.rank}: x={x.tolist()} out={out.tolist()} y={y.tolist()} done={h.done()}")
""")


@pytest.mark.timeout(90)
def test_plain_script_through_launcher(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "2", str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        assert (f"rank {r}: x=[3.0, 3.0, 3.0, 3.0] out=[0, 0, 1, 10] y=[0.0, 1.0, 2.0] done=True"
                in proc.stdout), proc.stdout + proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_threads(fns, names=None):
    """Runs each of ``fns`` in a thread of its own, named ``names[i]`` (default: all "caller", one
    thread per rank). Ranks that are threads of one process name their threads alike across
    ranks, as the processes of a real job do (a call's fingerprint carries its thread's name:
    collectives/blocking.py)."""
    errors, results = [], [None] * len(fns)

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i, fn), name=names[i] if names else "caller")
               for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.timeout(90)
def test_several_threads_per_rank():
    n, nthreads, calls = 3, 3, 15
    port = _free_port()
    comms = _run_threads([lambda r=r: Communicator(rank=r, world_size=n, master_addr="127.0.0.1",
                                                   master_port=port, timeout=30) for r in range(n)])
    try:
        # every rank makes the same groups in the same order: one per thread
        groups = [[c.new_group(range(n)) for _ in range(nthreads)] for c in comms]

        def worker(r, t):
            comm, group = comms[r], groups[r][t]
            for i in range(calls):
                x = np.full(5, r + t + i, np.int64)
                comm.all_reduce(x, group=group)
                assert (x == n * (t + i) + n * (n - 1) // 2).all(), x
            handles = [comm.all_reduce_async(np.full(3, 1.0), group=group) for _ in range(4)]
            return [h.wait(30).tolist() for h in handles]

        results = _run_threads([lambda r=r, t=t: worker(r, t) for r in range(n) for t in range(nthreads)],
                               [f"worker-{t}" for r in range(n) for t in range(nthreads)])
        assert all(res == [[float(n)] * 3] * 4 for res in results)
        # the world group, also from threads
        sums = _run_threads([lambda c=c: c.all_reduce(np.array([c.rank], np.int32)).tolist() for c in comms],
                            ["world"] * n)
        assert sums == [[n * (n - 1) // 2]] * n
    finally:
        _run_threads([c.close for c in comms])
    with pytest.raises(ClosedError):
        comms[0].all_reduce(np.ones(1))
    comms[0].close()  # idempotent


@pytest.mark.timeout(60)
def test_a_handle_raises_the_calls_own_timeout():
    """A collective that times out raises its CollectiveTimeoutError (a TimeoutError) through
    ``Handle.wait``, not the wait's own "still running"."""
    from runtime.errors import CollectiveTimeoutError
    port = _free_port()
    comms = _run_threads([lambda r=r: Communicator(rank=r, world_size=2, master_addr="127.0.0.1", master_port=port,
                                                   timeout=30) for r in range(2)])
    try:
        with pytest.raises(CollectiveTimeoutError):  # rank 1 never joins the call
            comms[0].all_reduce_async(np.ones(2), timeout=0.3).wait()
    finally:
        _run_threads([c.abort for c in comms])


@pytest.mark.timeout(90)
def test_the_mpi_and_torch_calls_block_too():
    """scan, exscan, sendrecv, probe/iprobe, split, new_subgroups and monitored_barrier on the
    facade, with the async ones' arguments."""
    n = 3
    port = _free_port()
    comms = _run_threads([lambda r=r: Communicator(rank=r, world_size=n, master_addr="127.0.0.1",
                                                   master_port=port, timeout=30) for r in range(n)])

    def rank(comm):
        r = comm.rank
        x = np.array([r + 1.0])
        comm.scan(x)
        y = np.array([r + 1])
        comm.exscan(y, op="prod")
        out = np.empty(1, np.int64)
        src = comm.sendrecv(np.array([r]), (r + 1) % n, out, (r - 1) % n)
        sub = comm.split(color=r % 2, key=-r)
        mine, every = comm.new_subgroups(ranks=[[0, 1], [2]])
        if r == 1:
            comm.send(np.zeros((2, 2), np.float32), dst=0, tag=5)
        status = comm.probe(src=1, tag=5, timeout=30) if r == 0 else None
        if r == 0:
            assert comm.iprobe(src=1, tag=5) == status
            comm.recv(np.empty((2, 2), np.float32), src=1, tag=5)
        comm.monitored_barrier(timeout=30)
        return (x.tolist(), y.tolist(), src, out.tolist(), sub.ranks, mine.ranks, len(every),
                status and (status.source, status.shape))

    try:
        got = _run_threads([lambda c=c: rank(c) for c in comms])
    finally:
        _run_threads([c.close for c in comms])
    assert got == [([1.0], [1], 2, [2], [2, 0], [0, 1], 2, (1, (2, 2))),
                   ([3.0], [1], 0, [0], [1], [0, 1], 2, None),
                   ([6.0], [2], 1, [1], [2, 0], [2], 2, None)]
