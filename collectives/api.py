"""The public collectives, async, in place on the caller's NumPy arrays (like torch.distributed).

    import collectives as C
    await C.all_reduce(x, op="sum")                 # every rank: x = sum over ranks
    await C.all_gather(out, x)                      # out holds size * x.size elements
    await C.reduce_scatter(out, x, op="sum")        # x holds size * out.size elements
    await C.broadcast(x, src=0)
    await C.reduce(x, dst=0, op="max")
    await C.gather(out, x, dst=0)                   # out only needed on dst
    await C.scatter(out, x, src=0)                  # x only needed on src
    await C.all_to_all(out, x)
    await C.barrier()
    await C.send(x, dst=1, tag=7); await C.recv(x, src=0, tag=7)   # (p2p.py; recv returns the source)
    await C.sendrecv(x, dst, out, src); await C.probe(src, tag); C.iprobe(src, tag)   # (p2p.py)
    await C.scan(x, op="sum"); await C.exscan(x, op="sum")          # prefix reductions (prefix.py)
    await C.monitored_barrier(timeout=30)           # names the ranks that did not arrive (monitor.py)
    sub = await C.split(color, key); mine, every = C.new_subgroups(4)   # new groups (groups.py)

Every call takes ``group`` (default: the world of the calling task's runtime; ``src``, ``dst`` and
``root`` are group ranks), ``timeout`` (seconds, checked first; default ``RINGWEAVE_TIMEOUT_S``)
and ``algorithm`` (a key of ``registry.ALGORITHMS``, the same on every rank; default the table).
Ops, dtypes, the checks made before any message, calls in flight together and the failures: the
contract in docs/design.md, "The contract of a collective".

Not here: the path of a call once dispatched, from these functions to the chosen algorithm
(calls.py), compressed (compressed.py) and device (device.py) collectives, the blocking facade
(blocking.py), point-to-point (p2p.py), counts per rank (uneven.py), Python values (objects.py),
algorithms (algorithms/), selection (registry.py), checks and fingerprints (ops.py).
"""

from __future__ import annotations

import numpy as np

from collectives import calls, compressed, inline_tcp, ops
from collectives.calls import group_of
from collectives.kernels import is_device_array
from collectives.slots import inline
from collectives.groups import new_subgroups, split  # noqa: F401  (part of this module's calls)
from collectives.monitor import monitored_barrier  # noqa: F401
from collectives.p2p import iprobe, probe, recv, send, sendrecv  # noqa: F401
from collectives.prefix import exscan, scan  # noqa: F401
from collectives.tensors import takes_tensors  # torch tensors in place of arrays (collectives/tensors.py)
from runtime.group import check_timeout

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
           "all_to_all", "barrier", "send", "recv", "sendrecv", "probe", "iprobe", "scan", "exscan",
           "monitored_barrier", "split", "new_subgroups"]


def _on_device(a) -> bool:
    """A device array: all_reduce, all_gather, reduce_scatter and broadcast take them (collectives/device.py);
    the other calls want NumPy arrays. A NumPy array is answered without the attribute probe
    (bench/results/runtime.md#the-device-array-probe)."""
    return type(a) is not np.ndarray and is_device_array(a)


def _device():
    """collectives/device.py, imported at the first device array (lazy: it imports numba.cuda, which
    takes seconds and a CUDA driver or the simulator, and a program of NumPy arrays never needs it)."""
    from collectives import device  # lazy: numba.cuda, needed by device arrays only
    return device


@takes_tensors(writes=("x",))
async def all_reduce(x: np.ndarray, op: str = "sum", group=None, timeout: float | None = None,
                     algorithm: str | None = None, compression=None, key=None) -> np.ndarray:
    """Reduces ``x`` over all ranks of the group, in place on every rank; returns ``x``.

    Args:
        x: any shape; C-contiguous, writeable.
        op: ``"sum" | "avg" | "prod" | "min" | "max"``.
        compression: None (exact), or a codec name (``"fp16" | "bf16" | "int8" |
            "topk" | "powersgd"``) or object (``collectives.compress.get_codec(name,
            error_feedback=True, ...)``): float arrays, op sum or avg; how each codec
            is reduced and the error it brings: collectives/compressed.py. With a
            codec, ``algorithm`` names a compressed style (``"shard" | "gather" |
            "ring" | "phases"``). A name makes a fresh codec per call: pass an
            object to keep error-feedback / PowerSGD state between calls.
        key: with a stateful codec, the state stream of this tensor (e.g. a
            bucket index); one codec object serves many tensors by key.

    Example (2 ranks)::

        x = np.array([1, 2], np.float32) + 2 * rank
        # Rank 0: [1. 2.]   Rank 1: [3. 4.]
        await all_reduce(x, op="sum")
        # Rank 0: [4. 6.]   Rank 1: [4. 6.]
    """
    if timeout is not None:
        timeout = check_timeout(timeout)
    if compression is None and type(x) is np.ndarray:  # a loop's small shared-memory calls: slots/inline.py
        rest = inline.all_reduce(x, op, group, timeout, algorithm)
        if rest is None:  # a small TCP one: inline_tcp.py
            rest = inline_tcp.all_reduce(x, op, group, timeout, algorithm)
        if rest is not None:
            if rest is not inline.DONE:
                await rest
            return x
    if _on_device(x):  # collectives/device.py: staged through the host
        return await _device().all_reduce(x, op, group, timeout, algorithm, compression, key)
    if compression is not None:  # collectives/compressed.py
        return await compressed.all_reduce(x, compression, op=op, group=group, timeout=timeout,
                                           algorithm=algorithm, key=key)
    return await calls.all_reduce(x, op, group, timeout, algorithm)


@takes_tensors(writes=("out",), reads=("x",))
async def all_gather(out: np.ndarray, x: np.ndarray, group=None, timeout: float | None = None,
                     algorithm: str | None = None) -> np.ndarray:
    """Gathers every rank's ``x`` into ``out`` on every rank, in rank order; returns ``out``.

    Args:
        out: ``group.size * x.size`` elements (e.g. shape ``(size, *x.shape)``), x's dtype.
        x: any shape; may be ``out``'s block of this rank itself.

    Example (2 ranks)::

        x = np.array([1, 2]) + 2 * rank; out = np.empty(4, x.dtype)
        # Rank 0: x = [1 2]       Rank 1: x = [3 4]
        await all_gather(out, x)
        # Rank 0: out = [1 2 3 4] Rank 1: out = [1 2 3 4]
    """
    timeout = check_timeout(timeout)
    if _on_device(out) or _on_device(x):  # collectives/device.py
        group = group_of(group)
        ops.check_no_overlap("all_gather", "out", out, "x", x, own_block=group.rank)  # pipelined per segment
        return await _device().all_gather(out, x, group, timeout, algorithm)
    return await calls.all_gather(out, x, group, timeout, algorithm)


@takes_tensors(writes=("out",), reads=("x",))
async def reduce_scatter(out: np.ndarray, x: np.ndarray, op: str = "sum", group=None,
                         timeout: float | None = None, algorithm: str | None = None, compression=None,
                         key=None) -> np.ndarray:
    """Reduces ``x`` over all ranks and leaves block ``rank`` of the result in ``out``; returns ``out``.

    ``x`` (not modified) holds ``group.size`` blocks of ``out.size`` elements.

    Args:
        compression: None (exact), or a codec name or object as for ``all_reduce``
            (``"fp16" | "bf16" | "int8" | "topk"``; not powersgd): float arrays, op
            sum or avg; each block is encoded, all_to_all'd and decode-summed on its
            owner (collectives/compressed.py ``reduce_scatter``); there is one
            way, so ``algorithm`` must be None with a codec.
        key: with a stateful codec (error feedback), the state stream of this ``x``.

    Example (2 ranks)::

        x = np.array([1, 2, 3, 4]) * (rank + 1); out = np.empty(2, x.dtype)
        # Rank 0: x = [1 2 3 4]   Rank 1: x = [2 4 6 8]
        await reduce_scatter(out, x, op="sum")
        # Rank 0: out = [3 6]     Rank 1: out = [9 12]
    """
    timeout = check_timeout(timeout)
    if _on_device(out) or _on_device(x):  # collectives/device.py
        ops.check_no_overlap("reduce_scatter", "x", x, "out", out)  # its segments are read and written in turn
        return await _device().reduce_scatter(out, x, op, group, timeout, algorithm, compression, key)
    if compression is None:
        return await calls.reduce_scatter(out, x, op, group, timeout, algorithm)
    group = group_of(group)  # collectives/compressed.py
    calls.check_reduce_scatter(out, x, op, group)
    if algorithm is not None:
        raise ValueError(f"reduce_scatter(compression=...) has one algorithm (all_to_all of encoded blocks); "
                         f"got algorithm={algorithm!r}")
    return await compressed.reduce_scatter(out, x, compression, op=op, group=group, timeout=timeout, key=key)


@takes_tensors(writes=("x",))
async def broadcast(x: np.ndarray, src: int = 0, group=None, timeout: float | None = None,
                    algorithm: str | None = None) -> np.ndarray:
    """Copies ``x`` of group rank ``src`` into ``x`` on every rank; returns ``x``.

    Example (2 ranks)::

        x = np.array([7, 8]) if rank == 0 else np.zeros(2, np.int64)
        # Rank 0: [7 8]   Rank 1: [0 0]
        await broadcast(x, src=0)
        # Rank 0: [7 8]   Rank 1: [7 8]
    """
    timeout = check_timeout(timeout)
    if _on_device(x):  # collectives/device.py
        return await _device().broadcast(x, src, group, timeout, algorithm)
    return await calls.broadcast(x, src, group, timeout, algorithm)


@takes_tensors(writes=("x",))
async def reduce(x: np.ndarray, dst: int = 0, op: str = "sum", group=None, timeout: float | None = None,
                 algorithm: str | None = None) -> np.ndarray:
    """Reduces ``x`` over all ranks into ``x`` of group rank ``dst``; other ranks' ``x`` is unchanged.

    Example (2 ranks)::

        x = np.array([1, 2]) + 2 * rank
        # Rank 0: [1 2]   Rank 1: [3 4]
        await reduce(x, dst=0, op="sum")
        # Rank 0: [4 6]   Rank 1: [3 4]
    """
    return await calls.reduce(x, dst, op, group, check_timeout(timeout), algorithm)


@takes_tensors(writes=("out",), reads=("x",))
async def gather(out: np.ndarray | None, x: np.ndarray, dst: int = 0, group=None, timeout: float | None = None,
                 algorithm: str | None = None) -> np.ndarray | None:
    """Gathers every rank's ``x`` into ``out`` of group rank ``dst``, in rank order; returns ``out``.

    ``out`` (``group.size * x.size`` elements) is needed on ``dst`` only; pass
    None elsewhere (it is ignored there).

    Example (2 ranks)::

        x = np.array([1, 2]) + 2 * rank; out = np.empty(4, x.dtype) if rank == 0 else None
        # Rank 0: x = [1 2]          Rank 1: x = [3 4]
        await gather(out, x, dst=0)
        # Rank 0: out = [1 2 3 4]    Rank 1: (nothing)
    """
    return await calls.gather(out, x, dst, group, check_timeout(timeout), algorithm)


@takes_tensors(writes=("out",), reads=("x",))
async def scatter(out: np.ndarray, x: np.ndarray | None, src: int = 0, group=None, timeout: float | None = None,
                  algorithm: str | None = None) -> np.ndarray:
    """Sends block ``r`` of ``x`` on group rank ``src`` to ``out`` of rank ``r``; returns ``out``.

    ``x`` (``group.size * out.size`` elements) is needed on ``src`` only; pass
    None elsewhere (it is ignored there).

    Example (2 ranks)::

        x = np.array([1, 2, 3, 4]) if rank == 0 else None; out = np.empty(2, np.int64)
        # Rank 0: x = [1 2 3 4]   Rank 1: x = None
        await scatter(out, x, src=0)
        # Rank 0: out = [1 2]     Rank 1: out = [3 4]
    """
    return await calls.scatter(out, x, src, group, check_timeout(timeout), algorithm)


@takes_tensors(writes=("out",), reads=("x",))
async def all_to_all(out: np.ndarray, x: np.ndarray, group=None, timeout: float | None = None,
                     algorithm: str | None = None) -> np.ndarray:
    """Block ``j`` of ``x`` on rank ``r`` goes to block ``r`` of ``out`` on rank ``j``; returns ``out``.

    ``x`` and ``out`` hold ``group.size`` equal blocks (same size, same dtype,
    not overlapping).

    Example (2 ranks)::

        x = np.array([1, 2]) + 2 * rank; out = np.empty(2, x.dtype)
        # Rank 0: x = [1 2]     Rank 1: x = [3 4]
        await all_to_all(out, x)
        # Rank 0: out = [1 3]   Rank 1: out = [2 4]
    """
    return await calls.all_to_all(out, x, group, check_timeout(timeout), algorithm)


async def barrier(group=None, timeout: float | None = None, algorithm: str | None = None) -> None:
    """Returns once every rank of the group has entered the barrier.

    Example (2 ranks)::

        # Rank 0: await barrier()   Rank 1: await asyncio.sleep(1); await barrier()
        # both return after about 1 s
    """
    if timeout is not None:
        timeout = check_timeout(timeout)
    rest = inline.barrier(group, timeout, algorithm)  # a loop's shared-memory barriers: slots/inline.py
    if rest is not None:
        if rest is not inline.DONE:
            await rest
        return
    await calls.barrier(group, timeout, algorithm)
