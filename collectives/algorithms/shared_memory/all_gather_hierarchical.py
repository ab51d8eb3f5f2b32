"""Hierarchical all_gather for groups that span hosts: every block crosses into each other host once,
over TCP, and spreads inside a host over shared memory.

How it works (the group's ranks fall into hosts by ``group.topology.nodes``; rank a of host i in
group order is (i, a), host i has k_i ranks; ``out`` holds n blocks of m elements; S_q = local rank
q's data slot, laid out as ``out``; each block is cut into P **parts**, P <= PARTS):

1. (i, a) sends x, part by part, to (j, a mod k_j) on every other host j (the hosts in turn from
   i + 1, so that no host receives from all at once); meanwhile it copies x to its place in S_a and
   posts phase 1;
2. (j, b) receives the blocks of the ranks (i, a) with a mod k_j = b straight into their places in
   S_b, and posts phase 2 + p once part p of every one of them is in;
3. every rank copies out: the blocks of its host's ranks from their slots after phase 1, and part p
   of the other hosts' blocks from the slots of the ranks that received them after phase 2 + p,
   while the later parts still cross.

Each host's link carries every other host's blocks in once and its own blocks out once per other
host: (H-1)/H of ``out`` each way when the hosts hold as many ranks (the flat ring over every rank
sends (n-1)/n of it over the busiest link). Hosts of unequal sizes work too (a rank may receive
several blocks, or none); a rank alone on its host receives straight into ``out``.

Worked example, hosts A = {0, 1} and B = {2, 3}, rank g's block is [g]::

    1-2  TCP: 0 -> 2, 1 -> 3, 2 -> 0, 3 -> 1;  S_0 = S_2 = [0 . 2 .], S_1 = S_3 = [. 1 . 3]
    3    rank 0: out = [x, S_1[1], S_0[2], S_1[3]] = [0, 1, 2, 3]; every rank likewise

Signature: ``await run(comm, out, x)`` like tcp/all_gather_ring.py (x may be block r of out).
"""

from __future__ import annotations

import asyncio

import numpy as np

from collectives import tunefile
from collectives.comm import Comm, copy_step
from collectives.ops import as_bytes, chunk_bounds
from collectives.slots import common

PARTS = 4  # parts of a block, each announced by a phase (2..1+PARTS of the 6 a call has)
PART_MIN_NBYTES = 256 << 10  # no part under this (one part for blocks up to 512 KiB)


async def run(comm: Comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r, m = comm.size, comm.rank, x.size
    if not np.shares_memory(out[r * m:(r + 1) * m], x):
        await copy_step(out[r * m:(r + 1) * m], x)
    if n == 1 or m == 0:
        return
    plan = Plan(comm, m, x.itemsize)
    local, a = plan.local, plan.a
    incoming = [g for g in plan.remote if plan.keeper[g] == a]  # the blocks that cross into my slot

    def part(buf: np.ndarray, g: int, p: int) -> np.ndarray:
        """Part p of block g of ``buf`` (laid out as out)."""
        return buf[g * m + plan.bounds[p]:g * m + plan.bounds[p + 1]]

    sends = [[(dst, as_bytes(x[plan.bounds[p]:plan.bounds[p + 1]])) for dst in plan.to] for p in plan.parts]
    if len(local) == 1:  # alone on my host: the other blocks straight into out
        arriving = [comm.irecv(g, as_bytes(part(out, g, p))) for p in plan.parts for g in incoming]
        await send_parts(comm, sends)
        for fut in arriving:
            await fut
        return
    async with common.DomainCall(comm, list(local), 1 + plan.h) as dom:  # index 0 is the flat domain's
        await dom.claim_data(comm, out.nbytes)
        slots = [common.data_view(dom, q, x.dtype, n * m) for q in range(len(local))]
        arriving = [[comm.irecv(g, as_bytes(part(slots[a], g, p))) for g in incoming] for p in plan.parts]
        stream = out.nbytes >= tunefile.stream_min(comm.group)  # the copies bypass the caches

        async def spread() -> None:
            await common.copy_off_loop(dom, x.nbytes, [(slots[a][r * m:(r + 1) * m], x)])  # 1. publish mine
            dom.post(comm, 1)
            await dom.wait_all(comm, 1)  # 3. my host's blocks
            await common.copy_off_loop(dom, x.nbytes * (len(local) - 1), [
                (out[g * m:(g + 1) * m], slots[q][g * m:(g + 1) * m]) for q, g in enumerate(local) if g != r], stream)
            for p in plan.parts:
                for fut in arriving[p]:  # 2. part p of what crosses into my slot
                    await fut
                dom.post(comm, 2 + p)
                await dom.wait_all(comm, 2 + p)  # 3. part p of every other host's blocks
                await common.copy_off_loop(dom, x.nbytes * len(plan.remote) // len(plan.parts), [
                    (part(out, g, p), part(slots[plan.keeper[g]], g, p)) for g in plan.remote], stream)

        await together(send_parts(comm, sends), spread())


async def together(*steps) -> None:
    """Runs the coroutines ``steps`` at once (a rank's sends beside its shared-memory work); the first
    failure cancels the others, and it returns only once every one has ended (none is left
    reading a slot or a buffer)."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def send_parts(comm: Comm, sends: list[list[tuple[int, memoryview]]]) -> None:
    """``sends[p]``: the (destination, bytes) of part p, sent part after part (also
    reduce_scatter_hierarchical's, from a rank alone on its host)."""
    for messages in sends:
        for dst, data in messages:
            await comm.send(dst, data)


class Plan:
    """Who sends what where, from the group's hosts (every rank works out the same): ``h`` my host,
    ``local`` its ranks, ``a`` my index among them, ``to`` the rank of each other host that my
    data goes to (hosts in turn from mine), ``keeper[g]`` for a block g the local index of the rank
    of my host that holds it (g's own on my host, else its receiver), ``remote`` the blocks of
    the other hosts, ``bounds`` and ``parts``: a block of ``count`` elements cut into parts."""

    __slots__ = ("h", "local", "a", "to", "keeper", "remote", "bounds", "parts")

    def __init__(self, comm: Comm, count: int, itemsize: int):
        topology = comm.group.topology
        nodes = topology.nodes
        self.h = topology.node_of(comm.rank)
        self.local = nodes[self.h]
        k, self.a = len(self.local), self.local.index(comm.rank)
        order = [(self.h + t) % len(nodes) for t in range(1, len(nodes))]
        self.to = [nodes[j][self.a % len(nodes[j])] for j in order]
        self.keeper = {g: b if i == self.h else b % k for i, ranks in enumerate(nodes) for b, g in enumerate(ranks)}
        self.remote = [g for j in order for g in nodes[j]]
        nparts = max(1, min(PARTS, count * itemsize // PART_MIN_NBYTES, count))
        self.parts = range(nparts)
        self.bounds = chunk_bounds(count, nparts)
