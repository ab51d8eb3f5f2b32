"""Collectives on device arrays (``__cuda_array_interface__``, numba device arrays).

The transport moves host bytes, so every device collective stages through host
buffers: ``copy_to_host`` into a reusable staging buffer (pinned where numba
offers it, plain NumPy otherwise), the host algorithm, ``copy_to_device`` back.
The device is synchronized before any staged byte reaches the transport (the
copies are synchronous on the default stream, and :func:`to_host` also calls
``cuda.synchronize()``, so kernels queued on other streams are done too).

What runs where:

* ``all_reduce`` (no codec): reduce on the DEVICE. The array is cut into W
  blocks; all_to_all of the staged blocks gives rank j every rank's block j;
  they are copied up and folded on the device with ``collectives.kernels.reduce_into``
  (the CUDA kernels), in rank order; the reduced block is staged down and
  all_gathered, and the whole result copied up. Wire bytes: a ring
  all_reduce's. ``avg`` divides on the host (the kernels' floor rule for ints).

      Rank 0 / rank 1 of 2, x = [1 2 3 4] / [10 20 30 40] (device):
      all_to_all (host):  r0 holds [1 2], [10 20]   r1 holds [3 4], [30 40]
      device fold:        r0 [11 22]                r1 [33 44]
      all_gather (host):  both [11 22 33 44] -> copied to the device

* ``all_reduce(compression=codec)``, shard style (the default of int8 and
  topk, and fp16/bf16 with algorithm="shard"; collectives/compressed.py says
  what it computes): encode,
  residuals, decode and decode-sum run on the device with the codecs' CUDA
  kernels; only payloads are staged. Other styles (gather, ring, powersgd,
  which has no CUDA path) stage the whole array and run the host version.
* ``all_gather``, ``broadcast``: stage, host algorithm, copy back (nothing to reduce).

The simulator (NUMBA_ENABLE_CUDASIM=1) runs all of this on the CPU, which is
how tests/compressed/test_device.py checks it. Not tuned: one staging copy per
step, default stream, no overlap of copies with the transport.
"""

from __future__ import annotations

import numpy as np

from collectives.kernels import is_device_array  # re-exported: the one test of what a device array is

__all__ = ["POOL", "StagingPool", "all_gather", "all_reduce", "broadcast", "is_device_array", "to_device",
           "to_host"]


def _cuda():
    from numba import cuda
    return cuda


def _dev(a):
    from collectives.kernels.cuda import as_device
    return as_device(a)


# ---- staging ----------------------------------------------------------------------------------

class StagingPool:
    """Reusable host buffers (pinned when numba can pin, plain NumPy otherwise).

    ``take`` hands out a buffer no other call holds (concurrent calls, and ranks run as tasks of
    one process, each get their own); ``give`` returns it for reuse. Buffers are kept by dtype
    and grown on demand; at most ``keep`` free ones per dtype are kept.
    """

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._free: dict[np.dtype, list[np.ndarray]] = {}

    def take(self, n: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        free = self._free.setdefault(dtype, [])
        for i, buf in enumerate(free):
            if buf.size >= n:
                return free.pop(i)[:n]
        try:
            return _cuda().pinned_array(max(n, 1), dtype)[:n]
        except Exception:  # no driver support for pinning: pageable memory works too
            return np.empty(max(n, 1), dtype)[:n]

    def give(self, *bufs: np.ndarray) -> None:
        for buf in bufs:
            base = buf.base if isinstance(buf.base, np.ndarray) else buf
            free = self._free.setdefault(base.dtype, [])
            if len(free) < self.keep:
                free.append(base.reshape(-1))


POOL = StagingPool()


def to_host(dev, host: np.ndarray) -> np.ndarray:
    """Device -> host into ``host``; synchronizes the device first, so the bytes are final."""
    cuda = _cuda()
    cuda.synchronize()
    if dev.size:
        _dev(dev).reshape(dev.size).copy_to_host(host.reshape(-1))
    return host


def to_device(host: np.ndarray, dev) -> None:
    """Host -> device, in place on ``dev`` (same number of elements)."""
    if dev.size:
        _dev(dev).reshape(dev.size).copy_to_device(np.ascontiguousarray(host).reshape(-1))
    _cuda().synchronize()


def _check(name: str, x) -> None:
    x = _dev(x)
    if not x.is_c_contiguous():
        raise ValueError(f"{name} must be a C-contiguous device array, got shape {x.shape}")
    from collectives.ops import DTYPE_NAMES, DTYPES
    if np.dtype(x.dtype) not in DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {', '.join(DTYPE_NAMES)}")


# ---- collectives ------------------------------------------------------------------------------

async def all_reduce(x, op: str = "sum", group=None, timeout=None, algorithm=None, compression=None, key=None):
    """See the module docstring; ``x`` a device array, in place; returns ``x``."""
    from collectives import api, compressed, ops
    _check("x", x)
    ops.check_op(op)
    group = api._group(group)
    if compression is not None:
        # as compressed.all_reduce: a warm-up step's codec (top-k's warmup_steps), counting the call
        codec = compressed.codec_at(compressed.resolve(compression), key, advance=x.size > 0)
        _, inner = compressed._split(codec)
        style = compressed._style(codec, algorithm) if inner.reduction != "sum" else None
        if style == "shard" and np.dtype(x.dtype) == np.float32 and x.size:
            if op not in ("sum", "avg"):
                raise ValueError(f"compressed all_reduce supports op 'sum' or 'avg', got {op!r}")
            await _shard_decode_sum(_dev(x).reshape(x.size), codec, op=op, group=group, timeout=timeout, key=key)
            return x
        host = POOL.take(x.size, x.dtype)  # everything else: on the host
        try:
            to_host(x, host)
            await api.all_reduce(host.reshape(x.shape), op=op, group=group, timeout=timeout, algorithm=algorithm,
                                 compression=codec, key=key)
            to_device(host, x)
        finally:
            POOL.give(host)
        return x
    if algorithm is not None:
        raise ValueError(f"device all_reduce has one algorithm (all_to_all, device fold, all_gather); "
                         f"got algorithm={algorithm!r}")
    chunk = -(-x.size // group.size)
    dtype = np.dtype(x.dtype)
    send, recv, out = (POOL.take(group.size * chunk, dtype) for _ in range(3))
    mine = POOL.take(chunk, dtype)
    try:
        await _fold_on_device(x, op, group, timeout, send, recv, mine, out)
    finally:
        POOL.give(send, recv, mine, out)
    return x


async def _fold_on_device(x, op, group, timeout, send, recv, mine, out) -> None:
    from collectives import compressed, ops
    from collectives.kernels import reduce_into
    W, n, dtype = group.size, x.size, np.dtype(x.dtype)
    chunk = -(-n // W)
    to_host(x, send[:n])
    send[n:] = 0  # padding: reduced and dropped
    a2a_call, a2a = compressed._start(group, "all_to_all", send.nbytes, timeout, dtype=dtype, count=send.size)
    ag_call, ag = compressed._start(group, "all_gather", chunk * dtype.itemsize, timeout, dtype=dtype, count=chunk)
    await group.run(a2a_call, a2a, recv, send)  # block j: rank j's block of my chunk
    cuda = _cuda()
    acc = cuda.to_device(recv[:chunk])
    for j in range(1, W):  # device fold, rank order
        reduce_into(acc, cuda.to_device(recv[j * chunk:(j + 1) * chunk]), ops.kernel_op(op))
    to_host(acc, mine)
    await group.run(ag_call, ag, out, mine)
    ops.finish_avg(out, op, W)
    to_device(out[:n], x)


async def all_gather(out, x, group=None, timeout=None, algorithm=None):
    """Device ``out`` gets every rank's device ``x``; staged through host buffers."""
    from collectives import api
    _check("out", out)
    _check("x", x)
    host_x, host_out = POOL.take(x.size, x.dtype), POOL.take(out.size, out.dtype)
    try:
        to_host(x, host_x)
        await api.all_gather(host_out, host_x, group=group, timeout=timeout, algorithm=algorithm)
        to_device(host_out, out)
    finally:
        POOL.give(host_x, host_out)
    return out


async def broadcast(x, src: int = 0, group=None, timeout=None, algorithm=None):
    """Device ``x`` of rank ``src`` to every rank's device ``x``; staged through a host buffer."""
    from collectives import api
    _check("x", x)
    host = POOL.take(x.size, x.dtype)
    try:
        to_host(x, host)
        await api.broadcast(host, src, group=group, timeout=timeout, algorithm=algorithm)
        to_device(host, x)
    finally:
        POOL.give(host)
    return x


# ---- compressed, on the device ----------------------------------------------------------------

_divide_kernel = None


def _divide_body(a, f):  # a kernel: jitted on first use (numba.cuda is imported late, see _divide)
    i = cuda.grid(1)  # noqa: F821  (the module global set by _divide)
    while i < a.size:
        a[i] /= f
        i += cuda.gridsize(1)  # noqa: F821


def _divide(a, n: int) -> None:
    """a /= n on the device (float32; a division, like the host path, for the same bits)."""
    global _divide_kernel
    if _divide_kernel is None:  # the kernel reads the module global ``cuda``, as the simulator wants
        globals()["cuda"] = _cuda()
        _divide_kernel = _cuda().jit(_divide_body)
    from collectives.kernels.cuda import grid
    if a.size:
        _divide_kernel[grid(a.size)](a, np.float32(n))
        _cuda().synchronize()


def _payload_to_host(payload) -> tuple:
    return tuple(p.copy_to_host() if is_device_array(p) else np.asarray(p) for p in payload)


def _payload_to_device(payload) -> tuple:
    cuda = _cuda()
    return tuple(cuda.to_device(np.ascontiguousarray(p)) for p in payload)


async def _shard_decode_sum(flat, codec, *, op: str, group, timeout=None, key=None) -> None:
    """collectives.compressed.shard_decode_sum with the codec maths on the device (same steps)."""
    from collectives.compressed import _open_shard_calls, _pack_all, _split, _unpack
    from collectives.kernels import reduce_into
    cuda = _cuda()
    ef, inner = _split(codec)
    W, n = group.size, flat.size
    chunk = -(-n // W)
    y = ef.compensate(flat, key=key) if ef is not None else flat  # (n,) device float32
    padded = cuda.to_device(np.zeros(W * chunk, np.float32))
    padded[:n].copy_to_device(y)
    segs = [padded[j * chunk:(j + 1) * chunk] for j in range(W)]
    payloads = [inner.encode(s) for s in segs]  # device payloads
    if ef is not None:  # residual shard by shard, on the device
        err = cuda.device_array(W * chunk, np.float32)
        for j, p in enumerate(payloads):
            inner.residual_into(segs[j], p, err[j * chunk:(j + 1) * chunk])
        ef.errors[key].reshape(n).copy_to_device(err[:n])
    layout, nb, send = _pack_all([_payload_to_host(p) for p in payloads])  # synchronized copies
    a2a_call, a2a, ag_call, ag = _open_shard_calls(group, send, nb, timeout)
    recv = np.empty(W * nb, np.uint8)
    await group.run(a2a_call, a2a, recv, send)
    acc = None
    for j in range(W):  # decode on the device, fold in rank order
        dec = inner.decode(_payload_to_device(_unpack(recv[j * nb:(j + 1) * nb], layout)), chunk)
        if acc is None:
            acc = dec
        else:
            reduce_into(acc, dec, "sum")
    if op == "avg":
        _divide(acc, W)
    if ef is not None:
        owner = ef.compensate(acc, key=("owner", key))
        mine_payload = inner.encode(owner)
        inner.residual_into(owner, mine_payload, ef.errors[("owner", key)])
    else:
        mine_payload = inner.encode(acc)
    _, _, mine = _pack_all([_payload_to_host(mine_payload)])
    gathered = np.empty(W * nb, np.uint8)
    await group.run(ag_call, ag, gathered, mine)
    for j in range(W):
        dec = inner.decode(_payload_to_device(_unpack(gathered[j * nb:(j + 1) * nb], layout)), chunk)
        lo, hi = j * chunk, min(n, (j + 1) * chunk)
        if hi > lo:
            flat[lo:hi].copy_to_device(dec[:hi - lo])
    cuda.synchronize()
