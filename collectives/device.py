"""Collectives on device arrays: numba device arrays, CuPy arrays, torch CUDA tensors, anything
with ``__cuda_array_interface__`` (bfloat16: ``collectives.kernels.cuda.as_bfloat16(words)``).

The transport moves host bytes, so a device collective stages through page-locked host buffers
(device_pool.py: kept across calls, bounded by bytes) and reduces on the device. Two ways:

* **staged whole**, when the larger array is at most ``RINGWEAVE_DEVICE_HOST_REDUCE_KIB`` (256 KiB)
  or ``algorithm=`` is named: one copy down, the host collective (the registry's choice, shared
  memory included), one copy up (bench/results/device.md says why the limit is where it is);
* **pipelined**, in segments of ``RINGWEAVE_DEVICE_SEGMENT_KIB``, each on a stream of its own, up to
  ``DEPTH`` in flight: all_reduce is, per segment, D2H, all_to_all (every rank gets every copy of
  its block), a fold on the device in rank order (``kernels.cuda.fold_into``), D2H, all_gather,
  H2D: a ring all_reduce's wire bytes. reduce_scatter is its first half, all_gather the second,
  broadcast one network step per segment. Sub-calls are opened in order before the first wait, on
  the TCP table's algorithms (as compressed.py's).

Streams: a call first waits for all work queued on the device (``cuda.synchronize()``), runs its
copies and kernels on streams of its own, and returns when they are done, so the result may be read
on any stream at once (like a Gloo collective on CUDA tensors followed by ``wait()``); it takes no
``stream=``. ``all_reduce(compression=...)`` in the shard style encodes, decodes and decode-sums on
the device with the codecs' CUDA kernels and stages only payloads; the other styles stage the array.
The stages, a worked example and the stream rules in full: docs/design.md, "Device arrays". The
simulator (NUMBA_ENABLE_CUDASIM=1) runs all of it on the CPU (tests/compressed/gpu_device_cases.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
from numba import cuda

from collectives import calls, compressed, ops
from collectives.compress import cuda as ccuda
from collectives.compress.wire import pack_all, split, unpack
from collectives.calls import group_of, open_call
from collectives.device_pool import DEVICE, PINNED
from collectives.kernels import cuda as kcuda
from collectives.kernels import is_device_array
from runtime import env

__all__ = ["DEPTH", "all_gather", "all_reduce", "broadcast", "is_device_array", "reduce_scatter", "segments"]

DEPTH = 3  # segments in flight: one copying down, one on the network, one copying up and folding


# ---- arrays and segments --------------------------------------------------------------------------


def _flat(name: str, a):
    """(1-D numba device array of ``a``'s storage, logical dtype), checked."""
    try:
        flat, dtype = kcuda.storage(a)
    except ValueError as e:
        raise ValueError(f"{name} must be a C-contiguous device array ({e})") from None
    if dtype not in ops.DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; supported: {', '.join(ops.DTYPE_NAMES)}")
    return flat, dtype


def _flat_pair(out, x):
    """(out, x, their dtype) for a call that writes device ``out`` from device ``x``: both flat,
    checked, of one dtype."""
    od, dtype = _flat("out", out)
    xd, xdtype = _flat("x", x)
    if xdtype != dtype:
        raise TypeError(f"out has dtype {dtype} but x has {xdtype}; they must match")
    return od, xd, dtype


def segments(n: int, itemsize: int, world: int, segment_bytes: int | None = None) -> list[tuple[int, int]]:
    """[lo, hi) element ranges that cut ``n`` elements into pipelined segments: each
    ``segment_bytes`` (``RINGWEAVE_DEVICE_SEGMENT_KIB``) rounded down to a multiple of ``world``
    elements, at least ``world``; one empty segment for n == 0 (the calls still run, so a rank
    whose length differs gets a mismatch error rather than a hang)."""
    segment_bytes = env.device_segment_bytes() if segment_bytes is None else segment_bytes
    step = max(world, segment_bytes // itemsize // world * world)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)] or [(0, 0)]


@dataclasses.dataclass
class _Slot:
    """What one segment in flight holds: a stream, two host buffers, device scratch (raw bytes)."""

    stream: object
    a: np.ndarray
    b: np.ndarray
    d: object


class _Slots:
    """``depth`` slots for a call's segments, each sized for the largest; taken in segment order."""

    def __init__(self, depth: int, host_bytes: int, device_bytes: int):
        self.all = [_Slot(cuda.stream(), PINNED.take(host_bytes), PINNED.take(host_bytes),
                          DEVICE.take(device_bytes) if device_bytes else None) for _ in range(depth)]  # fmt: skip
        self.free: asyncio.Queue = asyncio.Queue()
        for slot in self.all:
            self.free.put_nowait(slot)

    def release(self) -> None:
        for slot in self.all:
            PINNED.give(slot.a, slot.b)
            if slot.d is not None:
                DEVICE.give(slot.d)


async def _wait(stream) -> None:
    """Until ``stream``'s queued work is done, without holding the event loop: a worker thread
    waits, in the caller's device context (numba's contexts are per thread)."""
    if kcuda.SIMULATOR:  # the simulator ran it all already
        return
    device_id = cuda.get_current_device().id

    def synchronize():
        with cuda.gpus[device_id]:
            stream.synchronize()

    await asyncio.to_thread(synchronize)


def _host(buf: np.ndarray, count: int, dtype) -> np.ndarray:
    """The first ``count`` elements of raw host bytes ``buf`` as ``dtype``."""
    dtype = np.dtype(dtype)
    return buf[:count * dtype.itemsize].view(dtype)


def _dev(buf, count: int, dtype):
    return buf[:count * np.dtype(dtype).itemsize].view(dtype)


async def _pipeline(segs, slots: _Slots, step) -> None:
    """Runs ``step(index, slot)`` for every segment, each holding a slot while it runs (at most
    ``len(slots.all)`` at once, in segment order); the first error cancels the rest."""

    async def one(i):
        slot = await slots.free.get()
        try:
            await step(i, slot)
        finally:
            slots.free.put_nowait(slot)

    try:
        async with asyncio.TaskGroup() as tg:
            for i in range(len(segs)):
                tg.create_task(one(i))
    except BaseExceptionGroup as group_error:  # the caller gets the typed error, as from any collective
        first = group_error
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    finally:
        for slot in slots.all:  # nothing of ours is left queued when the buffers go back
            slot.stream.synchronize()
        slots.release()


def _open(group, collective: str, nbytes: int, algorithm, timeout, nsegs: int, **fp):
    """A segment's sub-call: the registry's choice (``algorithm`` honoured) when the call has one
    segment, else the table's without shared memory (calls of a pipeline run out of the order they
    were opened: ``registry.choose(subcall=True)``)."""
    if nsegs == 1:
        return open_call(group, collective, nbytes, algorithm, timeout, **fp)
    return open_call(group, collective, nbytes, None, timeout, subcall=True, **fp)


def _whole(collective: str, op, n: int) -> str:
    """What a segment's sub-call carries of the whole call in its fingerprint (the ``op`` field):
    ranks whose collective, op or length differ then fail with a mismatch, even where their
    segments happen to agree (37 and 38 elements over 3 ranks are both 3 blocks of 13)."""
    return f"device-{collective}:{op or '-'}:n={n}"


def _stage_whole(algorithm, nbytes: int) -> bool:
    """True: the call goes through the host whole (module docstring); every rank decides alike."""
    return algorithm is not None or nbytes <= env.device_host_reduce_bytes()


def _storage_dtype(dtype) -> np.dtype:
    return np.dtype(np.uint16) if dtype in kcuda.reference.HALF_DTYPES else np.dtype(dtype)


# ---- all_reduce ----------------------------------------------------------------------------------


async def all_reduce(x, op: str = "sum", group=None, timeout=None, algorithm=None, compression=None, key=None):
    """See the module docstring; ``x`` a device array, in place; returns ``x``."""
    xd, dtype = _flat("x", x)
    ops.check_op(op)
    group = group_of(group)
    cuda.synchronize()  # the caller's work on every stream is done (module docstring)
    if compression is not None:
        await _compressed_all_reduce(x, xd, dtype, op, group, timeout, algorithm, compression, key)
        return x
    if _stage_whole(algorithm, dtype.itemsize * xd.size):
        await _staged_all_reduce(xd, dtype, op, group, timeout, algorithm)
        return x
    W, n, sdt = group.size, xd.size, _storage_dtype(dtype)
    segs = segments(n, dtype.itemsize, W)
    blocks = [-(-(hi - lo) // W) for lo, hi in segs]
    whole = _whole("all_reduce", op, n)
    opened = []
    for block in blocks:  # every sequence number before the first wait
        a2a = open_call(group, "all_to_all", W * block * dtype.itemsize, None, timeout, subcall=True,
                        dtype=dtype, count=W * block, op=whole)
        ag = open_call(group, "all_gather", block * dtype.itemsize, None, timeout, subcall=True, dtype=dtype,
                       count=block, op=whole)
        opened.append((a2a, ag))
    kop, divisor = ops.kernel_op(op), (W if op == "avg" else 0)
    most = max(blocks) * dtype.itemsize
    slots = _Slots(min(DEPTH, len(segs)), W * most, (W + 1) * most)

    async def step(i, slot):
        (lo, hi), block, ((a2a_call, a2a), (ag_call, ag)) = segs[i], blocks[i], opened[i]
        s, m = slot.stream, hi - lo
        send = _host(slot.a, W * block, sdt)
        if m:
            xd[lo:hi].copy_to_host(send[:m], stream=s)  # D2H
        send[m:] = 0  # padding: reduced, then dropped
        await _wait(s)
        recv = _host(slot.b, W * block, sdt)
        await group.run(a2a_call, a2a, recv.view(dtype), send.view(dtype))  # recv block j: rank j's of mine
        scratch = _dev(slot.d, (W + 1) * block, sdt)
        blocks_d, mine_d = scratch[:W * block], scratch[W * block:]
        if block:
            blocks_d.copy_to_device(recv, stream=s)  # H2D, then the fold on the same stream
            kcuda.fold_into(mine_d, blocks_d, W, kop, divisor, logical_dtype=dtype, stream=s, sync=False)
            mine_d.copy_to_host(send[:block], stream=s)  # D2H of my reduced block
        await _wait(s)
        await group.run(ag_call, ag, recv.view(dtype), send[:block].view(dtype))  # every rank's reduced block
        if m:
            xd[lo:hi].copy_to_device(recv[:m], stream=s)  # H2D; waited for before the slot is reused
        await _wait(s)

    await _pipeline(segs, slots, step)
    return x


async def _staged_all_reduce(xd, dtype, op, group, timeout, algorithm, compression=None, key=None) -> None:
    """The whole array down, the host all_reduce, back up (small arrays, ``algorithm=``, or a
    compressed style with no device path)."""
    n = xd.size
    buf = PINNED.take(n * dtype.itemsize)
    try:
        staged = _host(buf, n, _storage_dtype(dtype))
        if n:
            xd.copy_to_host(staged)
        if compression is None:
            await calls.all_reduce(staged.view(dtype), op, group, timeout, algorithm)
        else:
            await compressed.all_reduce(staged.view(dtype), compression, op=op, group=group, timeout=timeout,
                                        algorithm=algorithm, key=key)
        if n:
            xd.copy_to_device(staged)
    finally:
        PINNED.give(buf)


# ---- reduce_scatter, all_gather, broadcast --------------------------------------------------------


async def reduce_scatter(out, x, op: str = "sum", group=None, timeout=None, algorithm=None, compression=None,
                         key=None):
    """``out`` (device) = block ``rank`` of the reduction of every rank's device ``x`` (W blocks of
    ``out.size``); see api.reduce_scatter. The fold writes into ``out`` on the device."""
    od, xd, dtype = _flat_pair(out, x)
    ops.check_op(op)
    group = group_of(group)
    W, m, sdt = group.size, od.size, _storage_dtype(dtype)
    if xd.size != W * m:
        raise ValueError(f"x has {xd.size} elements, expected group size {W} x out.size {m} = {W * m}")
    cuda.synchronize()
    if compression is not None:  # on the host, whole
        await _staged(xd, od, dtype, lambda hx, ho: _compressed_reduce_scatter(ho, hx, op, group, timeout,
                                                                              compression, key))
        return out
    if _stage_whole(algorithm, xd.size * dtype.itemsize):
        await _staged(xd, od, dtype, lambda hx, ho: calls.reduce_scatter(ho, hx, op, group, timeout, algorithm))
        return out
    segs = segments(m, W * dtype.itemsize, 1)
    opened = [open_call(group, "all_to_all", W * (hi - lo) * dtype.itemsize, None, timeout, subcall=True, dtype=dtype,
                        count=W * (hi - lo), op=_whole("reduce_scatter", op, m)) for lo, hi in segs]
    kop, divisor = ops.kernel_op(op), (W if op == "avg" else 0)
    most = max(hi - lo for lo, hi in segs) * dtype.itemsize
    slots = _Slots(min(DEPTH, len(segs)), W * most, W * most)

    async def step(i, slot):
        (lo, hi), (call, a2a) = segs[i], opened[i]
        s, c = slot.stream, hi - lo
        send, recv = _host(slot.a, W * c, sdt), _host(slot.b, W * c, sdt)
        for j in range(W if c else 0):  # D2H: my copy of every rank's block, this segment of it
            xd[j * m + lo:j * m + hi].copy_to_host(send[j * c:(j + 1) * c], stream=s)
        await _wait(s)
        await group.run(call, a2a, recv.view(dtype), send.view(dtype))  # every rank's copy of my block
        if c:
            blocks_d = _dev(slot.d, W * c, sdt)
            blocks_d.copy_to_device(recv, stream=s)
            kcuda.fold_into(od[lo:hi], blocks_d, W, kop, divisor, logical_dtype=dtype, stream=s, sync=False)
        await _wait(s)

    await _pipeline(segs, slots, step)
    return out


async def all_gather(out, x, group=None, timeout=None, algorithm=None):
    """Device ``out`` (W x x.size elements) gets every rank's device ``x``, in rank order."""
    od, xd, dtype = _flat_pair(out, x)
    group = group_of(group)
    W, n, sdt = group.size, xd.size, _storage_dtype(dtype)
    if od.size != W * n:
        raise ValueError(f"out has {od.size} elements, expected group size {W} x x.size {n} = {W * n}")
    cuda.synchronize()
    if _stage_whole(algorithm, od.size * dtype.itemsize):
        await _staged(xd, od, dtype, lambda hx, ho: calls.all_gather(ho, hx, group, timeout, algorithm))
        return out
    segs = segments(n, W * dtype.itemsize, 1)
    opened = [_open(group, "all_gather", (hi - lo) * dtype.itemsize, algorithm, timeout, len(segs), dtype=dtype,
                    count=hi - lo, op=_whole("all_gather", None, n)) for lo, hi in segs]  # fmt: skip
    most = max(hi - lo for lo, hi in segs) * dtype.itemsize
    slots = _Slots(min(DEPTH, len(segs)), W * most, 0)

    async def step(i, slot):
        (lo, hi), (call, ag) = segs[i], opened[i]
        s, c = slot.stream, hi - lo
        send, recv = _host(slot.a, c, sdt), _host(slot.b, W * c, sdt)
        if c:
            xd[lo:hi].copy_to_host(send, stream=s)
        await _wait(s)
        await group.run(call, ag, recv.view(dtype), send.view(dtype))
        for j in range(W if c else 0):  # H2D: rank j's segment into its place
            od[j * n + lo:j * n + hi].copy_to_device(recv[j * c:(j + 1) * c], stream=s)
        await _wait(s)

    await _pipeline(segs, slots, step)
    return out


async def broadcast(x, src: int = 0, group=None, timeout=None, algorithm=None):
    """Device ``x`` of group rank ``src`` into every rank's device ``x``; one network step per segment."""
    xd, dtype = _flat("x", x)
    group = group_of(group)
    src = ops.check_root("src", src, group.size)
    cuda.synchronize()
    if _stage_whole(algorithm, xd.size * dtype.itemsize):
        await _staged_broadcast(xd, dtype, src, group, timeout, algorithm)
        return x
    segs, sdt = segments(xd.size, dtype.itemsize, 1), _storage_dtype(dtype)
    opened = [_open(group, "broadcast", (hi - lo) * dtype.itemsize, algorithm, timeout, len(segs), dtype=dtype,
                    count=hi - lo, root=src, op=_whole("broadcast", None, xd.size)) for lo, hi in segs]  # fmt: skip
    most = max(hi - lo for lo, hi in segs) * dtype.itemsize
    slots = _Slots(min(DEPTH, len(segs)), most, 0)
    root = group.rank == src

    async def step(i, slot):
        (lo, hi), (call, bc) = segs[i], opened[i]
        s, c = slot.stream, hi - lo
        buf = _host(slot.a, c, sdt)
        if root and c:
            xd[lo:hi].copy_to_host(buf, stream=s)
            await _wait(s)
        await group.run(call, bc, buf.view(dtype), src)
        if not root and c:
            xd[lo:hi].copy_to_device(buf, stream=s)
            await _wait(s)

    await _pipeline(segs, slots, step)
    return x


async def _staged_broadcast(xd, dtype, src: int, group, timeout, algorithm) -> None:
    """The whole array down on ``src``, the host broadcast, up on the others."""
    n, root = xd.size, group.rank == src
    buf = PINNED.take(n * dtype.itemsize)
    try:
        staged = _host(buf, n, _storage_dtype(dtype))
        if root and n:
            xd.copy_to_host(staged)
        await calls.broadcast(staged.view(dtype), src, group, timeout, algorithm)
        if not root and n:
            xd.copy_to_device(staged)
    finally:
        PINNED.give(buf)


async def _compressed_reduce_scatter(out, x, op, group, timeout, compression, key):
    """The compressed reduce_scatter of host arrays (staged: out, x in pinned host memory)."""
    calls.check_reduce_scatter(out, x, op, group)
    return await compressed.reduce_scatter(out, x, compression, op=op, group=group, timeout=timeout, key=key)


async def _staged(xd, od, dtype, host_call) -> None:
    """Whole arrays through the host: ``await host_call(host_x, host_out)`` between the copies."""
    sdt = _storage_dtype(dtype)
    bx, bo = PINNED.take(xd.size * dtype.itemsize), PINNED.take(od.size * dtype.itemsize)
    try:
        hx, ho = _host(bx, xd.size, sdt), _host(bo, od.size, sdt)
        if xd.size:
            xd.copy_to_host(hx)
        await host_call(hx.view(dtype), ho.view(dtype))
        if od.size:
            od.copy_to_device(ho)
    finally:
        PINNED.give(bx, bo)


# ---- compressed, on the device --------------------------------------------------------------------


async def _compressed_all_reduce(x, xd, dtype, op, group, timeout, algorithm, compression, key) -> None:
    # as compressed.all_reduce: a warm-up step's codec (top-k's warmup_steps), counting the call
    codec = compressed.codec_at(compressed.resolve(compression), key, advance=xd.size > 0)
    _, inner = split(codec)
    style = compressed.style_of(codec, algorithm) if inner.reduction != "sum" else None
    if style == "shard" and dtype == np.float32 and xd.size:
        if op not in ("sum", "avg"):
            raise ValueError(f"compressed all_reduce supports op 'sum' or 'avg', got {op!r}")
        await _shard_decode_sum(xd, codec, op=op, group=group, timeout=timeout, key=key)
        return
    await _staged_all_reduce(xd, dtype, op, group, timeout, algorithm, codec, key)  # everything else: on the host


def _payload_to_host(payload) -> tuple:
    return tuple(p.copy_to_host() if is_device_array(p) else np.asarray(p) for p in payload)


def _payload_to_device(payload) -> tuple:
    return tuple(cuda.to_device(np.ascontiguousarray(p)) for p in payload)


async def _shard_decode_sum(flat, codec, *, op: str, group, timeout=None, key=None) -> None:
    """collectives.compressed.shard_decode_sum with the codec maths on the device (same steps)."""
    ef, inner = split(codec)
    W, n = group.size, flat.size
    chunk = -(-n // W)
    y = ef.compensate(flat, key=key) if ef is not None else flat  # (n,) device float32
    padded = ccuda.zeros(W * chunk)
    padded[:n].copy_to_device(y)
    segs = [padded[j * chunk:(j + 1) * chunk] for j in range(W)]
    payloads = [inner.encode(s) for s in segs]  # device payloads
    if ef is not None:  # residual shard by shard, on the device
        err = cuda.device_array(W * chunk, np.float32)
        for j, p in enumerate(payloads):
            inner.residual_into(segs[j], p, err[j * chunk:(j + 1) * chunk])
        ef.errors[key].reshape(n).copy_to_device(err[:n])
    layout, nb, send = pack_all([_payload_to_host(p) for p in payloads])  # synchronized copies
    a2a_call, a2a, ag_call, ag = compressed.open_shard_calls(group, send, nb, timeout)
    recv = np.empty(W * nb, np.uint8)
    await group.run(a2a_call, a2a, recv, send)
    acc = ccuda.zeros(chunk)
    for j in range(W):  # decode-add on the device, in rank order
        inner.decode_add(_payload_to_device(unpack(recv[j * nb:(j + 1) * nb], layout)), acc)
    if op == "avg":  # a division, like the host path, for the same bits
        kcuda.fold_into(acc, acc, 1, "sum", W)
    if ef is not None:
        owner = ef.compensate(acc, key=("owner", key))
        mine_payload = inner.encode(owner)
        inner.residual_into(owner, mine_payload, ef.errors[("owner", key)])
    else:
        mine_payload = inner.encode(acc)
    _, _, mine = pack_all([_payload_to_host(mine_payload)])
    gathered = np.empty(W * nb, np.uint8)
    await group.run(ag_call, ag, gathered, mine)
    for j in range(W):
        dec = inner.decode(_payload_to_device(unpack(gathered[j * nb:(j + 1) * nb], layout)), chunk)
        lo, hi = j * chunk, min(n, (j + 1) * chunk)
        if hi > lo:
            flat[lo:hi].copy_to_device(dec[:hi - lo])
    cuda.synchronize()
