"""The torch.distributed backend "ringweave": a Python ``ProcessGroup`` over a ringweave group.

Each call turns its tensors into arrays over their memory (``collectives.tensors.as_array``),
starts the collective on the job's loop thread (``Communicator.submit``) and returns a
:class:`Work` at once; the loop completes the work's ``torch.futures.Future`` with the output
tensors (or the collective's exception: ``wait()`` raises it as ringweave raised it). Callbacks
chained on that future (``fut.then``) run on the loop thread: they must not wait on a collective.

Calls: allreduce (sum, avg, product, min, max; coalesced), allgather (lists, into one tensor,
coalesced), reduce_scatter (the same three), broadcast, reduce, gather, scatter, alltoall
(``all_to_all_single``, even or by split sizes, and lists), barrier, send, recv (from a rank or
any). Anything else raises ``NotImplementedError`` naming the call. Deadlines: ringweave's
(``RINGWEAVE_TIMEOUT_S``, ``--timeout-s``), or the ``timeout=`` given to ``init_process_group``
or ``new_group`` where it is not torch's 30-minute default, or a call's own ``timeout``.

Sub-groups: torch makes a group on its members only, while ringweave's ``new_group`` is called
by every rank in one order; :func:`create` keeps the two in step by torch's group names (a count
every rank advances), so ``new_group(..., use_local_synchronization=True)`` is refused.

Not here: the job and torch's store (job.py), the DDP communication hook (hooks.py).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import collectives as C
from collectives.tensors import as_array
from ringweave_torch import job as jobs

__all__ = ["ProcessGroupRingweave", "Work", "create"]

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "prod",
        dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max"}


class Work(dist._Work):
    """A call in flight: ``wait()`` blocks until it is done and raises what it raised (its type
    kept: PeerLostError, CollectiveTimeoutError ...); ``get_future()`` fails with a RuntimeError
    that names it, as torch's C++ side sees it."""

    def __init__(self, done: torch.futures.Future, source=None):
        super().__init__()
        self._done = done  # the output tensors, or the exception
        self._fut = done.then(_unwrap)  # failed where the call failed, for C++ callers (DDP's reducer)
        self._source = source  # recv from any rank: [the sender's group rank], once done

    def wait(self, timeout: timedelta | None = None) -> bool:
        value = self._done.wait()  # the call's own deadline bounds the wait
        if isinstance(value, BaseException):
            raise value
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._done.done()

    def source_rank(self) -> int:
        self.wait()
        return self._source[0]

    _source_rank = source_rank


def _unwrap(done: torch.futures.Future):
    """The value of a call's future, or its exception raised: a future failed for torch's C++
    side. (``Future.set_exception`` would not do: it completes the future with the exception as
    its value, which DDP's reducer would take for the call's tensors.)"""
    value = done.value()
    if isinstance(value, BaseException):
        raise value
    return value


def _op(call: str, opts) -> str:
    op = _OPS.get(opts.reduceOp.op)
    if op is None:
        raise NotImplementedError(f"ringweave {call}: op {opts.reduceOp.op.name} is not supported; "
                                  f"use one of {', '.join(o.name for o in _OPS)}")
    return op


def _one(call: str, tensors) -> None:
    if len(tensors) != 1:
        raise ValueError(f"ringweave {call}: one tensor per rank, got {len(tensors)}")


def _same(call: str, name: str, arrays, x) -> None:
    for i, a in enumerate(arrays):
        if a.dtype != x.dtype or a.size != x.size:
            raise ValueError(f"ringweave {call}: {name}[{i}] is {a.dtype} x {a.size}; every one must be "
                             f"{x.dtype} x {x.size}, as the input")


class ProcessGroupRingweave(dist.ProcessGroup):
    """One torch process group over one ringweave group (the job's world or a sub-group)."""

    def __init__(self, comm: C.Communicator, group, timeout_s: float | None = None):
        super().__init__(group.rank, group.size)
        self._comm = comm
        self._group = group
        self._timeout_s = timeout_s  # None: ringweave's own
        self._name = self._desc = ""

    def getBackendName(self) -> str:
        return "ringweave"

    # torch keeps a group's name and description in its backends, which a Python group has none of
    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def __repr__(self) -> str:
        return f"ProcessGroupRingweave(rank={self._group.rank}, size={self._group.size}, ranks={self._group.ranks})"

    # -- plumbing ----------------------------------------------------------------------------------

    @staticmethod
    def _arr(name: str, t: torch.Tensor, writes: bool = True):
        """``t``'s memory as an array (c10d writes whatever it is given: no autograd check)."""
        return as_array(name, t.detach(), writes=writes)

    def _kw(self, opts=None) -> dict:
        timeout = getattr(opts, "timeout", None)
        if timeout is not None and timeout.total_seconds() > 0:
            return {"group": self._group, "timeout": timeout.total_seconds()}
        return {"group": self._group, "timeout": self._timeout_s}

    def _start(self, body, result, source=None) -> Work:
        """Runs ``await body()`` on the job's loop; its Work's future gets ``result`` or the error."""
        done = torch.futures.Future()

        async def run():
            try:
                await body()
            except BaseException as exc:
                done.set_result(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            done.set_result(result)
        work = Work(done, source)  # before the call can finish: its callbacks are in place
        self._comm.submit(run)
        return work

    # -- reductions --------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None) -> Work:
        op = _op("allreduce", opts or dist.AllreduceOptions())
        arrays = [self._arr(f"tensors[{i}]", t) for i, t in enumerate(tensors)]
        kw = self._kw(opts)

        async def body():
            for a in arrays:
                await C.all_reduce(a, op, **kw)
        return self._start(body, tensors)

    def allreduce_coalesced(self, tensors, opts=None) -> Work:
        return self.allreduce(tensors, opts)

    def compressed_allreduce(self, tensor: torch.Tensor, codec, key=None, op: str = "avg") -> Work:
        """``tensor``'s sum or average over the group through ``codec`` (``collectives.all_reduce(...,
        compression=codec, key=key)``), in place; the work's future holds ``tensor`` (hooks.py)."""
        a, kw = self._arr("tensor", tensor), self._kw()
        return self._start(lambda: C.all_reduce(a, op, compression=codec, key=key, **kw), tensor)

    def reduce(self, tensors, opts) -> Work:
        _one("reduce", tensors)
        a, op, kw = self._arr("tensors[0]", tensors[0]), _op("reduce", opts), self._kw(opts)
        return self._start(lambda: C.reduce(a, dst=opts.rootRank, op=op, **kw), tensors)

    def _reduce_scatter_base(self, output, input, opts=None) -> Work:
        opts = opts or dist.ReduceScatterOptions()
        out, x = self._arr("output", output), self._arr("input", input, writes=False)
        op, kw = _op("reduce_scatter_tensor", opts), self._kw(opts)
        return self._start(lambda: C.reduce_scatter(out, x, op, **kw), [output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> Work:
        opts = opts or dist.ReduceScatterOptions()
        pairs = [(self._arr(f"outputs[{i}]", o), self._arr(f"inputs[{i}]", x, writes=False))
                 for i, (o, x) in enumerate(zip(outputs, inputs, strict=True))]
        op, kw = _op("reduce_scatter_tensor_coalesced", opts), self._kw(opts)

        async def body():
            for out, x in pairs:
                await C.reduce_scatter(out, x, op, **kw)
        return self._start(body, outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None) -> Work:
        opts = opts or dist.ReduceScatterOptions()
        _one("reduce_scatter", output_tensors)
        out = self._arr("output", output_tensors[0])
        blocks = [self._arr(f"input_list[{r}]", t, writes=False) for r, t in enumerate(input_tensors[0])]
        _same("reduce_scatter", "input_list", blocks, out)
        op, kw = _op("reduce_scatter", opts), self._kw(opts)

        async def body():
            x = np.concatenate([b.reshape(-1) for b in blocks]) if blocks else out.reshape(-1)[:0]
            await C.reduce_scatter(out, x, op, **kw)
        return self._start(body, output_tensors)

    # -- gathers and broadcasts --------------------------------------------------------------------

    def _allgather_base(self, output, input, opts=None) -> Work:
        out, x, kw = self._arr("output", output), self._arr("input", input, writes=False), self._kw(opts)
        return self._start(lambda: C.all_gather(out, x, **kw), [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> Work:
        pairs = [(self._arr(f"outputs[{i}]", o), self._arr(f"inputs[{i}]", x, writes=False))
                 for i, (o, x) in enumerate(zip(outputs, inputs, strict=True))]
        kw = self._kw(opts)

        async def body():
            for out, x in pairs:
                await C.all_gather(out, x, **kw)
        return self._start(body, outputs)

    def allgather(self, output_tensors, input_tensors, opts=None) -> Work:
        _one("allgather", input_tensors)
        x = self._arr("tensor", input_tensors[0], writes=False)
        outs = [self._arr(f"tensor_list[{r}]", t) for r, t in enumerate(output_tensors[0])]
        _same("allgather", "tensor_list", outs, x)
        kw = self._kw(opts)

        async def body():
            flat = np.empty(len(outs) * x.size, x.dtype)
            await C.all_gather(flat, x, **kw)
            for r, o in enumerate(outs):  # copy out (gloo does the same)
                o.reshape(-1)[:] = flat[r * x.size:(r + 1) * x.size]
        return self._start(body, output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> Work:
        raise NotImplementedError("ringweave allgather_coalesced (all_gather_coalesced, deprecated by torch) is "
                                  "not supported; use all_gather_into_tensor")

    def broadcast(self, tensors, opts) -> Work:
        _one("broadcast", tensors)
        a, kw = self._arr("tensor", tensors[0]), self._kw(opts)
        return self._start(lambda: C.broadcast(a, src=opts.rootRank, **kw), tensors)

    def gather(self, output_tensors, input_tensors, opts) -> Work:
        _one("gather", input_tensors)
        x, root, kw = self._arr("tensor", input_tensors[0], writes=False), opts.rootRank, self._kw(opts)
        outs = [self._arr(f"gather_list[{r}]", t) for r, t in enumerate(output_tensors[0])] if output_tensors else []
        _same("gather", "gather_list", outs, x)

        async def body():
            flat = np.empty(self._group.size * x.size, x.dtype) if self._group.rank == root else None
            await C.gather(flat, x, dst=root, **kw)
            for r, o in enumerate(outs):
                o.reshape(-1)[:] = flat[r * x.size:(r + 1) * x.size]
        return self._start(body, output_tensors)

    def scatter(self, output_tensors, input_tensors, opts) -> Work:
        _one("scatter", output_tensors)
        out, root, kw = self._arr("tensor", output_tensors[0]), opts.rootRank, self._kw(opts)
        blocks = [self._arr(f"scatter_list[{r}]", t, writes=False) for r, t in enumerate(input_tensors[0])
                  ] if input_tensors else []
        _same("scatter", "scatter_list", blocks, out)

        async def body():
            x = np.concatenate([b.reshape(-1) for b in blocks]) if blocks else None
            await C.scatter(out, x, src=root, **kw)
        return self._start(body, output_tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None) -> Work:
        out, x, kw = self._arr("output", output), self._arr("input", input, writes=False), self._kw(opts)
        if not output_split_sizes and not input_split_sizes:
            return self._start(lambda: C.all_to_all(out, x, **kw), [output])
        send, recv = _counts(input, input_split_sizes, self.size()), _counts(output, output_split_sizes, self.size())
        return self._start(lambda: C.all_to_all_v(out.reshape(-1), x.reshape(-1), send, recv, **kw), [output])

    def alltoall(self, output_tensors, input_tensors, opts=None) -> Work:
        outs = [self._arr(f"output_tensor_list[{r}]", t) for r, t in enumerate(output_tensors)]
        ins = [self._arr(f"input_tensor_list[{r}]", t, writes=False) for r, t in enumerate(input_tensors)]
        kw = self._kw(opts)

        async def body():
            flat = np.empty(sum(o.size for o in outs), outs[0].dtype if outs else np.float32)
            x = np.concatenate([i.reshape(-1) for i in ins]) if ins else flat[:0]
            await C.all_to_all_v(flat, x, [i.size for i in ins], [o.size for o in outs], **kw)
            at = 0
            for o in outs:
                o.reshape(-1)[:] = flat[at:at + o.size]
                at += o.size
        return self._start(body, output_tensors)

    # torch's names for the same calls (older names above, which C++ callers may still use)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def barrier(self, opts=None) -> Work:
        kw = self._kw(opts)
        return self._start(lambda: C.barrier(**kw), [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        raise NotImplementedError("ringweave monitored_barrier is not supported (Gloo's alone); barrier() names "
                                  "the missing ranks when it times out")

    # -- point to point ----------------------------------------------------------------------------

    def send(self, tensors, dstRank: int, tag: int) -> Work:
        _one("send", tensors)
        a, kw = self._arr("tensor", tensors[0], writes=False), self._kw()
        return self._start(lambda: C.send(a, dst=dstRank, tag=tag, **kw), tensors)

    def recv(self, tensors, srcRank: int, tag: int) -> Work:
        _one("recv", tensors)
        a, kw = self._arr("tensor", tensors[0]), self._kw()
        return self._start(lambda: C.recv(a, src=srcRank, tag=tag, **kw), tensors, [srcRank])

    def recv_anysource(self, tensors, tag: int) -> Work:
        _one("recv", tensors)
        a, kw, source = self._arr("tensor", tensors[0]), self._kw(), [None]

        async def body():
            source[0] = await C.recv(a, src=None, tag=tag, **kw)
        return self._start(body, tensors, source)


def _counts(t: torch.Tensor, splits, size: int) -> list[int]:
    """Elements per rank of a tensor split along dim 0 by ``splits`` (empty: evenly)."""
    row = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0
    if not splits:
        if t.dim() == 0 or t.shape[0] % size:
            raise ValueError(f"ringweave all_to_all_single: {t.shape[0] if t.dim() else 0} rows do not split evenly "
                             f"over {size} ranks; pass split sizes")
        return [t.numel() // size] * size
    return [int(s) * row for s in splits]


def create(opts: dist.DistributedBackendOptions, backend_options=None) -> ProcessGroupRingweave:
    """torch's constructor of the backend (``register_backend(..., extended_api=True)``): the
    default group is the job's world; a sub-group is made on the job's runtime (see module doc).
    torch's store (``opts.store``) is not used: the job's ranks meet through the job's store."""
    ranks = list(opts.global_ranks_in_group)  # [] for the default group
    comm = jobs.formed() or _form_job(None if ranks else opts.group_rank, None if ranks else opts.group_size)
    given = opts.timeout
    timeout_s = None if given is None or given == dist.constants.default_pg_timeout else given.total_seconds()
    if ranks:
        return ProcessGroupRingweave(comm, jobs.subgroup(comm, ranks, opts.group_id), timeout_s)
    if opts.group_size != comm.world_size or opts.group_rank != comm.rank:
        raise RuntimeError(f"torch says rank {opts.group_rank} of {opts.group_size}, the ringweave job rank "
                           f"{comm.rank} of {comm.world_size}: start both from the same environment")
    jobs.align(comm)
    return ProcessGroupRingweave(comm, comm.world, timeout_s)


def _form_job(rank: int | None, world_size: int | None) -> C.Communicator:
    """The job, formed here because torch met through a store of its own (``tcp://``, ``file://``,
    ``store=``, ``env://`` outside our launcher); a failure says how to start instead."""
    try:
        return jobs.job(rank, world_size)
    except Exception as exc:
        raise RuntimeError(f"ringweave: forming the job failed ({type(exc).__name__}: {exc}). The ringweave backend "
                           f"forms its job itself (runtime.init): start the ranks with `python -m runtime.launch -n N "
                           f"script.py`, or, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand, pass "
                           f"init_method=\"ringweave://\" (rank 0 then hosts ringweave's store at MASTER_PORT, where "
                           f"torch's own would clash); torchrun is not supported") from exc
