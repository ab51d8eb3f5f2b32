"""What the shared-memory algorithms share: who is on which node, the per-call session on a
domain, array views of the slots, running big copies and reductions off the event loop, a
sub-communicator over a subset of a call's ranks, and the TCP fallback.

Not here: segments and waiting (runtime/shm.py), the algorithms (one file each).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

from collectives.shm import kernels
from runtime import env, shm, turns

# Copies and reductions of at least this many bytes of work go to a worker thread (the kernels
# and NumPy copies release the GIL) when the peers are tasks of this same process
# (runtime.testing): then the other ranks keep running on the other core meanwhile.
OFFLOAD_MIN_NBYTES = 4 << 20
# When every peer is a process of its own, they run inline: each hand-off waits to be scheduled
# twice on an oversubscribed machine (bench/results/shm.md#worker-threads).
OFFLOAD_ALONE_MIN_NBYTES = 1 << 62
# Inline, a copy or reduction is cut into pieces of this many bytes (of its output), and the event
# loop gets a turn between pieces when it is due (runtime/turns.py): a piece is 0.1-1 ms of work,
# so a 64 MiB call no longer holds the loop for its 30 ms; a turn check costs one clock read.
PIECE_NBYTES = 2 << 20


def node_ids(group) -> list[str]:
    """The node id of every group rank. Runtimes made by ``runtime.testing`` have no
    ``nodes``: their ranks are tasks of this one process, hence on one node."""
    nodes = getattr(group.runtime, "nodes", None)
    if nodes is None:
        return ["local"] * group.size
    return [nodes[g] for g in group.ranks]


def _per_group(group, attr: str, work_out):
    """``work_out(group)``, remembered on the group (as ``attr``) for as long as its runtime's
    ``nodes`` list is the same object: that list is set once at start, except in tests."""
    nodes = getattr(group.runtime, "nodes", None)
    known = getattr(group, attr, None)
    if known is not None and known[0] is nodes:
        return known[1]
    value = work_out(group)
    try:
        setattr(group, attr, (nodes, value))
    except AttributeError:  # pragma: no cover - a group type with slots: work it out every time
        pass
    return value


def nodes_of(group) -> list[list[int]]:
    """The group ranks of each node, nodes in order of their lowest group rank (found once per
    group; the lists are shared between calls: do not change them).

    >>> # nodes a, b, a, b  ->  [[0, 2], [1, 3]]
    """
    return _per_group(group, "_shm_nodes_of", _nodes_of)


def _nodes_of(group) -> list[list[int]]:
    order: dict[str, list[int]] = {}
    for r, node in enumerate(node_ids(group)):
        order.setdefault(node, []).append(r)
    return list(order.values())


def shm_available(group) -> bool:
    """True when every member of ``group`` is on one node, ``RINGWEAVE_SHM`` is not ``"0"``,
    the group's ``shm_enabled`` attribute (a communicator option) is not False, and /dev/shm
    is writable. The same on every rank of the group (given the same environment)."""
    return shm_enabled(group) and one_node(group)


def one_node(group) -> bool:
    """Whether every member of ``group`` is on one node (found once per group)."""
    return _per_group(group, "_shm_one_node", lambda g: len(set(node_ids(g))) == 1)


def host_layout(group) -> str:
    """How the group's ranks sit on hosts (the same on every member; found once per group):
    ``"one"`` (a single host), ``"spread"`` (every rank on a host of its own), ``"packed"``
    (several hosts, each holding one contiguous run of group ranks, at least one of them more than
    one rank: the launcher's layout) or ``"mixed"`` (the rest)."""
    return _per_group(group, "_shm_host_layout", _host_layout)


def _host_layout(group) -> str:
    ids = node_ids(group)
    runs = [ids[0]] if ids else []
    for node in ids[1:]:
        if node != runs[-1]:
            runs.append(node)
    hosts = len(set(ids))
    return "one" if hosts <= 1 else "spread" if hosts == len(ids) else "packed" if len(runs) == hosts else "mixed"


def own_cores(group, local_ranks: int) -> bool:
    """Whether every rank of this node can have a core of its own: the cores this process may run
    on are at least the ranks that share the node (``local_ranks``, or the runtime's
    ``local_world_size`` when larger). Then a waiting rank may spin on its core; else it yields it."""
    local = max(local_ranks, getattr(group.runtime, "local_world_size", 1) or 1)
    return _cpus() >= local


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def shm_enabled(group) -> bool:
    """:func:`shm_available` without the one-node condition (all_reduce_hierarchical's test)."""
    return bool(getattr(group, "shm_enabled", True)) and shm.shm_usable()


class Link:
    """The call behind an algorithm's ``comm``: its group, sequence number and fingerprint (from
    the :class:`runtime.group.Call`), and its messages (``send``, ``irecv`` and ``sendrecv``,
    forwarded to ``comm``, so whatever a caller wrapped around them still applies). ``comm`` is
    the Call itself (what collectives/api.py hands algorithms), a wrapper that offers it as
    ``comm.call`` (SubComm), or one whose bound ``send`` belongs to it."""

    def __init__(self, comm):
        call = getattr(comm, "call", None)  # api's wrapper first: the usual case
        if call is None:
            call = comm if hasattr(comm, "group") else comm.send.__self__
        self.comm = comm
        self.group = call.group
        self.seq = call.seq
        self.fingerprint = call.fingerprint
        self.rank = comm.rank
        self.size = comm.size
        self.send = comm.send
        self.irecv = comm.irecv
        self.sendrecv = comm.sendrecv

    async def recv_into(self, src: int, buf) -> None:
        await self.irecv(src, buf)


class session:
    """``async with session(comm, members, index) as dom``: one call on the domain of ``members``
    (group ranks, this rank among them). Takes the domain's lock (calls run in sequence order),
    sets the domain up on first use, enters the call; on success posts EXIT. On failure the
    domain is closed (the group is failed anyway). A class, not a generator: it runs per call."""

    __slots__ = ("comm", "dom")

    def __init__(self, comm, members: list[int], index: int = 0):
        self.comm = comm
        self.dom = shm.domain(comm.group, members, index)

    async def __aenter__(self):
        dom = self.dom
        if not dom.try_begin(self.comm):
            await dom.begin(self.comm)
        return dom

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.dom.end(self.comm, exc_type is None)


def small_view(dom, p: int, dtype, count: int) -> np.ndarray:
    """The first ``count`` elements of member ``p``'s small slot of the current call."""
    return small_views(dom, dtype, count)[p]


def small_views(dom, dtype, count: int) -> list[np.ndarray]:
    """:func:`small_view` of every member, by domain rank. Kept per (parity, dtype, count) for
    the calls of a training loop, which repeat (at most :data:`_VIEW_KINDS` kinds kept)."""
    key = (dom.parity, dtype, count)
    views = dom.views.get(key)
    if views is None:
        base = ("small", dom.parity)
        slots = dom.views.get(base)
        if slots is None:  # byte arrays over every member's slot, made once per parity
            slots = dom.views[base] = [np.frombuffer(dom.small_buffer(q), np.uint8) for q in range(dom.size)]
        if len(dom.views) > _VIEW_KINDS:
            dom.views.clear()
            dom.views[base] = slots
        nbytes = count * np.dtype(dtype).itemsize
        views = dom.views[key] = [s[:nbytes].view(dtype) for s in slots]
    return views


_VIEW_KINDS = 64


def data_view(dom, p: int, dtype, count: int) -> np.ndarray:
    """The first ``count`` elements of member ``p``'s data slot."""
    return np.frombuffer(dom.data_buffer(p), dtype, count)


async def claim_slot(comm, dom, nbytes: int) -> bool:
    """Which slot a call moving ``nbytes`` per member uses: True for the small one (when they fit
    in ``runtime.shm.SMALL_NBYTES``), else False after claiming the data slot (``claim_data``)."""
    if nbytes <= shm.SMALL_NBYTES:
        return True
    await dom.claim_data(comm, nbytes)
    return False


def slot(dom, p: int, dtype, count: int, small: bool) -> np.ndarray:
    return small_view(dom, p, dtype, count) if small else data_view(dom, p, dtype, count)


async def copy_off_loop(dom, nbytes: int, pairs: list[tuple[np.ndarray, np.ndarray]], stream: bool = False) -> None:
    """``copy_pairs(pairs, stream)``: on a worker thread when it moves at least
    :data:`OFFLOAD_MIN_NBYTES` and ``dom``'s peers are tasks of this process
    (:data:`OFFLOAD_ALONE_MIN_NBYTES` otherwise); inline, in pieces of at most
    :data:`PIECE_NBYTES` with the loop's turns between them."""
    if nbytes >= (OFFLOAD_MIN_NBYTES if dom.cooperative else OFFLOAD_ALONE_MIN_NBYTES):
        await asyncio.to_thread(copy_pairs, pairs, stream)
        return
    for dst, src in pairs:
        step = max(1, PIECE_NBYTES // max(1, dst.itemsize))
        for lo in range(0, dst.size, step):
            copy_pairs([(dst[lo:lo + step], src[lo:lo + step])], stream)
            if turns.due():
                await asyncio.sleep(0)


async def reduce_off_loop(dom, nbytes: int, dst: np.ndarray, srcs: list[np.ndarray], pub: np.ndarray,
                          op: str) -> None:
    """``kernels.reduce_publish(dst, srcs, pub, op)``, where and in pieces as :func:`copy_off_loop`
    (element by element in the same order: the same bits)."""
    if nbytes >= (OFFLOAD_MIN_NBYTES if dom.cooperative else OFFLOAD_ALONE_MIN_NBYTES):
        await asyncio.to_thread(kernels.reduce_publish, dst, srcs, pub, op)
        return
    step = max(1, PIECE_NBYTES // max(1, dst.itemsize))
    for lo in range(0, dst.size, step):
        hi = lo + step
        kernels.reduce_publish(dst[lo:hi], [s[lo:hi] for s in srcs], pub[lo:hi], op)
        if turns.due():
            await asyncio.sleep(0)


def copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]], stream: bool = False) -> None:
    """``dst[...] = src`` for each ``(dst, src)``; with ``stream``, by non-temporal stores
    (:func:`collectives.shm.kernels.stream_copy`: for the arrays :func:`streams` says)."""
    for dst, src in pairs:
        if dst.size:
            if stream:
                kernels.stream_copy(dst, src)
            else:
                np.copyto(dst, src)


def streams(nbytes: int) -> bool:
    """Whether the copies of a call moving ``nbytes`` per rank bypass the caches (kernels.stream_copy):
    from ``RINGWEAVE_SHM_STREAM_MIN`` (4 MiB). At 1 MiB the plain copy wins while the caches hold the
    data and loses less than it gains back when they do not (bench/results/shm.md#streaming-copies)."""
    return nbytes >= env.SHM_STREAM_MIN.get()


class SubComm:
    """The ranks ``members`` (group ranks) of a call, renumbered 0..len-1, so an existing TCP
    algorithm can run among them (e.g. one leader per node). Messages are the call's own (same
    tag and fingerprint), so they are matched in order and checked like any other."""

    def __init__(self, call, members: list[int]):
        self.call = call
        self.members = list(members)
        self.rank = self.members.index(call.rank)
        self.size = len(self.members)
        self.group = call.group
        self.seq = call.seq
        self.fingerprint = call.fingerprint

    async def send(self, dst: int, buf) -> None:
        await self.call.send(self.members[dst], buf)

    def irecv(self, src: int, buf):
        return self.call.irecv(self.members[src], buf)

    async def recv_into(self, src: int, buf) -> None:
        await self.call.recv_into(self.members[src], buf)

    async def sendrecv(self, dst: int | None, sbuf, src: int, rbuf) -> None:
        await self.call.sendrecv(None if dst is None else self.members[dst], sbuf, self.members[src], rbuf)


def tcp_algorithm(collective: str, nbytes: int, world: int, layout: str):
    """The run function the TCP table would choose for ``world`` ranks laid out on hosts as
    ``layout`` (:func:`host_layout` of the ranks that run it; :func:`collectives.registry.
    first_tcp_rule`)."""
    from collectives import registry  # here: registry imports collectives.shm
    return registry.first_tcp_rule(collective, nbytes, world, layout)[1]
