"""A small all_reduce's cost per call: ringweave beside the same protocol with no framework.

    python bench/floor.py -n 4                         # every mode, 4 ranks
    python bench/floor.py -n 2 --modes ringweave-tcp,bare-tcp-uvloop --calls 3000
    python bench/floor.py -n 4 --modes ringweave-tcp --size 64M --calls 10   # a large one (ringweave only)

Each mode runs ``--calls`` back-to-back 4 B float32 sum all_reduces (after 200 untimed) in n
processes, and prints the wall time per call (the slowest rank) and the CPU time per call
(the ranks' mean; ``time.process_time``, so every thread of a rank counts), split into user and
system time (getrusage). ``--size`` sets the array of the ringweave and gloo modes, which refill
it before each call (inside the timing: a 64 MiB fill is a few ms of user time). Modes:

  ringweave-tcp    ``collectives.all_reduce`` over TCP (RINGWEAVE_SHM=0), through runtime.launch
  ringweave-shm    the same over shared memory (RINGWEAVE_SHM=1)
  ringweave-inproc the TCP one with the n ranks as tasks of ONE process (runtime.testing, real
                   loopback sockets): no context switches and no scheduling between ranks, so the
                   CPU is the framework's own work. Runs within minutes of each other agree, but
                   it moves with the machine's slow periods too; compare A/B runs interleaved
                   (bench/results/harness.md#in-process-floor). Its wall
                   column is the CPU of every rank summed (one thread runs them all), its cpu
                   column that over n
  gloo             torch.distributed's Gloo backend (when torch is installed): the same all_reduce
                   back to back in n processes, the peer bench/collectives.py times one call at a
                   time between barriers; its tensor is refilled through NumPy (torch's fill_
                   would wake its OpenMP threads, which then spin beside the all_reduce)
  bare-tcp-block   recursive doubling over blocking loopback sockets (send / recv_into)
  bare-tcp-uvloop  the same through a minimal uvloop BufferedProtocol, one future per receive
  bare-shm         the shared-memory protocol alone: each rank writes its value and a sequence
                   word into one mmap, sched_yield-spins until every word has it, sums the
                   values in rank order, then one more word round (EXIT)

The bare modes leave out what ringweave adds: fingerprints, deadlines, call records, framing,
the public API's checks. Their time is this machine's floor, not a goal. The bare TCP modes
need n a power of two.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import mmap
import multiprocessing as mp
import os
import queue
import resource
import socket
import subprocess
import sys
import time
from unittest import mock

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# bench/collectives.py is named like the package: with this folder first on sys.path, "import
# collectives" would find it (as bench/collectives.py itself explains). The repository comes first.
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (HERE, ROOT)]

from bench.common import parse_size  # noqa: E402
MODES = ("ringweave-tcp", "ringweave-shm", "ringweave-inproc", "gloo", "bare-tcp-block", "bare-tcp-uvloop", "bare-shm")
WARMUP = 200
MSG = b"x" * 40  # a bare message: about the size of one of ringweave's 4 B frames with its header


class _Clock:
    """This process's wall, CPU, user and system time from ``start()`` on, per call."""

    def start(self) -> "_Clock":
        self.t0, self.c0, self.u0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        return self

    def per_call(self, calls: int) -> tuple[float, float, float, float]:
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        return ((time.perf_counter() - self.t0) / calls, (time.process_time() - self.c0) / calls,
                (u1.ru_utime - self.u0.ru_utime) / calls, (u1.ru_stime - self.u0.ru_stime) / calls)


def _timed(calls: int, one, after_warmup=None) -> tuple[float, float, float, float]:
    """WARMUP untimed calls of ``one``, ``after_warmup()``, then ``calls`` timed ones (_Clock)."""
    for _ in range(WARMUP):
        one()
    if after_warmup is not None:
        after_warmup()
    clock = _Clock().start()
    for _ in range(calls):
        one()
    return clock.per_call(calls)


def _over_ranks(per_rank: list) -> tuple[float, ...]:
    """Per-rank (wall, cpu, user, system): the slowest rank's wall, the mean of the rest."""
    n = len(per_rank)
    return (max(r[0] for r in per_rank),) + tuple(sum(r[k] for r in per_rank) / n for k in (1, 2, 3))


class RankFailed(RuntimeError):
    """A rank process of a mode exited before it reported its figures."""


def _in_processes(n: int, target, *args) -> tuple[float, ...]:
    """Runs ``target(n, rank, *args, out)`` in n processes; each puts its _Clock figures in ``out``.
    A rank that exits without reporting fails the mode at once (RankFailed), its peers stopped:
    waiting on them would be waiting on a rank that is gone."""
    out = mp.Queue()
    procs = [mp.Process(target=target, args=(n, r, *args, out)) for r in range(n)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + 300
    try:
        while len(results) < n:
            try:
                results.append(out.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RankFailed(f"rank(s) {failed} exited before reporting" if failed else "no report in 300 s")
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return _over_ranks(results)


# -- bare TCP ------------------------------------------------------------------------------------

def _mesh(n: int, r: int, port0: int) -> dict[int, socket.socket]:
    """Connected loopback sockets to every other rank (rank r listens on port0 + r)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port0 + r))
    srv.listen(n)
    srv.settimeout(30)  # a peer that never connects fails the rank, it does not hang it
    socks = {}
    for p in range(r + 1, n):
        deadline = time.monotonic() + 10
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", port0 + p), timeout=10)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        s.sendall(bytes([r]))
        socks[p] = s
    for _ in range(r):
        c, _ = srv.accept()
        socks[c.recv(1)[0]] = c
    srv.close()
    for s in socks.values():
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(30)  # a lost peer fails the run, it does not hang it
    return socks


def _bare_tcp_block(n: int, r: int, port0: int, calls: int, out) -> None:
    socks = _mesh(n, r, port0)
    buf = memoryview(bytearray(len(MSG)))

    def one():
        mask = 1
        while mask < n:  # recursive doubling: exchange with r ^ mask
            s = socks[r ^ mask]
            s.sendall(MSG)
            got = 0
            while got < len(MSG):
                k = s.recv_into(buf[got:])
                if not k:
                    raise ConnectionError(f"rank {r}: rank {r ^ mask} closed the connection")
                got += k
            mask <<= 1

    out.put(_timed(calls, one))


def _bare_tcp_uvloop(n: int, r: int, port0: int, calls: int, out) -> None:
    import uvloop

    class Proto(asyncio.BufferedProtocol):
        def __init__(self):
            self.buf, self.have, self.fut, self.transport = bytearray(4096), 0, None, None

        def connection_made(self, transport):
            self.transport = transport

        def get_buffer(self, sizehint):
            return memoryview(self.buf)[self.have:]

        def buffer_updated(self, nbytes):
            self.have += nbytes
            if self.have >= len(MSG) and self.fut is not None and not self.fut.done():
                self.fut.set_result(None)

    async def main():
        loop = asyncio.get_running_loop()
        socks = _mesh(n, r, port0)
        protos = {}
        for p, s in socks.items():
            s.setblocking(False)
            protos[p] = Proto()
            await loop.connect_accepted_socket(lambda p=p: protos[p], sock=s)

        async def one():
            mask = 1
            while mask < n:
                pr = protos[r ^ mask]
                pr.fut = loop.create_future()
                pr.transport.write(MSG)
                if pr.have < len(MSG):
                    await asyncio.wait_for(pr.fut, 30)
                pr.have -= len(MSG)  # messages are all MSG long and answered before the next
                mask <<= 1

        for _ in range(WARMUP):
            await one()
        clock = _Clock().start()
        for _ in range(calls):
            await one()
        out.put(clock.per_call(calls))
        for pr in protos.values():
            pr.transport.close()

    uvloop.run(main())


# -- bare shared memory ----------------------------------------------------------------------------

def _bare_shm(n: int, r: int, mm, calls: int, out) -> None:
    words = np.frombuffer(mm, np.uint64, n, 0)  # one sequence word per rank
    values = np.frombuffer(mm, np.float32, n, 8 * n)  # one 4 B slot per rank
    x = np.ones(1, np.float32)
    seq = [0]
    deadline = [0.0]

    def wait(target: int) -> None:
        while (words < target).any():
            if time.monotonic() > deadline[0]:
                raise TimeoutError(f"rank {r}: a peer never reached {target}")
            os.sched_yield()

    def one():
        deadline[0] = time.monotonic() + 30
        seq[0] += 2
        values[r] = x[0]
        words[r] = seq[0]  # posted after the value (NumPy stores in program order on x86)
        wait(seq[0])
        x[0] = values.sum(dtype=np.float32)  # rank order, the same on every rank
        if x[0] != n:
            raise AssertionError(f"rank {r}: bare shm sum {x[0]}, expected {n}")
        words[r] = seq[0] + 1  # EXIT: nobody rewrites its value before every rank has read them
        wait(seq[0] + 1)
        x[0] = 1.0

    out.put(_timed(calls, one))


# -- Gloo ----------------------------------------------------------------------------------------

def _gloo(n: int, r: int, port: int, calls: int, nbytes: int, out) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, n, is_master=r == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=r, world_size=n)
    x = torch.ones(max(1, nbytes // 4))
    xn = x.numpy()  # refilled through NumPy, one thread, as the ringweave modes do: torch's fill_
    # runs on its OpenMP pool (2 threads per rank here), whose threads then spin beside the
    # all_reduce (bench/results/transport.md#where-a-64-mib-all_reduces-cpu-goes)

    def one():
        xn.fill(1.0)
        dist.all_reduce(x)

    figures = _timed(calls, one, after_warmup=dist.barrier)
    if not bool((x == n).all()):
        raise AssertionError(f"rank {r}: gloo all_reduce gave {x[:4]}, expected {n}")
    out.put(figures)
    dist.barrier()
    dist.destroy_process_group()


def run_gloo(n: int, calls: int, nbytes: int) -> tuple[float, ...]:
    try:
        import torch  # noqa: F401  (imported in the ranks; here only to say it is missing)
    except ImportError:
        raise SystemExit("gloo: torch is not installed (pip install torch --index-url https://download.pytorch.org/whl/cpu)")
    return _in_processes(n, _gloo, _free_port(), calls, nbytes)


def run_bare(mode: str, n: int, calls: int) -> tuple[float, ...]:
    if mode.startswith("bare-tcp") and n & (n - 1):
        raise SystemExit(f"{mode} needs a power-of-two rank count, got -n {n}")
    if mode == "bare-shm":
        return _in_processes(n, _bare_shm, mmap.mmap(-1, 4096), calls)
    target = _bare_tcp_block if mode == "bare-tcp-block" else _bare_tcp_uvloop
    for _ in range(2):  # another program may take a port of the block between _free_port and bind: retry
        try:
            return _in_processes(n, target, _free_port() + 1, calls)  # rank r listens on port + 1 + r
        except RankFailed as exc:
            print(f"{mode}: {exc}; again on other ports", file=sys.stderr, flush=True)
    return _in_processes(n, target, _free_port() + 1, calls)


def _free_port() -> int:
    """A port free now (bound to 0 and released); the bare TCP modes use the block just above it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- ringweave ------------------------------------------------------------------------------------

async def _worker(calls: int, nbytes: int) -> None:
    import runtime
    import collectives
    rt = await runtime.init()
    x = np.ones(max(1, nbytes // 4), np.float32)

    async def one():
        x.fill(1.0)
        await collectives.all_reduce(x)

    for _ in range(WARMUP):
        await one()
    await collectives.barrier()
    clock = _Clock().start()
    for _ in range(calls):
        await one()
    figures = clock.per_call(calls)
    if not (x == rt.world_size).all():
        raise AssertionError(f"rank {rt.rank}: all_reduce gave {x[x != rt.world_size][:4]}, expected {rt.world_size}")
    print("FLOOR " + " ".join(repr(f) for f in figures), flush=True)
    await runtime.shutdown()


def run_inproc(n: int, calls: int, nbytes: int = 4) -> tuple[float, ...]:
    """The n ranks as tasks of this process's event loop (uvloop), over loopback TCP."""
    import runtime
    import collectives
    from runtime.testing import run_ranks

    async def body(world):
        x = np.ones(max(1, nbytes // 4), np.float32)
        for _ in range(WARMUP):
            await collectives.all_reduce(x, group=world)
            x.fill(1.0)
        await collectives.barrier(group=world)
        return x

    async def main():
        warm, done = [], []
        clock = _Clock()

        async def timed(world):
            x = await body(world)
            warm.append(world.rank)
            if len(warm) == n:  # every rank warm: the last to get here starts the clock
                started.set_result(clock.start())
            await started
            for _ in range(calls):
                x.fill(1.0)
                await collectives.all_reduce(x, group=world)
            done.append(world.rank)
            if len(done) == n:  # the last to finish stops it (before the runtimes close)
                stopped.set_result(clock.per_call(calls))
            if not (x == n).all():
                raise AssertionError(f"rank {world.rank}: all_reduce gave {x[x != n][:4]}, expected {n}")

        loop = asyncio.get_running_loop()
        started, stopped = loop.create_future(), loop.create_future()
        await run_ranks(n, timed, transport="tcp")
        _, cpu, user, system = stopped.result()  # every rank's, one thread: the wall column is the CPU
        return cpu, cpu / n, user / n, system / n

    with mock.patch.dict(os.environ, RINGWEAVE_SHM="0"):
        return runtime.run(main())


def run_ringweave(mode: str, n: int, calls: int, nbytes: int = 4) -> tuple[float, ...]:
    env = dict(os.environ, RINGWEAVE_SHM="0" if mode == "ringweave-tcp" else "1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", str(n), os.path.abspath(__file__),
                          "--worker", "--calls", str(calls), "--size", str(nbytes)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    found = [line.split("FLOOR ", 1)[1].split() for line in res.stdout.splitlines() if "FLOOR " in line]
    if res.returncode or len(found) != n:
        raise SystemExit(f"{mode}: the job failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return _over_ranks([[float(v) for v in f] for f in found])


def default_modes() -> list[str]:
    """Every mode; gloo only where torch is installed (it is not a dependency of the project)."""
    import importlib.util
    return [m for m in MODES if m != "gloo" or importlib.util.find_spec("torch") is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("-n", "--nproc", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000, help="timed calls per mode (default 2000)")
    p.add_argument("--modes", default=",".join(default_modes()),
                   help=f"comma list from {list(MODES)} (default: all; gloo only when torch is installed)")
    p.add_argument("--size", type=parse_size, default=4, help="bytes of the ringweave and gloo modes' array, e.g. 64M (default 4)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        import runtime
        runtime.run(_worker(args.calls, args.size))  # uvloop, as bench/collectives.py runs
        return
    modes = [m for m in args.modes.split(",") if m]
    if args.size != 4 and any(m.startswith("bare") for m in modes):
        raise SystemExit("--size is for the ringweave and gloo modes; the bare ones send a 4 B all_reduce's message only")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    print(f"# {args.size} B float32 sum all_reduce, {args.nproc} ranks, {args.calls} calls back to back, "
          f"{os.cpu_count()} cores")
    print(f"# {'mode':<18} {'wall us/call':>13} {'cpu us/call/rank':>17} {'user':>10} {'system':>10}")
    for mode in modes:
        if mode == "ringweave-inproc":
            wall, cpu, user, system = run_inproc(args.nproc, args.calls, args.size)
        elif mode == "gloo":
            wall, cpu, user, system = run_gloo(args.nproc, args.calls, args.size)
        elif mode.startswith("ringweave"):
            wall, cpu, user, system = run_ringweave(mode, args.nproc, args.calls, args.size)
        else:
            wall, cpu, user, system = run_bare(mode, args.nproc, args.calls)
        print(f"  {mode:<18} {wall * 1e6:13.1f} {cpu * 1e6:17.1f} {user * 1e6:10.1f} {system * 1e6:10.1f}", flush=True)


if __name__ == "__main__":
    main()
