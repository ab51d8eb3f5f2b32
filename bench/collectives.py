"""Collective benchmark, nccl-tests style: time, algbw and busbw per size, op and algorithm,
optionally beside torch.distributed's Gloo backend and OpenMPI (mpi4py) measured in the same run.

    python bench/collectives.py -n 4                                 # every op, 4 B .. 64 MiB in x4 steps
    python bench/collectives.py -n 4 --compare gloo                  # + Gloo column, ratio, comparison
    python bench/collectives.py -n 4 --compare mpi                   # + OpenMPI (shared memory), under mpirun
    python bench/collectives.py -n 4 --compare gloo,mpi --mpi-btl tcp
    python bench/collectives.py -n 2 --ops all_reduce --sizes 4,4096,1M --algorithm all --iters 50
    python bench/collectives.py -n 2 --algorithm all --tune off  # the built-in table's choice as default (*)
    python bench/collectives.py -n 4 --device cuda --compare gloo --ops all_reduce --sizes 4K,1M,16M,64M

Launch. Without RANK in the environment the script re-launches itself through the project's
launcher (``python -m runtime.launch -n N bench/collectives.py ...``). With ``--compare mpi`` it
re-launches itself under ``mpirun --allow-run-as-root --oversubscribe --bind-to none -n N`` instead,
with MASTER_ADDR / MASTER_PORT exported: MPI_Init needs mpirun's processes, and ringweave's
``runtime.init`` reads OMPI_COMM_WORLD_RANK / SIZE (rank 0 then hosts the store, docs/design.md
"Starting a job"). Either way every library runs in the SAME processes, so rows can interleave.

Peers. ``--compare gloo``: each rank also joins torch.distributed (Gloo) through its own torch
TCPStore on a fresh port (rank 0 publishes the port in ringweave's store). Same processes rather
than a second launch, because the machine is shared and noisy (2 cores, 4 ranks, other jobs):
measuring both in alternation, iteration by iteration, makes the ratio compare like with like.
Gloo and MPI calls block the event loop while they run; nothing of ringweave is in flight then.

Method, per (op, size):
1. validation, not timed: every variant (each ringweave algorithm, Gloo, MPI) runs once from a fresh
   input and its output is compared, exactly, with a closed-form answer (rank r contributes small
   integers r + i % 3, so sums are n(n-1)/2 + n (i % 3) -- no second implementation). A wrong answer
   stops the run naming the op, size, variant, rank and first wrong index.
2. ``--warmup`` rounds, not timed, then ``--iters`` timed rounds (at least ``--small-iters`` in rows of
   at most 64 KiB). Each round runs every variant once,
   in turn; each timed call is ``barrier; t0; call; t1; barrier`` with that library's own barrier
   (OSU style), and in-place inputs are reset before the first barrier (not timed). ``--block K``
   runs K iterations of one variant before the next variant's (default 1). ringweave's calls
   run slower right after Gloo's (bench/results/small_calls.md#after-the-peers-calls), so K > 1
   shows a library closer to warm; K = 1 is the default, and the figures in bench/results use it.
   ``--shuffle`` runs each round's variants in a new order (the same on every rank): the call before
   decides which rank the next barrier lets out first, and in a fixed order a variant can be timed
   mostly in one of them (at 2 ranks flat and the tree, the same message, came out 0.75-2.11x apart
   in one order, 0.89-1.35x shuffled: bench/results/broadcast.md). Off by default, as bench/results
   were taken.
3. every rank keeps each timed call's t0 and t1 (time.perf_counter), and an iteration has two times:
   ``call`` = the slowest rank's own t1 - t0 (each rank's clock starts when the barrier lets it out,
   so a rank let out early is charged its wait for the others), and ``last`` = max t1 - max t0 over
   the ranks, from the last rank's entry to the last rank's exit (<= call; only where every rank
   reads one clock, the same boot_id: one host, network namespaces included; else absent, with a
   note). ``--timing`` picks the figure of the printed rows, the comparison and ``time_us`` (default
   call, as bench/results were taken); the JSON has both (``time_call_us``, ``time_last_us``, their
   ``min_``; a peer's ``ratio_call``, ``ratio_last``). A row shows the median (and min) over the
   iterations. algbw = size / time, busbw = algbw x the nccl-tests factor (all_reduce 2(n-1)/n;
   all_gather, reduce_scatter, all_to_all, gather, scatter (n-1)/n; broadcast, reduce 1).
   "noise" is the widest interquartile range / median among the row's variants.

Sizes are nccl-tests' "size": the whole array for all_reduce / broadcast / reduce, the gathered
output for all_gather / gather, the input for reduce_scatter / scatter, one buffer for all_to_all.
Those ops need n equal blocks, so a size below n elements rounds up to one element per rank
(the row shows the bytes actually moved). barrier gets one row (size 0). Roots are rank 0.

Ratios: "x gloo" = Gloo's median time / ringweave's, per row; > 1 means ringweave is faster (for
one size that is also the busbw ratio). The comparison summary uses the rows of the algorithm
the default table picks (what a user gets): per op and peer, the smallest and the median ratio.

Output (rank 0): one line per row as it is measured, then the comparison; JSON to ``--json``
(default ``--out-dir``/collectives.json; without ``--out-dir``, the current directory) and a PNG of
busbw against size to ``--plot`` (collectives.png beside it; skipped with a message when matplotlib is
missing); both paths are printed. The memory
reference, printed before the comparison, is a one-core NumPy copy of 64 MiB (bytes copied per second),
measured by rank 0 while the others wait, and all ranks copying at once (sum of their rates). It is
measured after the rows: measured first, it slowed the rows that followed it.

Not here: point-to-point (bench/p2p.py), kernels alone (bench/kernels.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

# This file is named like the package it measures: run as a script, its own folder is sys.path[0]
# and ``import collectives`` would import this file. Put the repository root there instead.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (HERE, ROOT)]

from bench.common import (TIMED, TIMINGS, MiB, Table, busbw_factor, clock_id, copy_bandwidth, fmt_bytes,  # noqa: E402
                          gbps, iteration_times, out_path, parse_sizes, plot_busbw, shuffled, stamps, stats,
                          write_json)

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
       "barrier"]
REDUCING = {"all_reduce", "reduce_scatter", "reduce"}
ROOTED = {"broadcast", "reduce", "gather", "scatter"}
BLOCKED = {"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"}  # size = n blocks
DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8"]
ROOT_RANK = 0
SMALL_ROW = 64 << 10  # --small-iters: rows of at most this many bytes
# Deadlines of the peers' waits, so that a peer that cannot be reached is an error, not a hang
PEER_JOIN_TIMEOUT_S = 60     # Gloo: joining its TCPStore and its rendezvous
PEER_CALL_TIMEOUT_S = 600    # Gloo: one collective (64 MiB over a 100 Mbit/s link takes seconds)


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# --- one (op, size): buffers and the closed-form answer ----------------------------------------

def pattern(first, count: int) -> np.ndarray:
    """int64 ``first + i % 3`` for i in 0..count-1 (``first`` a scalar or per-element array)."""
    return first + np.arange(count, dtype=np.int64) % 3


@dataclass
class Case:
    """The buffers of one rank for one (op, size) and what they must hold after the call.

    ``x``: the input (also the output of in-place ops); ``out``: the output of out-of-place ops
    (None where the op has none on this rank); ``x0``: the pristine input that in-place ops
    restore before every call; ``expect_x`` / ``expect_out``: the closed-form answer.
    """
    op: str
    nbytes: int          # nccl-tests size of the row, e.g. 67108864
    block: int           # elements per rank block (BLOCKED ops) or of the whole array
    x: np.ndarray | None
    out: np.ndarray | None
    x0: np.ndarray | None
    expect_x: np.ndarray | None
    expect_out: np.ndarray | None
    registry_nbytes: int  # what collectives/api.py passes to the selection table, e.g. 16777216

    def reset(self) -> None:
        if self.x0 is not None:
            np.copyto(self.x, self.x0)

    def poison(self) -> None:
        """Before validation: outputs hold a value no correct answer contains."""
        if self.out is not None:
            self.out.fill(np.array(117, self.out.dtype) if self.out.dtype.kind in "iu" else np.nan)
        self.reset()


def make_case(op: str, size: int, dtype: np.dtype, n: int, rank: int) -> Case:
    """Buffers and answers of ``rank`` for ``op`` at nccl-tests ``size`` bytes on ``n`` ranks."""
    item = dtype.itemsize
    if op == "barrier":
        return Case(op, 0, 0, None, None, None, None, None, 0)
    if op in BLOCKED:
        block = 0 if size == 0 else max(1, size // item // n)
        total = n * block
    else:
        block = total = 0 if size == 0 else max(1, size // item)
    i_total = np.arange(total, dtype=np.int64)
    root = rank == ROOT_RANK

    def cast(a):  # int64 -> dtype; integers wrap as the dtype does
        return np.asarray(a, np.int64).astype(dtype)

    def summed(idx):  # sum over ranks r of (r + idx % 3)
        return n * (n - 1) // 2 + n * (idx % 3)

    def concat(first_of_block):  # n blocks, block j = pattern(first_of_block(j), block)
        return np.concatenate([pattern(first_of_block(j), block) for j in range(n)])

    if op == "all_reduce":
        x0 = cast(pattern(rank, total))
        return Case(op, total * item, total, x0.copy(), None, x0, cast(summed(i_total)), None, total * item)
    if op == "broadcast":
        x0 = cast(pattern(1, total)) if root else np.zeros(total, dtype)
        return Case(op, total * item, total, x0.copy(), None, x0, cast(pattern(1, total)), None, total * item)
    if op == "reduce":
        x0 = cast(pattern(rank, total))
        want = cast(summed(i_total)) if root else x0
        return Case(op, total * item, total, x0.copy(), None, x0, want, None, total * item)
    if op == "all_gather":
        x = cast(pattern(rank, block))
        return Case(op, total * item, block, x, np.empty(total, dtype), None, None, cast(concat(lambda j: j)),
                    block * item)
    if op == "reduce_scatter":
        x = cast(pattern(rank, total))
        want = cast(summed(rank * block + np.arange(block, dtype=np.int64)))
        return Case(op, total * item, block, x, np.empty(block, dtype), None, None, want, total * item)
    if op == "all_to_all":
        x = cast(concat(lambda j: (rank * n + j) % 97))    # block j goes to rank j
        want = cast(concat(lambda j: (j * n + rank) % 97))  # block j came from rank j
        return Case(op, total * item, block, x, np.empty(total, dtype), None, None, want, total * item)
    if op == "gather":
        x = cast(pattern(rank, block))
        out = np.empty(total, dtype) if root else None
        return Case(op, total * item, block, x, out, None, None, cast(concat(lambda j: j)) if root else None,
                    block * item)
    if op == "scatter":
        x = cast(concat(lambda j: j)) if root else None
        return Case(op, total * item, block, x, np.empty(block, dtype), None, None, cast(pattern(rank, block)),
                    block * item)
    raise ValueError(f"unknown op {op!r}; choose from {OPS}")


def check(case: Case, lib, who: str, rank: int) -> None:
    """Raises AssertionError naming the first wrong element if the buffers miss the answer."""
    for name, got, want in (("x", case.x, case.expect_x), ("out", case.out, case.expect_out)):
        if want is None:
            continue
        if case.op == "reduce" and rank != ROOT_RANK and not lib.reduce_keeps_input:
            continue  # the library documents x on non-root ranks as scratch after reduce
        same = np.array_equal(got.view(np.uint8), want.view(np.uint8)) if got.dtype == want.dtype else False
        if not same:
            bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))
            i = int(bad[0]) if bad.size else -1
            raise AssertionError(f"validation failed: {case.op} {fmt_bytes(case.nbytes)} via {who} on rank {rank}: "
                                 f"{name}[{i}] = {got[i] if i >= 0 else '?'}, expected "
                                 f"{want[i] if i >= 0 else '?'} ({bad.size} of {want.size} wrong)")


# --- the libraries: each runs one call of a Case, and its own barrier ---------------------------

class Ringweave:
    label = "ringweave"
    is_async = True
    reduce_keeps_input = True   # api.reduce: "other ranks' x is unchanged"

    def __init__(self, rt):
        from collectives import api, registry
        self.C, self.registry, self.rt, self.n = api, registry, rt, rt.world.size

    def algorithms(self, op: str) -> list[str]:
        return sorted(self.registry.ALGORITHMS[op])

    def default_algorithm(self, op: str, nbytes: int) -> str:
        return self.registry.choose(op, nbytes, self.n, group=self.rt.world)[0]

    def unsupported(self, op: str, dtype: np.dtype) -> str | None:
        return None

    async def barrier(self) -> None:
        await self.C.barrier()

    def caller(self, case: Case, algorithm: str | None):
        C, op, a = self.C, case.op, algorithm
        x, out = case.x, case.out
        calls = {
            "all_reduce": lambda: C.all_reduce(x, op="sum", algorithm=a),
            "all_gather": lambda: C.all_gather(out, x, algorithm=a),
            "reduce_scatter": lambda: C.reduce_scatter(out, x, op="sum", algorithm=a),
            "broadcast": lambda: C.broadcast(x, src=ROOT_RANK, algorithm=a),
            "reduce": lambda: C.reduce(x, dst=ROOT_RANK, op="sum", algorithm=a),
            "gather": lambda: C.gather(out, x, dst=ROOT_RANK, algorithm=a),
            "scatter": lambda: C.scatter(out, x, src=ROOT_RANK, algorithm=a),
            "all_to_all": lambda: C.all_to_all(out, x, algorithm=a),
            "barrier": lambda: C.barrier(algorithm=a),
        }
        return calls[op]


class Gloo:
    """torch.distributed with the Gloo backend, in this process, through its own TCPStore."""
    label = "gloo"
    is_async = False
    reduce_keeps_input = False  # Gloo's reduce leaves partial sums in non-root tensors (torch: only dst's is defined)

    def __init__(self, torch, dist, rank: int, n: int):
        self.torch, self.dist, self.rank, self.n = torch, dist, rank, n
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    @classmethod
    async def join(cls, rt) -> "Gloo":
        """Joins Gloo through a TCPStore on rank 0, dialled at the address where ringweave's
        own store is (MASTER_ADDR, or what the launcher implies): rank 0's host, which ranks
        on other hosts reach (127.0.0.1 would only serve ranks of rank 0's host)."""
        import torch
        import torch.distributed as dist
        from runtime.init import read_env
        rank, n = rt.rank, rt.world_size
        key = "bench/collectives/gloo_store"
        join = timedelta(seconds=PEER_JOIN_TIMEOUT_S)
        if rank == 0:
            host = read_env()["master_addr"] or "127.0.0.1"
            gloo_interface(host)
            store = dist.TCPStore(host, 0, n, is_master=True, wait_for_workers=False, timeout=join)
            await rt.store.set(key, f"{host} {store.port}".encode())
        else:
            host, port = (await rt.store.get(key, timeout_s=PEER_JOIN_TIMEOUT_S)).decode().split()
            gloo_interface(host)
            store = dist.TCPStore(host, int(port), n, is_master=False, timeout=join)
        # every rank has read the address before anyone blocks in Gloo's rendezvous: under mpirun
        # rank 0's event loop serves ringweave's store and must not be blocked while others read.
        from collectives import api
        await api.barrier()
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n,
                                timeout=timedelta(seconds=PEER_CALL_TIMEOUT_S))
        self = cls(torch, dist, rank, n)
        self.store = store
        return self

    def close(self) -> None:
        self.dist.destroy_process_group()

    def unsupported(self, op: str, dtype: np.dtype) -> str | None:
        return None

    def barrier(self) -> None:
        self.dist.barrier()

    def tensor(self, a: np.ndarray | None):
        """A torch tensor sharing ``a``'s memory (bfloat16 through a uint16 view)."""
        if a is None:
            return None
        if a.dtype.name == "bfloat16":
            return self.torch.from_numpy(a.view(np.uint16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)

    def caller(self, case: Case, algorithm=None):
        d, op = self.dist, case.op
        tx, tout = self.tensor(case.x), self.tensor(case.out)
        root = self.rank == ROOT_RANK
        blocks = lambda t: list(t.chunk(self.n)) if t is not None and t.numel() else \
            [t.new_empty(0) for _ in range(self.n)]  # noqa: E731
        calls = {
            "all_reduce": lambda: d.all_reduce(tx),
            "all_gather": lambda: self.all_gather(tout, tx),
            "reduce_scatter": lambda: self.reduce_scatter(tout, tx),
            "broadcast": lambda: d.broadcast(tx, src=ROOT_RANK),
            "reduce": lambda: d.reduce(tx, dst=ROOT_RANK),
            "all_to_all": lambda: d.all_to_all_single(tout, tx),
            "barrier": lambda: d.barrier(),
        }
        if op == "gather":
            out_list = blocks(tout) if root else None
            calls["gather"] = lambda: d.gather(tx, gather_list=out_list, dst=ROOT_RANK)
        if op == "scatter":
            in_list = blocks(tx) if root else None
            calls["scatter"] = lambda: d.scatter(tout, scatter_list=in_list, src=ROOT_RANK)
        return calls[op]


def gloo_interface(master: str) -> None:
    """Across hosts, Gloo's pairs on the interface that routes to ``master`` (GLOO_SOCKET_IFNAME,
    unless set): by default Gloo binds to the address of the host's name, and where that name does
    not resolve (an emulated host) it falls back to loopback, which no other host reaches."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or master.startswith("127.") or master == "localhost":
        return
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master), 9))  # no packet is sent for UDP connect
        mine = socket.inet_aton(s.getsockname()[0])
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                addr = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:
                continue
            if addr == mine:
                os.environ["GLOO_SOCKET_IFNAME"] = name
                return


class Mpi:
    """mpi4py's buffer interface (upper-case methods) on COMM_WORLD; needs an mpirun launch."""
    is_async = False
    reduce_keeps_input = True   # MPI_Reduce reads sendbuf only
    TYPES = {"float32": "FLOAT", "float64": "DOUBLE", "int8": "INT8_T", "int32": "INT32_T", "int64": "INT64_T",
             "uint8": "UINT8_T"}

    def __init__(self, btl: str):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.n = self.comm.Get_rank(), self.comm.Get_size()
        self.label = f"mpi-{btl}"
        self.version = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip().rstrip(",")

    def unsupported(self, op: str, dtype: np.dtype) -> str | None:
        if op in REDUCING and dtype.name not in self.TYPES:
            return f"MPI has no {dtype.name} reduction"
        return None

    def barrier(self) -> None:
        self.comm.Barrier()

    def caller(self, case: Case, algorithm=None):
        MPI, c, op = self.MPI, self.comm, case.op
        if op == "barrier":
            return c.Barrier
        if op in REDUCING:  # typed buffers, MPI.SUM
            t = getattr(MPI, self.TYPES[case.x.dtype.name])
            buf = lambda a: [a, t] if a is not None else None  # noqa: E731
        else:               # data movement only: bytes, which also covers float16 / bfloat16
            buf = lambda a: [a.view(np.uint8), MPI.BYTE] if a is not None else None  # noqa: E731
        x, out = buf(case.x), buf(case.out)
        root = self.rank == ROOT_RANK
        calls = {
            "all_reduce": lambda: c.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
            "all_gather": lambda: c.Allgather(x, out),
            "reduce_scatter": lambda: c.Reduce_scatter_block(x, out, MPI.SUM),
            "broadcast": lambda: c.Bcast(x, root=ROOT_RANK),
            "reduce": (lambda: c.Reduce(MPI.IN_PLACE, x, MPI.SUM, root=ROOT_RANK)) if root else
                      (lambda: c.Reduce(x, None, MPI.SUM, root=ROOT_RANK)),
            "gather": lambda: c.Gather(x, out, root=ROOT_RANK),
            "scatter": lambda: c.Scatter(x, out, root=ROOT_RANK),
            "all_to_all": lambda: c.Alltoall(x, out),
        }
        return calls[op]


@dataclass
class Variant:
    """One column of a row: a library (and for ringweave, an algorithm)."""
    lib: object
    algorithm: str | None   # the name passed (ringweave), None = the library's own choice
    shown: str              # the algorithm as printed, e.g. "ring", "default=ring", "-"
    fn: object = None
    stamps: list = field(default_factory=list)  # (t0, t1) of each timed call on this rank


class Ticker:
    """A task that asks the event loop for a turn every millisecond, as a user's own task would (a
    heartbeat, a progress bar, a data loader feeding the next batch): the largest gap between two of
    its turns while ringweave's calls run (``busy``, barriers included: they are collectives too), and
    with nothing running (``idle``, :meth:`idle_for`), the same machine's floor for that gap; and the
    CPU time the loop's thread used between two of its turns while busy (``cpu``): what the calls held
    the loop for, which other jobs taking the cores do not lengthen (a wall-clock gap counts the time
    the process waited for a core too; a wait that sleeps in the kernel holds the loop without using
    the CPU, so it shows in the wall-clock gap only). Gloo's and MPI's calls block the loop by design
    and are left out (the ticker neither counts nor idles)."""

    PERIOD_S = 0.001

    def __init__(self):
        self.last = time.perf_counter()
        self.last_cpu = time.thread_time()  # the loop's thread (this one)
        self.state = None  # "busy" | "idle" | None (not counted)
        self.gaps = {"busy": 0.0, "idle": 0.0, "cpu": 0.0}
        self.task = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.PERIOD_S)
            self._tick()

    def _tick(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if self.state is not None:
            self.gaps[self.state] = max(self.gaps[self.state], now - self.last)
            if self.state == "busy":
                self.gaps["cpu"] = max(self.gaps["cpu"], cpu - self.last_cpu)
        self.last, self.last_cpu = now, cpu

    def begin(self, state: str) -> None:
        self.last = time.perf_counter()  # the gap counts from here (a peer's call may have held the loop)
        self.last_cpu = time.thread_time()
        self.state = state

    def end(self) -> None:
        self._tick()  # the gap still open (a call that never let the ticker run counts whole)
        self.state = None

    async def idle_for(self, seconds: float) -> None:
        self.begin("idle")
        await asyncio.sleep(seconds)
        self.end()

    def take(self) -> tuple[float, float, float]:
        """(busy, idle, cpu) largest gaps in seconds since the last take."""
        out = self.gaps["busy"], self.gaps["idle"], self.gaps["cpu"]
        self.gaps = {"busy": 0.0, "idle": 0.0, "cpu": 0.0}
        return out


async def timed_call(v: Variant, case: Case, record: bool, ticker: Ticker | None = None) -> None:
    """``reset; barrier; t0; call; t1; barrier`` with the library's own barrier."""
    case.reset()
    lib = v.lib
    if lib.is_async:
        if ticker is not None:
            ticker.begin("busy")
        await lib.barrier()
        t0 = time.perf_counter()
        await v.fn()
        t1 = time.perf_counter()
        await lib.barrier()
        if ticker is not None:
            ticker.end()
    else:
        lib.barrier()
        t0 = time.perf_counter()
        v.fn()
        t1 = time.perf_counter()
        lib.barrier()
    if record:
        v.stamps.append((t0, t1))


# --- the run -----------------------------------------------------------------------------------

def ringweave_variants(rw: Ringweave, op: str, case: Case, choice: str, notes: set) -> list[Variant]:
    """The ringweave columns of a row: every algorithm (``all``), the table's choice, or a name."""
    default = rw.default_algorithm(op, case.registry_nbytes)
    if choice == "all":
        return [Variant(rw, a, a + ("*" if a == default else "")) for a in rw.algorithms(op)]
    if choice != "default":
        if choice in rw.algorithms(op):
            return [Variant(rw, choice, choice + ("*" if choice == default else ""))]
        if op not in notes:
            notes.add(op)
            print(f"# {op} has no algorithm {choice!r} (has {rw.algorithms(op)}); its rows use the default")
    return [Variant(rw, None, default + "*")]


def _both(f: dict) -> dict:
    """``time_<timing>_us`` and ``min_<timing>_us`` of both timings (None where absent)."""
    out = {}
    for k in TIMINGS:
        out[f"time_{k}_us"] = None if f[k] is None else f[k]["median_s"] * 1e6
        out[f"min_{k}_us"] = None if f[k] is None else f[k]["min_s"] * 1e6
    return out


def _ratio(theirs: dict | None, ours: dict | None) -> float | None:
    if theirs is None or ours is None:
        return None
    return theirs["median_s"] / ours["median_s"] if ours["median_s"] > 0 else float("nan")


def row_record(n: int, dtype: np.dtype, case: Case, v: Variant, times: dict, peers: dict, timing: str,
               gaps: tuple[float, float, float] | None = None) -> dict:
    """One row of the JSON: ringweave's figures, each peer's under its label, the noise
    (``copy_fraction`` is filled in at the end, once the memory reference is measured).
    ``times``: per-iteration seconds by timing (:func:`bench.common.iteration_times`), the peers'
    the same under their labels; ``timing``: the one ``time_us``, the bandwidths and ``ratio`` use."""
    f = {k: None if t is None else stats(t) for k, t in times.items()}
    s = f[timing]
    factor = busbw_factor(case.op, n)
    rec = {"op": case.op, "algorithm": v.shown.rstrip("*"), "default": v.shown.endswith("*"),
           "bytes": case.nbytes, "count": case.block, "dtype": dtype.name, "world": n,
           "time_us": s["median_s"] * 1e6, "min_us": s["min_s"] * 1e6, "p25_us": s["p25_s"] * 1e6,
           "p75_us": s["p75_s"] * 1e6, "iters": s["n"], **_both(f),
           "algbw_gbps": gbps(case.nbytes, s["median_s"]),
           "busbw_gbps": gbps(case.nbytes, s["median_s"]) * factor, "copy_fraction": None,
           "tick_gap_ms": None if gaps is None else gaps[0] * 1e3,
           "idle_gap_ms": None if gaps is None else gaps[1] * 1e3,
           "tick_cpu_ms": None if gaps is None else gaps[2] * 1e3}
    spread = [(s["p75_s"] - s["p25_s"]) / s["median_s"] if s["median_s"] > 0 else 0.0]
    for label, (ptimes, why) in peers.items():
        if why:
            rec[label] = {"unsupported": why}
            continue
        pf = {k: None if t is None else stats(t) for k, t in ptimes.items()}
        p = pf[timing]
        spread.append((p["p75_s"] - p["p25_s"]) / p["median_s"] if p["median_s"] > 0 else 0.0)
        rec[label] = {"time_us": p["median_s"] * 1e6, "min_us": p["min_s"] * 1e6, "p25_us": p["p25_s"] * 1e6,
                      "p75_us": p["p75_s"] * 1e6, **_both(pf), "busbw_gbps": gbps(case.nbytes, p["median_s"]) * factor,
                      "ratio": _ratio(p, s), **{f"ratio_{k}": _ratio(pf[k], f[k]) for k in TIMINGS}}
    rec["noise"] = max(spread)
    return rec


def make_table(peer_labels: list[str]) -> Table:
    us = lambda v: f"{v:.1f}" if v < 1e4 else f"{v:.0f}"  # noqa: E731
    cols = [("bytes", "size(B)", 10, "d"), ("count", "count", 9, "d"), ("dtype", "type", 8, "s"),
            ("op", "op", 14, "s"), ("algorithm_shown", "algorithm", 20, "s"), ("time_us", "time(us)", 9, us),
            ("min_us", "min(us)", 9, us), ("algbw_gbps", "algbw", 7, ".3f"), ("busbw_gbps", "busbw", 7, ".3f")]
    for label in peer_labels:
        cols += [(f"{label}.time_us", f"{label}(us)", max(9, len(label) + 4), us),
                 (f"{label}.busbw_gbps", "busbw", 7, ".3f"), (f"{label}.ratio", f"x{label}", 7, ".2f")]
    cols += [("tick_gap_ms", "tick(ms)", 8, ".1f"), ("idle_gap_ms", "idle(ms)", 8, ".1f"),
             ("tick_cpu_ms", "cpu(ms)", 7, ".1f"),
             ("noise_pct", "noise%", 6, ".0f"), ("ok", "check", 5, "s")]
    return Table(cols)


def flat_row(rec: dict, shown: str) -> dict:
    flat = dict(rec, algorithm_shown=shown, noise_pct=100 * rec["noise"], ok="ok")
    for k, v in rec.items():
        if isinstance(v, dict):
            if "unsupported" in v:
                flat[f"{k}.time_us"] = None
            for kk, vv in v.items():
                flat[f"{k}.{kk}"] = vv
    return flat


async def max_over_ranks(times: np.ndarray) -> np.ndarray:
    """Per-iteration figures -> their maximum over the ranks, on every rank (through ringweave, untimed)."""
    from collectives import api
    await api.all_reduce(times, op="max")
    return times


async def one_clock(n: int) -> str | None:
    """None where every rank's t0 and t1 read one clock (the same :func:`bench.common.clock_id`),
    else why not (then ``last`` is absent)."""
    mine = clock_id()
    ids = np.array([-1.0, 1.0]) if mine is None else np.array([mine, -mine], np.float64)
    if n > 1:
        await max_over_ranks(ids)  # [max id, -min id]
    if ids[0] == -ids[1] and ids[0] >= 0:
        return None
    return ("the ranks do not share one clock (their boot_id differs, is unreadable, or perf_counter is not "
            "CLOCK_MONOTONIC)")


async def memory_reference(rt) -> dict:
    """One-core copy bandwidth (rank 0 alone) and all ranks copying at once (sum of rates)."""
    from collectives import api
    await api.barrier()
    one = copy_bandwidth() if rt.rank == 0 else {"nbytes": 0, "median_gbps": 0.0, "best_gbps": 0.0}
    await api.barrier()
    mine = copy_bandwidth()
    figures = np.array([one["nbytes"], one["median_gbps"], one["best_gbps"], mine["median_gbps"]], np.float64)
    await api.all_reduce(figures, op="sum")  # rank 0's one-core figures reach every rank; rates add up
    return {"one_core": {"nbytes": int(figures[0]), "median_gbps": float(figures[1]), "best_gbps": float(figures[2])},
            "all_ranks_gbps": float(figures[3])}


async def rank_main(args) -> None:
    import runtime
    mpi = None
    if "mpi" in args.compare:
        mpi = Mpi(args.mpi_btl)  # MPI_Init before ringweave: mpirun's ranks are ours too
    rt = await runtime.init()
    n, rank = rt.world_size, rt.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = np_dtype(args.dtype)
    rw = Ringweave(rt)
    gloo = await Gloo.join(rt) if "gloo" in args.compare else None
    peers = [p for p in (gloo, mpi) if p is not None]
    from collectives import api
    from runtime import env
    shm_given = env.SHM.given()  # None: unset
    clock_note = await one_clock(n)
    timing = "call" if clock_note else args.timing  # last needs one clock

    meta = {"world": n, "dtype": dtype.name, "iters": args.iters, "small_iters": args.small_iters,
            "warmup": args.warmup, "block": args.block, "shuffle": args.shuffle, "timing": timing,
            "last": f"absent: {clock_note}" if clock_note else "recorded (every rank on one clock: the same boot_id)",
            "algorithm": args.algorithm, "host": platform.node(), "cores": os.cpu_count(),
            "python": platform.python_version(), "loop": type(asyncio.get_running_loop()).__module__,
            "RINGWEAVE_SHM": "(unset)" if shm_given is None else str(int(shm_given)), "launch": args.launched_by,
            "tune_rules": tuned_rules(n, rt.world),
            "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv), "memory": None,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if gloo:
        meta["torch"] = gloo.torch.__version__
    if mpi:
        meta["mpi"] = mpi.version
        meta["mpi_btl"] = args.mpi_btl
    say(f"# ringweave bench/collectives: {n} ranks ({meta['launch']}), {dtype.name}, {args.iters} iters "
        f"(+{args.warmup} warm-up), loop {meta['loop']}, RINGWEAVE_SHM={meta['RINGWEAVE_SHM']}, "
        f"{meta['cores']} cores")
    say(f"# tuning rules: {meta['tune_rules']}")
    if peers:
        say("# peers in the same processes: " + ", ".join(
            f"{p.label} ({meta['torch'] if p is gloo else meta['mpi']})" for p in peers))
    if clock_note:
        say(f"# last timing absent: {clock_note}" + ("; --timing last falls back to call" if args.timing == "last"
                                                       else ""))
    say(f"# time = median over iterations of {TIMED[timing]} (timing {timing}); ratio x<peer> = peer time / "
        "ringweave time (>1: ringweave faster); * = the default choice (the tuning rules above, else the table)")
    ticker = None
    if not args.no_ticker:
        ticker = Ticker()
        ticker.task = asyncio.get_running_loop().create_task(ticker.run())
        say("# tick(ms) = the largest gap between the turns of a 1 ms ticker task in each rank's event loop "
            "while the row's ringweave calls ran (slowest rank); idle(ms) = the same with nothing running, "
            "just after the row; cpu(ms) = the most CPU time the loop's thread used between two of those turns "
            "(not lengthened by other jobs; a wait asleep in the kernel is not in it)")
    table = make_table([p.label for p in peers])
    if rank == 0:
        table.header()

    # Before the first row: the first seconds after start-up ran slow for every library, so every
    # library runs a few hundred untimed small calls first (bench/results/harness.md#warm-up-rounds).
    rows, notes = [], set()
    if args.warmup_rounds > 0:
        case = make_case("all_reduce", 4, dtype, n, rank)
        warm = ringweave_variants(rw, "all_reduce", case, "default", set())
        warm += [Variant(p, None, "-") for p in peers if not p.unsupported("all_reduce", dtype)]
        for v in warm:
            v.fn = v.lib.caller(case, v.algorithm)
        for _ in range(args.warmup_rounds):
            for v in warm:
                await timed_call(v, case, record=False)
    for op in args.ops:
        measured = set()
        for size in ([0] if op == "barrier" else args.sizes):
            case = make_case(op, size, dtype, n, rank)
            if case.nbytes in measured:
                continue  # e.g. all_gather 4 B and 16 B on 4 ranks are both one element per rank
            measured.add(case.nbytes)
            variants = ringweave_variants(rw, op, case, args.algorithm, notes)
            skipped = {}
            for p in peers:
                why = p.unsupported(op, dtype)
                if why:
                    skipped[p.label] = why
                else:
                    variants.append(Variant(p, None, "-"))
            for v in variants:  # 1. validate every variant from a poisoned output
                v.fn = v.lib.caller(case, v.algorithm)
                case.poison()
                await timed_call(v, case, record=False)
                check(case, v.lib, f"{v.lib.label} {v.shown}", rank)
            total = args.warmup + (max(args.iters, args.small_iters) if case.nbytes <= SMALL_ROW else args.iters)
            gaps = np.zeros((len(variants), 3))  # per variant: largest ticker gap busy, idle, busy CPU (s)
            for start in range(0, total, args.block):  # 2. rounds of every variant in turn
                k = len(variants)  # --shuffle: an order per round, the same on every rank
                for i in (shuffled(k, OPS.index(op), case.nbytes, start) if args.shuffle else range(k)):
                    v = variants[i]  # --block calls of one variant, then the next one's
                    for it in range(start, min(start + args.block, total)):
                        await timed_call(v, case, record=it >= args.warmup, ticker=ticker)
                    if ticker is not None:
                        busy, _, cpu = ticker.take()
                        gaps[i, 0], gaps[i, 2] = max(gaps[i, 0], busy), max(gaps[i, 2], cpu)
            if ticker is not None:  # the floor: as long as the row's ringweave calls took (50 ms .. 0.5 s)
                ours_s = sum(t1 - t0 for v in variants if v.lib is rw for t0, t1 in v.stamps)
                await ticker.idle_for(min(0.5, max(0.05, ours_s)))
                gaps[:, 1] = ticker.take()[1]
            t = np.array([v.stamps for v in variants], np.float64)  # (variants, iters, t0 / t1)
            every = np.concatenate([stamps(t[..., 0], t[..., 1]), gaps], axis=1)
            every = (await max_over_ranks(every)) if n > 1 else every
            times = [iteration_times(e, clock_note is None) for e in every[:, :-3]]
            gaps = every[:, -3:]
            if rank != 0:
                continue
            ours = [(v, times[i], gaps[i]) for i, v in enumerate(variants) if v.lib is rw]
            theirs = {v.lib.label: (times[i], None) for i, v in enumerate(variants) if v.lib is not rw}
            theirs.update({label: (None, why) for label, why in skipped.items()})
            for v, vtimes, gap in ours:
                rec = row_record(n, dtype, case, v, vtimes, theirs, timing, None if ticker is None else tuple(gap))
                rows.append(rec)
                table.row(flat_row(rec, v.shown))
    if ticker is not None:
        ticker.task.cancel()
        try:
            await ticker.task
        except asyncio.CancelledError:
            pass
    if gloo:
        await api.barrier()
        gloo.close()

    # The memory reference comes last: measured first, its 2 x 64 MiB per rank, allocated and
    # freed, slowed the rows right after it (bench/results/harness.md#memory-reference-last).
    membw = await memory_reference(rt)
    meta["memory"] = membw
    if rank == 0:
        one = membw["one_core"]
        print(f"# memory reference (measured after the rows): NumPy copy of {fmt_bytes(one['nbytes'])}, one core: "
              f"{one['median_gbps']:.2f} GB/s median (best {one['best_gbps']:.2f}); {n} ranks at once: "
              f"{membw['all_ranks_gbps']:.2f} GB/s together")
        for rec in rows:
            rec["copy_fraction"] = rec["busbw_gbps"] / one["median_gbps"] if one["median_gbps"] else None
        summary = comparison(rows, [p.label for p in peers], membw, n, timing)
        for line in summary["lines"]:
            print(line)
        write_json(args.json, {"meta": meta, "rows": rows, "summary": summary})
        print(f"# json: {args.json}")
        if args.plot:
            print("# " + plot(args.plot, rows, [p.label for p in peers], meta))
    await runtime.shutdown()
    if mpi is not None:
        mpi.comm.Barrier()


# --- the comparison and the plot -----------------------------------------------------------------

def comparison(rows: list[dict], peers: list[str], membw: dict, n: int, timing: str = "call") -> dict:
    """Ratios to each peer over the default-algorithm rows (what a user gets), per op: lines to
    print and the figures (of the rows' ``timing``). No targets: the reader judges the comparison."""
    d = [r for r in rows if r["default"]]
    lines = ["#", (f"# comparison (rows of the default algorithm, timing {timing}; ratio = peer time / ringweave "
                   "time, >1: ringweave faster; for one size it is also the busbw ratio)")]
    out = {"lines": lines, "comparisons": []}
    shm_rows = sorted({r["algorithm"] for r in d if r["algorithm"] in ("shm", "hierarchical")})
    used = f"ringweave used {'/'.join(shm_rows)}, shared memory" if shm_rows else "ringweave over TCP"
    for peer in peers:
        lines.append(f"# vs {peer} (this run: {used}):")
        for op in dict.fromkeys(r["op"] for r in d):
            sel = [r for r in d if r["op"] == op and "ratio" in r.get(peer, {})]
            if not sel:
                continue
            ratios = [r[peer]["ratio"] for r in sel]
            worst = min(sel, key=lambda r: r[peer]["ratio"])
            each = " ".join(f"{fmt_bytes(r['bytes']).replace(' ', '')}:{r[peer]['ratio']:.2f}" for r in sel)
            lines.append(f"#   {op:<15s} min {worst[peer]['ratio']:5.2f}x at {fmt_bytes(worst['bytes']):>7s}  "
                         f"median {float(np.median(ratios)):5.2f}x   [{each}]")
            out["comparisons"].append({"peer": peer, "op": op, "min_ratio": worst[peer]["ratio"],
                                       "median_ratio": float(np.median(ratios)),
                                       "ratios": {r["bytes"]: r[peer]["ratio"] for r in sel}})
    lines.append(f"# absolute ({used}):")
    tiny = [r for r in d if r["op"] == "all_reduce" and 0 < r["bytes"] <= 8]
    if tiny:
        t = tiny[0]
        lines.append(f"#   all_reduce {fmt_bytes(t['bytes'])}: {t['time_us']:.1f} us")
        out["all_reduce_small_us"] = t["time_us"]
    big = [r for r in d if r["op"] == "all_reduce" and r["bytes"] >= MiB]
    if big and membw.get("one_core"):
        b = max(big, key=lambda r: r["bytes"])
        ref = membw["one_core"]["median_gbps"]
        lines.append(f"#   all_reduce {fmt_bytes(b['bytes'])} busbw {b['busbw_gbps']:.3f} GB/s = "
                     f"{100 * b['busbw_gbps'] / ref:.1f}% of a one-core copy ({ref:.2f} GB/s), "
                     f"{100 * b['busbw_gbps'] / membw['all_ranks_gbps']:.1f}% of {n} ranks copying at once "
                     f"({membw['all_ranks_gbps']:.2f} GB/s)")
        out["membw_fraction"] = b["busbw_gbps"] / ref
    ticked = [r for r in rows if r.get("tick_gap_ms") is not None]
    if ticked:  # every row's tick, whatever its algorithm: the loop's worst gap beside its floor
        worst = max(ticked, key=lambda r: r["tick_gap_ms"] - (r["idle_gap_ms"] or 0.0))
        top = max(ticked, key=lambda r: r["tick_gap_ms"])
        beyond = worst["tick_gap_ms"] - (worst["idle_gap_ms"] or 0.0)
        lines.append(f"#   loop: largest tick {top['tick_gap_ms']:.1f} ms ({top['op']} {fmt_bytes(top['bytes'])} "
                     f"{top['algorithm']}); largest beyond its idle {beyond:.1f} ms "
                     f"({worst['op']} {fmt_bytes(worst['bytes'])} {worst['algorithm']}, idle "
                     f"{worst['idle_gap_ms']:.1f} ms); {len(ticked)} of {len(rows)} rows ticked")
        held = max(ticked, key=lambda r: r["tick_cpu_ms"] or 0.0)
        lines.append(f"#   loop: most CPU between two turns {held['tick_cpu_ms']:.1f} ms ({held['op']} "
                     f"{fmt_bytes(held['bytes'])} {held['algorithm']})")
        out["loop"] = {"tick_max_ms": top["tick_gap_ms"], "beyond_idle_max_ms": beyond,
                       "cpu_max_ms": held["tick_cpu_ms"]}
    barrier = [r for r in d if r["op"] == "barrier"]
    if barrier:
        b = barrier[0]
        extra = "".join(f", {p} {b[p]['time_us']:.1f} us" for p in peers if "time_us" in b.get(p, {}))
        lines.append(f"#   barrier: ringweave {b['time_us']:.1f} us{extra}")
    return out


def plot(path: str, rows: list[dict], peers: list[str], meta: dict) -> str:
    series: dict = {}
    peer_seen: set = set()
    for r in rows:
        if r["op"] == "barrier":
            continue
        lines = series.setdefault(r["op"], {})
        lines.setdefault(f"ringweave {r['algorithm']}", []).append((r["bytes"], r["busbw_gbps"]))
        for p in peers:
            key = (r["op"], r["bytes"], p)
            if "busbw_gbps" in r.get(p, {}) and key not in peer_seen:
                peer_seen.add(key)
                lines.setdefault(p, []).append((r["bytes"], r[p]["busbw_gbps"]))
    title = (f"ringweave collectives, {meta['world']} ranks, {meta['dtype']}, {meta['host']} "
             f"({meta['started']}); median of {meta['iters']} (timing {meta['timing']})")
    return plot_busbw(path, series, title, meta["memory"]["one_core"]["median_gbps"])


# --- command line and re-launch ----------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc", type=int, default=4, help="ranks to launch (default 4)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list from {OPS} (default all)")
    p.add_argument("--sizes", default="4:64M:4",
                   help="a,b,c (e.g. 4,4096,1M) or lo:hi[:factor] (default 4:64M:4; 4:64M for every power of 2)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--algorithm", default="default", help="an algorithm name, 'default' (the table) or 'all'")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per row (default 20)")
    p.add_argument("--small-iters", type=int, default=0, metavar="N",
                   help="at least N timed iterations in the rows of at most 64 KiB, where a call takes tens "
                        "of microseconds and a few iterations cannot rank the algorithms (default 0: --iters)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per row (default 3)")
    p.add_argument("--timing", default="call", choices=TIMINGS,
                   help="an iteration's time in the rows, the comparison and time_us: call, the slowest rank's "
                        "own t1 - t0 (default), or last, max t1 - max t0 over the ranks (from the last rank's "
                        "entry to the last one's exit; needs one clock, else call); the JSON has both")
    p.add_argument("--block", type=int, default=1,
                   help="iterations of one variant in a row before the next variant's (default 1: alternate every call)")
    p.add_argument("--shuffle", action="store_true",
                   help="each round's variants in a new order, the same on every rank (default: one order every "
                        "round), so that no variant is always timed after the same one")
    p.add_argument("--warmup-rounds", type=int, default=500,
                   help="untimed rounds of a 4 B all_reduce of every library before the first row (default 500)")
    p.add_argument("--compare", default="", help="gloo, mpi or gloo,mpi: peers measured in the same processes")
    p.add_argument("--mpi-btl", default="sm", choices=["sm", "tcp"],
                   help="OpenMPI transport for --compare mpi: sm (btl self,vader) or tcp (btl self,tcp)")
    p.add_argument("--shm", default="env", choices=["env", "on", "off"],
                   help="ringweave's same-host shared-memory path: off sets RINGWEAVE_SHM=0 (the TCP path), "
                        "on sets it to 1, env (default) leaves the environment alone")
    p.add_argument("--tune", default="env", choices=["env", "on", "off"],
                   help="the rules file of python -m collectives.tune: off sets RINGWEAVE_TUNE=0 (the built-in table), "
                        "on RINGWEAVE_TUNE=1; env leaves it as it is")
    p.add_argument("--out-dir", default=None,
                   help="directory for collectives.json and collectives.png (default: the current directory)")
    p.add_argument("--json", default=None, help="JSON path (default: OUT_DIR/collectives.json)")
    p.add_argument("--plot", default=None, help="PNG path (default: OUT_DIR/collectives.png); '' for none")
    p.add_argument("--no-uvloop", action="store_true", help="plain asyncio event loop")
    p.add_argument("--no-ticker", action="store_true",
                   help="leave out the 1 ms ticker task (the tick(ms) and idle(ms) columns)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: device arrays (numba, CuPy) against Gloo on torch CUDA tensors (bench/device.py); "
                        "refuses to run without a GPU")
    p.add_argument("--launched-by", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.json = args.json or out_path(args.out_dir, "collectives.json")
    args.plot = out_path(args.out_dir, "collectives.png") if args.plot is None else args.plot
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"--ops: unknown {bad}; choose from {OPS}")
    try:
        args.sizes = parse_sizes(args.sizes)
    except ValueError as e:
        p.error(f"--sizes: {e}")
    args.compare = [c.strip() for c in args.compare.split(",") if c.strip()]
    bad = [c for c in args.compare if c not in ("gloo", "mpi")]
    if bad:
        p.error(f"--compare: unknown {bad}; choose gloo and/or mpi")
    if args.iters < 1 or args.small_iters < 0 or args.warmup < 0 or args.nproc < 1 or args.block < 1:
        p.error("need --iters >= 1, --warmup >= 0, --block >= 1, -n >= 1")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relaunch(args, argv: list[str]) -> int:
    """Starts the ranks: the project's launcher, or mpirun when MPI is compared."""
    me = os.path.abspath(__file__)
    if "gloo" in args.compare:
        try:
            import torch.distributed  # noqa: F401
        except ImportError as e:
            print(f"--compare gloo needs torch ({e}); pip install torch", file=sys.stderr)
            return 2
    if "mpi" not in args.compare:
        cmd = [sys.executable, "-m", "runtime.launch", "-n", str(args.nproc), me, *argv,
               "--launched-by", "runtime.launch"]
        return subprocess.call(cmd, cwd=os.getcwd(), env=dict(os.environ, PYTHONPATH=_pythonpath()))
    mpirun = shutil.which("mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError as e:
        mpirun, why = None, f"mpi4py is not importable ({e}); pip install mpi4py"
    else:
        why = "mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)"
    if mpirun is None:
        print(f"--compare mpi: {why}", file=sys.stderr)
        return 2
    return subprocess.call(mpirun_command(mpirun, args.nproc, args.mpi_btl, argv), cwd=os.getcwd())


def mpirun_command(mpirun: str, nproc: int, mpi_btl: str, argv: list[str], *, master_addr: str = "127.0.0.1",
                   master_port: int | None = None, hosts: list[str] | None = None, agent: str | None = None,
                   subnet: str | None = None, timeout_s: int | None = None, label: str = "") -> list[str]:
    """mpirun starting this script on ``nproc`` ranks. On one machine by default; across hosts
    with ``hosts`` (``ADDR:SLOTS`` each, rank 0 on the first, where ``master_addr`` is), the
    daemons started through ``agent`` (Open MPI's plm_rsh_agent, in place of ssh) and every
    connection of MPI's own (tcp btl, out-of-band) on ``subnet`` (CIDR): shared memory can only
    join ranks of one host, so ``mpi_btl`` sm means vader within a host and tcp between hosts.
    ``timeout_s``: mpirun ends the job past it (a hang of MPI's is an error)."""
    btl = {"sm": "self,vader", "tcp": "self,tcp"}[mpi_btl]
    if hosts and mpi_btl == "sm":
        btl += ",tcp"
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port or free_port()), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads,
           "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(nproc),
           "--mca", "btl", btl]
    if hosts:
        cmd += ["--host", ",".join(hosts), "--mca", "plm_rsh_agent", agent,
                "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet]
    if timeout_s:
        cmd += ["--timeout", str(timeout_s)]
    for k, v in env.items():
        cmd += ["-x", f"{k}={os.environ.get(k, v) if k.endswith('THREADS') else v}"]
    for k in os.environ:
        if k.startswith("RINGWEAVE_"):
            cmd += ["-x", k]
    by = f"mpirun (btl {btl})"
    return cmd + [sys.executable, os.path.abspath(__file__), *argv, "--launched-by", f"{label}, {by}" if label else by]


def tuned_rules(n: int, group) -> str:
    """The rules file the default algorithm comes from, or why none (collectives/tunefile.py)."""
    from collectives import registry, tunefile
    from runtime import env
    if not env.TUNE.get():
        return "off (RINGWEAVE_TUNE=0)"
    nodes = group.topology.nodes
    rules = tunefile.rules_for(n, len(nodes), max(len(node) for node in nodes), registry.ALGORITHMS)
    return rules.path if rules is not None else "none for this machine and layout (the built-in table)"


def _pythonpath() -> str:
    return os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.shm != "env":
        os.environ["RINGWEAVE_SHM"] = "0" if args.shm == "off" else "1"  # inherited by every rank
    if args.tune != "env":
        os.environ["RINGWEAVE_TUNE"] = "0" if args.tune == "off" else "1"
    if args.device == "cuda":
        from bench import device
        problem = device.gpu_problem()
        if problem:
            print(f"--device cuda: {problem}", file=sys.stderr)
            raise SystemExit(2)
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        raise SystemExit(relaunch(args, argv))
    if args.device == "cuda":
        from bench import device
        device.run(args)
        return
    if args.no_uvloop:
        asyncio.run(rank_main(args))
        return
    try:
        import uvloop
    except ImportError:
        asyncio.run(rank_main(args))
    else:
        uvloop.run(rank_main(args))


if __name__ == "__main__":
    main()
