"""Hierarchical all_reduce for groups that span hosts: reduce inside each host over shared memory,
all_reduce across hosts over TCP, spread the result inside each host over shared memory.

How it works (the group's ranks fall into hosts by ``group.topology.nodes``; local rank a of a host
is its a-th rank in group order, k ranks on the host; S_a = local rank a's data slot; ``across`` is
the table's all_reduce for one rank per host, run on a SubComm of the call):

* hosts of **equal** sizes (the launcher's layout): x is cut into P <= 4 **parts** (of at least k x
  256 KiB), each part into k chunks, local rank a owning chunk a of each;
  1. S_a[c] = x[c] for every chunk c of every part that is not mine; post phase 1;
  2. part p: x[mine] <op>= S_q[mine] for the other local q in order; ``across`` on x[mine] among
     local rank a of every host; S_a[mine] = x[mine]; post 2 + p; after every local peer's 2 + p,
     x[c] = S_c[c] for the others' chunks c of part p.
  While part p crosses over TCP, part p+1 is reduced and part p-1 spread (:func:`_pipelined`).
* hosts of **unequal** sizes: the same steps one after the other, through one leader per host
  (local rank 0) for the whole of x (:func:`through_leaders`, the reference).

Each host link carries 2(H-1)/H of x each way (the flat algorithms cross once per rank); every
chunk is reduced by one chain of ranks, so every rank gets the same bits. The table picks it over
64 KiB where a host holds several ranks (bench/results/all_reduce.md#hierarchical-flat-path).

Worked example, 4 ranks, hosts A = {0, 2} and B = {1, 3}, rank g contributes [g, g] (sum)::

    1-2  A: rank 0 reduces chunk 0, 0+2 = [2]; rank 2 chunk 1, [2].  B: ranks 1 and 3 get [4]
         TCP: ranks 0 and 1 all_reduce chunk 0 to [6]; ranks 2 and 3 chunk 1 to [6]
    2    each copies its peer's chunk: x = [6, 6] on every rank

Signature: ``await run(comm, x, op, across)`` like tcp/all_reduce_ring.py, plus ``across``, the
hosts' all_reduce (``run(comm, x, op)``), which the registry binds.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import numpy as np

from collectives import tunefile
from collectives.algorithms.shared_memory import all_gather_hierarchical, all_reduce_shm
from collectives.algorithms.shared_memory.all_gather_hierarchical import together
from collectives.comm import Comm, SubComm
from collectives.ops import chunk_bounds
from collectives.slots import common


async def run(comm: Comm, x: np.ndarray, op: str, across: Callable) -> None:
    if comm.size == 1:
        return
    nodes = comm.group.topology.nodes
    if len({len(ranks) for ranks in nodes}) == 1:
        await _pipelined(comm, x, op, across)
    else:
        await through_leaders(comm, x, op, across)


async def _pipelined(comm: Comm, x: np.ndarray, op: str, across: Callable) -> None:
    """Hosts of equal sizes: the steps of the module docstring, part by part."""
    topology = comm.group.topology
    index = topology.node_of(comm.rank)
    local = topology.nodes[index]
    k, a = len(local), local.index(comm.rank)
    counterparts = SubComm(comm, [ranks[a] for ranks in topology.nodes])  # local rank a of every host
    if k == 1:  # a rank per host: only the hosts' all_reduce
        await _across(counterparts, x, op, across)
        return
    blocks = all_gather_hierarchical  # the same parts: at most PARTS, of PART_MIN_NBYTES per rank at least
    nparts = max(1, min(blocks.PARTS, x.nbytes // (k * blocks.PART_MIN_NBYTES)))
    starts = chunk_bounds(x.size, nparts)
    bounds = [[starts[p] + b for b in chunk_bounds(starts[p + 1] - starts[p], k)] for p in range(nparts)]

    def chunk(buf: np.ndarray, p: int, c: int) -> np.ndarray:
        return buf[bounds[p][c]:bounds[p][c + 1]]

    others = [c for c in range(k) if c != a]
    async with common.DomainCall(comm, list(local), 1 + index) as dom:  # index 0 is the flat domain's
        await dom.claim_data(comm, x.nbytes)
        slots = [common.data_view(dom, q, x.dtype, x.size) for q in range(k)]
        stream = x.nbytes >= tunefile.stream_min(comm.group)  # the copies bypass the caches
        await common.copy_off_loop(dom, x.nbytes, [(chunk(slots[a], p, c), chunk(x, p, c))  # 1. copy-in
                                                   for p in range(nparts) for c in others], stream)
        dom.post(comm, 1)
        loop = asyncio.get_running_loop()
        reduced = [loop.create_future() for _ in range(nparts)]  # my chunk of part p reduced over the host
        crossed = [loop.create_future() for _ in range(nparts)]  # ... and across hosts

        async def over_tcp() -> None:
            for p in range(nparts):
                await reduced[p]
                await _across(counterparts, chunk(x, p, a), op, across)
                crossed[p].set_result(None)

        async def in_host() -> None:
            await dom.wait_all(comm, 1)
            for p in range(nparts + 1):
                if p < nparts:  # 2. reduce part p
                    mine = chunk(x, p, a)
                    await common.reduce_off_loop(dom, mine.nbytes * k, mine, [chunk(slots[q], p, a) for q in others],
                                                 mine, op)
                    reduced[p].set_result(None)
                if p:  # spread part p-1
                    await crossed[p - 1]
                    await common.copy_off_loop(dom, x.nbytes // (k * nparts), [(chunk(slots[a], p - 1, a),
                                                                                 chunk(x, p - 1, a))])
                    dom.post(comm, 2 + p - 1)
                    await dom.wait_all(comm, 2 + p - 1)
                    await common.copy_off_loop(dom, x.nbytes // nparts, [(chunk(x, p - 1, c), chunk(slots[c], p - 1, c))
                                                                         for c in others], stream)

        await together(over_tcp(), in_host())


async def through_leaders(comm: Comm, x: np.ndarray, op: str, across: Callable) -> None:
    """Any hosts, one stage after the other: reduce over the host into the leader, ``across``
    among the leaders, the others copy the leader's result (the reference for the above)."""
    topology = comm.group.topology
    index = topology.node_of(comm.rank)
    local = topology.nodes[index]
    k, p = len(local), local.index(comm.rank)
    leaders = SubComm(comm, [members[0] for members in topology.nodes]) if p == 0 else None  # leaders only
    if k == 1:  # alone on my host: only the leaders' all_reduce
        await _across(leaders, x, op, across)
        return
    async with common.DomainCall(comm, list(local), 1 + index) as dom:  # index 0 is the flat domain's
        slots, chunk = await all_reduce_shm.scatter_reduce(comm, dom, x, op, p, k)  # over the host
        others = [c for c in range(k) if c != p]
        if p == 0:
            await dom.wait_all(comm, 2)  # the host's sum, gathered by the leader
            await common.copy_off_loop(dom, x.nbytes, [(chunk(x, c), chunk(slots[c], c)) for c in others])
            await _across(leaders, x, op, across)  # leaders over TCP
            await common.copy_off_loop(dom, x.nbytes, [(slots[0], x)])  # publish the result
            dom.post(comm, 3)
        else:
            await dom.wait_all(comm, 3, peers=[0])  # the leader's result
            await common.copy_off_loop(dom, x.nbytes, [(x, slots[0])])


async def _across(sub: SubComm, x: np.ndarray, op: str, across: Callable) -> None:
    """``across`` among ``sub`` (nothing to do for one host, or no element)."""
    if sub.size > 1 and x.size:
        await across(sub, x, op)
