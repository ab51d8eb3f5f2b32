"""Compressed all_reduce (one function per way of combining a codec's payloads) and reduce_scatter.

``all_reduce(x, compression=...)`` (api.py) lands in :func:`all_reduce`, which picks the style from
the codec's ``reduction`` (:data:`DEFAULT_STYLE`) or from ``algorithm=`` and runs it;
``reduce_scatter(out, x, compression=...)`` lands in :func:`reduce_scatter`, the first half of
``shard`` (ZeRO++'s quantized reduce-scatter, qgZ; the ZeRO strategies' gradients). ops ``sum``
and ``avg``, float arrays (the codecs work in float32, the result is cast back). Every rank ends
with the same bits (each decodes the same payloads in rank order), so DDP replicas stay identical.

    style    default for  how                                             wire bytes per rank
    shard    int8, topk   encode per shard, all_to_all, decode-sum my     2 (W-1)/W x payload(n)
                          shard, encode it again, all_gather
    gather   -            all_gather whole payloads, decode-add all W     (W-1) x payload(n)
    ring     fp16, bf16   the TCP table's all_reduce of the 16-bit array  a ring's, on 16 bits
    phases   powersgd     all_reduce P = M Q, orthogonalize, all_reduce   4 r (n + m) per matrix, x2
                          Q = M^T P; M_hat = P Q^T

The error each style brings, error feedback (per ``key``), warm-up (:func:`codec_at`) and why the
sub-calls take the table's TCP algorithms: docs/design.md, "Compressed collectives"; wire bytes and
errors measured: bench/results/compression.md#wire-bytes-and-error-by-style.

Not here: the codecs' maths (collectives/compress), device arrays (device.py), buckets (bucket.py).
"""

from __future__ import annotations

import numpy as np

from collectives import calls, ops
from collectives.compress import PowerSGDCodec, get_codec
from collectives.compress.base import Codec, as_f32
from collectives.compress.powersgd import matrix_shape
from collectives.compress.wire import layout_nbytes, message_nbytes, pack_all, split, unpack
from collectives.calls import group_of, open_call

STYLES = ("shard", "gather", "ring", "phases")
# fp16/bf16 by the ring: the same bytes as shard in about half the time (shard encodes all n and
# re-encodes a shard), a slightly larger error (bench/results/compression.md#fp16-ring-against-shard).
# Pass algorithm="shard" for the smaller error at large W.
DEFAULT_STYLE = {"cast-reduce": "ring", "gather-decode-sum": "shard", "powersgd-phases": "phases"}

__all__ = ["STYLES", "all_reduce", "cast_ring", "check_blockwise", "codec_at", "compresses_matrices",
           "gather_decode_sum", "hierarchical", "host_groups", "open_shard_calls", "powersgd_phase_counts", "powersgd_phases", "reduce_scatter",
           "reduce_scatter_wire_nbytes", "resolve", "shard_decode_sum", "style_of", "wire_nbytes"]


def resolve(compression) -> Codec:
    """A codec from a name or object (``collectives.compress.get_codec``)."""
    return get_codec(compression)


def codec_at(codec, key=None, *, advance: bool = False) -> Codec:
    """The codec a call of stream ``key`` uses now: a warm-up step's codec (top-k's
    ``warmup_steps``: a larger ratio, same error-feedback residuals) or ``codec`` itself.
    ``advance=True`` counts the call (all_reduce does; wire-byte estimates do not). A codec whose
    ``step`` is set (the trainer's) is at that step in every stream, whatever its count."""
    codec = resolve(codec)
    ef, inner = split(codec)
    if not getattr(inner, "warmup_steps", 0):
        return codec
    step = inner.steps.get(key, 0) if inner.step is None else inner.step
    if advance:
        inner.steps[key] = step + 1
    now = inner.at_step(step)
    if now is inner:
        return codec
    return ef.sharing(now) if ef is not None else now


def style_of(codec: Codec, algorithm: str | None) -> str:
    """The compressed all_reduce style ``codec`` runs: ``algorithm`` if given, else its default.

    Raises:
        ValueError: an unknown style, or one that cannot reduce this codec's payload.
    """
    _, inner = split(codec)
    style = algorithm or DEFAULT_STYLE.get(inner.reduction)
    if style not in STYLES:
        raise ValueError(f"all_reduce(compression={codec!r}): algorithm={algorithm!r} is not a compressed "
                         f"all_reduce style; choose from {STYLES}")
    if style == "ring" and inner.reduction != "cast-reduce":
        raise ValueError(f"algorithm='ring' reduces 16-bit casts only (fp16, bf16), not {inner.name}")
    if (style == "phases") != (inner.reduction == "powersgd-phases"):
        raise ValueError(f"{inner.name} is reduced by {'phases' if style != 'phases' else 'shard/gather'}, "
                         f"not algorithm={style!r}")
    return style


# ---- wire bytes ----------------------------------------------------------------------------

def wire_nbytes(codec, n: int, world: int, algorithm: str | None = None) -> int:
    """Payload bytes one rank sends in a compressed all_reduce of ``n`` float elements
    (``shard`` / ``gather`` styles; frame headers not included)."""
    codec = resolve(codec)
    _, inner = split(codec)
    style = style_of(codec, algorithm)
    if world == 1:
        return 0
    if style == "shard":
        return 2 * (world - 1) * message_nbytes(inner, -(-n // world))
    if style == "gather":
        return (world - 1) * message_nbytes(inner, n)
    raise ValueError(f"wire_nbytes: style {style!r} depends on the all_reduce algorithm; measure it")


# ---- entry point ----------------------------------------------------------------------------

async def all_reduce(x: np.ndarray, codec, *, op: str = "sum", group=None, timeout: float | None = None,
                     algorithm: str | None = None, key=None) -> np.ndarray:
    """Compressed all_reduce of ``x`` in place; returns ``x``. See the module docstring.

    Args:
        codec: a name or Codec (ErrorFeedback-wrapped for error feedback).
        op: ``"sum"`` or ``"avg"``.
        algorithm: a style from :data:`STYLES`; default per codec.
        key: the state stream (error feedback residual, PowerSGD's Q), e.g. a bucket index.

    Raises:
        ValueError: another op, an unknown style. TypeError: a non-float array.
    """
    codec = resolve(codec)
    ops.check_array("x", x)
    _check_op_dtype("all_reduce", op, x)
    if split(codec)[1].reduction == "sum":  # the identity codec
        return await calls.all_reduce(x, op, group, timeout, None)
    style = style_of(codec, algorithm)
    group = group_of(group)
    codec = codec_at(codec, key, advance=x.size > 0)  # a warm-up step's codec, if any
    if x.size == 0:  # nothing to compress; still a call, so a length mismatch is seen
        return await calls.all_reduce(x, op, group, timeout, None)
    if style == "phases":
        await powersgd_phases([x], codec, op=op, group=group, timeout=timeout, key=key)
    else:
        fn = {"shard": shard_decode_sum, "gather": gather_decode_sum, "ring": cast_ring}[style]
        await fn(ops.flat(x), codec, op=op, group=group, timeout=timeout, key=key)
    return x


def _check_op_dtype(collective: str, op: str, x: np.ndarray) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"compressed {collective} supports op 'sum' or 'avg', got {op!r}")
    if x.dtype.kind != "f":
        raise TypeError(f"compressed {collective} takes float arrays, got {x.dtype}; pass compression=None")


async def reduce_scatter(out: np.ndarray, x: np.ndarray, codec, *, op: str = "sum", group=None,
                         timeout: float | None = None, key=None) -> np.ndarray:
    """Compressed reduce_scatter: ``out`` gets block ``rank`` of the reduced ``x``; returns ``out``.

    The first half of the ``shard`` style (ZeRO++'s qgZ, quantized gradient
    reduce-scatter): ``x`` holds W blocks of ``m = out.size`` elements; every rank
    encodes each block separately (from its compensated ``x`` with error feedback:
    the residual of all of ``x`` is kept under ``key``), sends block j's payload to
    rank j (one all_to_all), and rank j decode-adds the W payloads of its block in
    rank order into float32 (divided by W for avg), cast into ``out``. No second
    encoding: the error is ``sum_r e(x_r | block)`` only. Wire bytes per rank:
    (W-1) x payload(m) (:func:`reduce_scatter_wire_nbytes`), e.g. int8 25.4% of
    the fp32 ring reduce_scatter's. At W = 1 ``out`` is decode(encode(x)). Rank 0 /
    rank 1 of 2, fp16::

        x0 = [1 2 3 4]  x1 = [10 20 30 40]
        all_to_all:  r0 gets fp16 [1 2], [10 20];  r1 gets [3 4], [30 40]
        sum float32: r0 out = [11 22]              r1 out = [33 44]

    Args / checks: as ``api.reduce_scatter`` (which checks shapes and overlap and
    calls this); ``codec`` and ``key`` as :func:`all_reduce`.

    Raises:
        ValueError: an op other than sum / avg; a codec that is not reduced block by
            block (powersgd: low-rank all_reduces of whole matrices).
        TypeError: a non-float array.
    """
    codec = resolve(codec)
    _check_op_dtype("reduce_scatter", op, x)
    check_blockwise(codec)
    if split(codec)[1].reduction == "sum":  # the identity codec
        return await calls.reduce_scatter(out, x, op, group, timeout, None)
    group = group_of(group)
    codec = codec_at(codec, key, advance=x.size > 0)  # a warm-up step's codec, if any
    if x.size == 0:  # nothing to compress; still a call, so a length mismatch is seen
        return await calls.reduce_scatter(out, x, op, group, timeout, None)
    ef, inner = split(codec)
    W, m = group.size, out.size
    payloads = _encode_shards(ef, inner, ops.flat(x), key, W, m)  # block j -> rank j (no padding: x is W m)
    nb = layout_nbytes(payloads[0])
    raw = [ops.scratch_pool.take(W * nb) for _ in range(2)] + [ops.scratch_pool.take(4 * m)]
    send, recv = (r[:W * nb] for r in raw[:2])
    acc = raw[2][:4 * m].view(np.float32)  # (m,) the float32 sum of my block
    layout, _, _ = pack_all(payloads, send)
    del payloads
    call, a2a = _start(group, "all_to_all", send.nbytes, timeout, dtype=send.dtype, count=send.size)
    await group.run(call, a2a, recv, send)  # block j of recv: rank j's payload of my block
    _decode_sum_into(acc, inner, recv, layout, W, op)
    np.copyto(ops.flat(out), acc, casting="unsafe")
    for r in raw:  # only after success: a failed call may still have frames landing in them
        ops.scratch_pool.give(r)
    return out


def host_groups(group):
    """``(local, cross)`` for :func:`hierarchical`: this rank's host and the ranks of its local
    index on every host, made with ``new_group`` (every world rank must call this, in the same
    order), or None where it would not pay or cannot be made: ``group`` not the world, one host,
    one rank per host, or hosts of unequal rank counts. 2 hosts x 2 ranks [0 1 | 2 3]: rank 2
    gets local [2, 3] and cross [0, 2]."""
    topo = group.topology
    counts = {len(ranks) for ranks in topo.nodes}
    if group.size != group.runtime.world_size or topo.hosts < 2 or len(counts) != 1 or counts == {1}:
        return None
    mine = None, None
    for ranks in topo.nodes:
        g = group.new_group([group.ranks[r] for r in ranks])
        mine = (g, mine[1]) if g.is_member else mine
    for i in range(len(topo.nodes[0])):
        g = group.new_group([group.ranks[ranks[i]] for ranks in topo.nodes])
        mine = (mine[0], g) if g.is_member else mine
    return mine


async def hierarchical(flat: np.ndarray, codec, *, op: str, local, cross, timeout=None, key=None,
                       scratch: dict | None = None) -> None:
    """Compressed all_reduce of ``flat`` (1-D, in place) across hosts: float32 reduce_scatter
    inside the host (``local``, L ranks), the compressed all_reduce of this rank's block of n / L
    with its peers on the other hosts (``cross``; ``key`` its state stream), all_gather inside the
    host. Across the hosts' links this sends the codec's payload of each block once per host
    instead of the flat style's per rank: at 2 hosts x 2 ranks, int8 by the shard style, about
    payload(n) out of each host per call instead of 2 payload(n). Every rank ends with the same
    bits (the cross all_reduce's are the same on its members, the all_gather copies them). The
    calls on ``local`` and ``cross`` of concurrent callers must run one at a time (their order
    across the two groups is not fixed by launch order): AccountedCollectives holds a lock.
    ``scratch``: a dict the caller keeps, whose float32 buffers (per size) later calls reuse; only
    for calls that run one at a time (as under that lock)."""
    L, n = local.size, flat.size
    chunk = -(-n // L)
    bufs = None if scratch is None else scratch.get(n)
    if bufs is None:
        bufs = (np.empty(L * chunk, np.float32), np.empty(chunk, np.float32))
        if scratch is not None:
            scratch[n] = bufs
    x, block = bufs
    x[:n] = flat
    x[n:] = 0  # the padding (< L elements; the last call's all_gather wrote there)
    await calls.reduce_scatter(block, x, "sum", local, timeout, None)
    await all_reduce(block, codec, op="sum", group=cross, timeout=timeout, key=key)
    await calls.all_gather(x, block, local, timeout, None)
    _finish(flat, x[:n], op, L * cross.size)


def compresses_matrices(codec) -> bool:
    """Whether ``codec`` (name or object) compresses whole matrices (PowerSGD's low-rank
    all_reduces) rather than any 1-D array element- or block-wise: it cannot compress a
    reduce_scatter's blocks, and it sends a flat 1-D array uncompressed (pass the matrices'
    views to :func:`powersgd_phases`, as DDP's buckets do)."""
    return split(resolve(codec))[1].reduction == "powersgd-phases"


def check_blockwise(codec) -> None:
    """Raises ValueError unless ``codec`` (name or object) can compress a reduce_scatter."""
    if compresses_matrices(codec):
        raise ValueError(f"compressed reduce_scatter encodes block by block; {split(resolve(codec))[1].name} "
                         f"compresses whole matrices (low-rank all_reduces): use int8, topk, fp16 or bf16, or "
                         f"compression=None")


def reduce_scatter_wire_nbytes(codec, count: int, world: int) -> int:
    """Payload bytes one rank sends in a compressed reduce_scatter whose ``out`` has ``count``
    elements: (W-1) packed messages of one block (frame headers not included)."""
    codec = resolve(codec)
    check_blockwise(codec)
    _, inner = split(codec)
    return 0 if world == 1 else (world - 1) * message_nbytes(inner, count)


def _start(group, collective: str, nbytes: int, timeout, **fp):
    """Opens a sub-call (takes its sequence number now) on the table's algorithm without shared
    memory (``registry.choose(subcall=True)``: see the module docstring)."""
    return open_call(group, collective, nbytes, None, timeout, subcall=True, **fp)


def open_shard_calls(group, send: np.ndarray, nb: int, timeout):
    """The shard style's two sub-calls, opened now (both sequence numbers before the first
    wait): the all_to_all of the packed shards ``send`` and the all_gather of one
    ``nb``-byte reduced shard. Returns (a2a_call, a2a, ag_call, ag)."""
    a2a_call, a2a = _start(group, "all_to_all", send.nbytes, timeout, dtype=send.dtype, count=send.size)
    ag_call, ag = _start(group, "all_gather", nb, timeout, dtype=send.dtype, count=nb)
    return a2a_call, a2a, ag_call, ag


def _compensated(ef, inner, x: np.ndarray, key) -> np.ndarray:
    """y = x + carried error (with error feedback), else x as float32; flat."""
    return (ef.compensate(x, key=key) if ef is not None else as_f32(x)).reshape(-1)


def _finish(flat: np.ndarray, result: np.ndarray, op: str, size: int) -> None:
    if op == "avg":
        result /= np.float32(size)
    np.copyto(flat, result, casting="unsafe")


# ---- styles ---------------------------------------------------------------------------------

async def shard_decode_sum(flat: np.ndarray, codec, *, op: str, group, timeout=None, key=None) -> None:
    """Compress per shard -> all_to_all -> decode-sum own shard in float32 -> recompress -> all_gather.

    ``flat`` (n,) float, in place. Shards: ``chunk = ceil(n / W)`` elements,
    the last padded with zeros. Rank 0 / rank 1 of 2, n = 4, fp16::

        x0 = [1 2 3 4]  x1 = [10 20 30 40]
        all_to_all:  r0 gets fp16 [1 2], [10 20];  r1 gets [3 4], [30 40]
        sum float32: r0 [11 22]                    r1 [33 44]
        all_gather of fp16 sums: both [11 22 33 44]

    Buffers: shards are encoded straight from the (compensated) array, only a
    padded one is copied; the three packed messages (W x payload bytes each) and
    the float32 sum of my shard come from ``ops.scratch_pool``, kept across calls
    (fresh arrays of that size cost a page fault per 4 KiB on every call).
    """
    ef, inner = split(codec)
    group = group_of(group)
    W, n = group.size, flat.size
    chunk = -(-n // W)
    payloads = _encode_shards(ef, inner, flat, key, W, chunk)  # shard j -> rank j
    nb = layout_nbytes(payloads[0])
    raw = [ops.scratch_pool.take(W * nb) for _ in range(3)] + [ops.scratch_pool.take(4 * chunk + nb)]
    send, recv, gathered = (r[:W * nb] for r in raw[:3])
    acc, mine = raw[3][:4 * chunk].view(np.float32), raw[3][4 * chunk:4 * chunk + nb]  # (chunk,) sum, my message
    layout, _, _ = pack_all(payloads, send)
    del payloads
    a2a_call, a2a, ag_call, ag = open_shard_calls(group, send, nb, timeout)
    await group.run(a2a_call, a2a, recv, send)  # block j of recv: rank j's payload of my shard
    _decode_sum_into(acc, inner, recv, layout, W, op)
    if ef is not None:  # the owner's own error feedback on the re-encoding
        owner = ef.compensate(acc, key=("owner", key))
        mine_payload = inner.encode(owner)
        inner.residual_into(owner, mine_payload, ef.errors[("owner", key)])
    else:
        mine_payload = inner.encode(acc)
    pack_all([mine_payload], mine)
    await group.run(ag_call, ag, gathered, mine)  # every rank's reduced shard
    for j in range(W):  # decode each shard straight into its place (the padding is dropped)
        lo, hi = j * chunk, min(n, (j + 1) * chunk)
        if hi > lo:
            dec = inner.decode(unpack(gathered[j * nb:(j + 1) * nb], layout), chunk)
            np.copyto(flat[lo:hi], dec.reshape(-1)[:hi - lo], casting="unsafe")
    for r in raw:  # only after success: a failed call may still have frames landing in them
        ops.scratch_pool.give(r)


def _encode_shards(ef, inner: Codec, flat: np.ndarray, key, W: int, chunk: int) -> list:
    """The W payloads of ``flat`` cut into ``chunk``-element shards (shard j for rank j; the
    last padded with zeros), encoded from the compensated array; with error feedback each
    shard's residual goes into ``ef.errors[key]`` (what this rank does not send)."""
    y = _compensated(ef, inner, flat, key)  # (n,) float32; ``flat`` itself when already float32 without EF
    err = ef.errors[key].reshape(-1) if ef is not None else None  # (n,)
    return [_encode_shard(inner, y, j * chunk, chunk, err) for j in range(W)]


def _decode_sum_into(acc: np.ndarray, inner: Codec, recv: np.ndarray, layout, W: int, op: str) -> None:
    """``acc`` (chunk,) float32 = the sum of the W payloads packed in ``recv`` (block j: rank
    j's), decode-added in rank order (the same bits on every rank), divided by W for avg."""
    nb = recv.size // W
    acc.fill(0)
    for j in range(W):
        inner.decode_add(unpack(recv[j * nb:(j + 1) * nb], layout), acc)
    if op == "avg":
        acc /= np.float32(W)


def _encode_shard(inner: Codec, y: np.ndarray, lo: int, chunk: int, err: np.ndarray | None):
    """The payload of shard ``y[lo:lo + chunk]``, zero-padded past the end of ``y``. With
    ``err`` (error feedback), ``err[lo:lo + chunk]`` gets the shard's residual (the padding's
    is dropped). Encoded, and the residual taken, shard by shard in rank order."""
    hi = min(y.size, lo + chunk)
    if hi - lo == chunk:  # a whole shard: a view, no copy
        payload = inner.encode(y[lo:hi])
        if err is not None:
            inner.residual_into(y[lo:hi], payload, err[lo:hi])
        return payload
    kept = max(0, hi - lo)  # the last shard(s): padded with zeros, as every rank does
    shard = np.zeros(chunk, np.float32)
    shard[:kept] = y[lo:lo + kept]
    payload = inner.encode(shard)
    if err is not None:
        residual = np.empty(chunk, np.float32)
        inner.residual_into(shard, payload, residual)
        err[lo:lo + kept] = residual[:kept]
    return payload


async def gather_decode_sum(flat: np.ndarray, codec, *, op: str, group, timeout=None, key=None) -> None:
    """all_gather every rank's whole payload, then decode-add all W into float32 (rank order).

    Rank 0 / rank 1 of 2, int8::

        payloads: r0 enc(x0), r1 enc(x1)  -> both hold [enc(x0), enc(x1)]
        both: out = dec(enc(x0)) + dec(enc(x1))
    """
    ef, inner = split(codec)
    group = group_of(group)
    W, n = group.size, flat.size
    y = _compensated(ef, inner, flat, key)
    payload = inner.encode(y)
    if ef is not None:
        inner.residual_into(y, payload, ef.errors[key].reshape(-1))
    layout, nb, mine = pack_all([payload])
    call, ag = _start(group, "all_gather", nb, timeout, dtype=mine.dtype, count=nb)
    gathered = np.empty(W * nb, np.uint8)
    await group.run(call, ag, gathered, mine)
    acc = np.zeros(n, np.float32)
    for j in range(W):
        inner.decode_add(unpack(gathered[j * nb:(j + 1) * nb], layout), acc)
    _finish(flat, acc, op, W)


async def cast_ring(flat: np.ndarray, codec, *, op: str, group, timeout=None, key=None) -> None:
    """fp16 / bf16: the table's all_reduce on the 16-bit array (float32 adds, rounded every step)."""
    ef, inner = split(codec)
    group = group_of(group)
    y = _compensated(ef, inner, flat, key)
    (h,) = payload = inner.encode(y)
    if ef is not None:
        inner.residual_into(y, payload, ef.errors[key].reshape(-1))
    h = np.ascontiguousarray(h)
    call, fn = _start(group, "all_reduce", h.nbytes, timeout, op="sum", dtype=h.dtype, count=h.size)
    await group.run(call, fn, h, ops.kernel_op("sum"))
    _finish(flat, inner.decode((h,), h.size), op, group.size)


def _worth_compressing(shape, r: int) -> bool:
    n, m = matrix_shape(tuple(shape))
    return len(shape) >= 2 and r * (n + m) < n * m


def _matrices_and_riders(arrays: list, r: int) -> tuple[list[int], list[int]]:
    """Indices of the arrays PowerSGD compresses at rank ``r`` and of those riding uncompressed."""
    mats, plain = [], []
    for i, a in enumerate(arrays):
        (mats if a.dtype.kind == "f" and _worth_compressing(a.shape, r) else plain).append(i)
    return mats, plain


def powersgd_phase_counts(arrays: list, codec) -> int:
    """float32 elements PowerSGD's two phases all-reduce for ``arrays`` (as :func:`powersgd_phases`
    splits them): r (n + m) per matrix worth compressing, plus the size of every other array."""
    inner = split(resolve(codec))[1]
    mats, plain = _matrices_and_riders(arrays, inner.rank)
    return sum(inner.wire_nbytes(arrays[i].shape) for i in mats) // 4 + sum(arrays[i].size for i in plain)


async def powersgd_phases(arrays: list, codec, *, op: str, group, timeout=None, key=None) -> None:
    """PowerSGD over a list of arrays (a bucket's members, or one array), in place.

    Phase 1: P_i = M_i Q_i for each matrix, one all_reduce(avg) of [P_1 .. P_k,
    uncompressed arrays]; orthogonalize each P_i. Phase 2: Q_i = M_i^T P_i, one
    all_reduce(avg) of [Q_1 .. Q_k] (the warm start for the next step);
    M_i = P_i Q_i^T. State per ``(key, i)``.
    """
    ef, inner = split(codec)
    if not isinstance(inner, PowerSGDCodec):
        raise TypeError(f"powersgd_phases needs a PowerSGDCodec, got {inner!r}")
    group = group_of(group)
    W, r = group.size, inner.rank
    mats, plain = _matrices_and_riders(arrays, r)
    M, P = {}, {}
    for i in mats:
        y = ef.compensate(arrays[i], key=(key, i)) if ef is not None else as_f32(arrays[i])
        M[i] = y.reshape(matrix_shape(arrays[i].shape))  # (n, m)
        P[i] = inner.compute_p(M[i], key=(key, i))      # (n, r)
    n1 = sum(P[i].size for i in mats) + sum(arrays[i].size for i in plain)
    n2 = sum(M[i].shape[1] * r for i in mats)
    buf1 = np.empty(n1, np.float32)
    off = 0
    for i in mats:
        buf1[off:off + P[i].size] = P[i].reshape(-1)
        P[i] = buf1[off:off + P[i].size].reshape(P[i].shape)
        off += P[i].size
    for i in plain:
        buf1[off:off + arrays[i].size] = arrays[i].reshape(-1)
        off += arrays[i].size
    call1, fn1 = _start(group, "all_reduce", buf1.nbytes, timeout, op="sum", dtype=buf1.dtype,
                            count=n1)
    call2, fn2 = (_start(group, "all_reduce", 4 * n2, timeout, op="sum", dtype=buf1.dtype, count=n2)
                  if mats else (None, None))
    await group.run(call1, fn1, buf1, "sum")
    off = sum(P[i].size for i in mats)
    for i in plain:  # uncompressed riders: the exact sum
        view = buf1[off:off + arrays[i].size]
        if op == "avg":
            view /= np.float32(W)
        np.copyto(arrays[i].reshape(-1), view, casting="unsafe")
        off += arrays[i].size
    if not mats:
        return
    buf2 = np.empty(n2, np.float32)
    off = 0
    Q = {}
    for i in mats:
        inner.after_p_allreduce(P[i])            # orthonormal columns; the scale of the sum does not matter
        q = inner.compute_q(M[i], P[i], key=(key, i))  # (m, r), this rank's M^T P
        if ef is not None:  # this rank's own projection error
            np.subtract(M[i], P[i] @ q.T, out=ef.errors[(key, i)].reshape(M[i].shape))
        buf2[off:off + q.size] = q.reshape(-1)
        Q[i] = (q, buf2[off:off + q.size].reshape(q.shape))
        off += q.size
    await group.run(call2, fn2, buf2, "sum")
    for i in mats:
        state, q_sum = Q[i]
        np.divide(q_sum, np.float32(W), out=state)  # average: the warm start for the next step
        out = inner.decompress(P[i], state)        # (n, m): approximation of the average
        if op == "sum":
            out *= np.float32(W)
        np.copyto(arrays[i], out.reshape(arrays[i].shape), casting="unsafe")
