"""Hierarchical reduce_scatter for groups that span hosts: each host reduces in shared memory what it
sends, so a block crosses into its rank's host once from every other host, as that host's partial.

How it works (hosts, (i, a), k_i, parts and ``Plan`` as in all_gather_hierarchical; x holds n blocks
of m elements, block g goes to rank g reduced over every rank; (i, a) **serves** the blocks (j, b)
of every other host j with b mod k_i = a; S_q = local rank q's data slot, laid out as x):

1. part p of every block that another rank of my host serves or owns: S_a[g, p] = x[g, p];
   post phase 1 + p;
2. once every local peer posted 1 + p: for each block g I serve, S_a[g, p] = x[g, p] <op> S_q[g, p]
   for the other local ranks q in order (my host's partial), which leaves for rank g; and
   out[p] = x[r, p] <op> S_q[r, p] likewise (my host's partial of my block);
3. from the rank (j, a mod k_j) of every other host j, the one that serves my block, that host's
   partial: out[p] <op>= it as part p arrives, hosts in turn from mine + 1.

Each host's link carries into the host one partial of each of its blocks from every other host,
and as much out: (H-1)/H of x each way when the hosts hold as many ranks (the flat ring over every
rank: (n-1)/n). A part's partials leave while the next part is reduced, and arrive while the
rest leaves. Hosts of unequal sizes work too; a rank alone on its host sends x's blocks as they are.

Worked example, sum, hosts A = {0, 1} and B = {2, 3}, x = [g, g, g, g] on rank g (blocks of 1)::

    1-2  A: rank 0 serves block 2, 0+1 = 1 -> rank 2; rank 1 serves block 3, 1 -> rank 3;
            out_0 = out_1 = 0+1 = 1.  B: 2+3 = 5 -> ranks 0 and 1; out_2 = out_3 = 5
    3    out_0 = out_1 = 1+5 = 6, out_2 = out_3 = 5+1 = 6

Signature: ``await run(comm, out, x, op)`` like tcp/reduce_scatter_ring.py.
"""

from __future__ import annotations

import asyncio

import numpy as np

from collectives import tunefile
from collectives.algorithms.shared_memory.all_gather_hierarchical import Plan, send_parts, together
from collectives.comm import Comm, copy_step, reduce_step
from collectives.ops import as_bytes, scratch_pool
from collectives.slots import common


async def run(comm: Comm, out: np.ndarray, x: np.ndarray, op: str) -> None:
    n, r, m = comm.size, comm.rank, out.size
    if n == 1:
        np.copyto(out, x)
        return
    if m == 0:
        return
    plan = Plan(comm, m, x.itemsize)
    local, a, bounds = plan.local, plan.a, plan.bounds
    served = [g for g in plan.remote if plan.keeper[g] == a]

    def part(buf: np.ndarray, g: int, p: int) -> np.ndarray:
        """Part p of block g of ``buf`` (laid out as x)."""
        return buf[g * m + bounds[p]:g * m + bounds[p + 1]]

    nbytes = len(plan.to) * m * x.itemsize
    raw = scratch_pool.take(nbytes)  # the other hosts' partials of my block, [host]
    theirs = raw[:nbytes].view(x.dtype).reshape(len(plan.to), m)
    arriving = [[comm.irecv(src, as_bytes(theirs[s, bounds[p]:bounds[p + 1]])) for s, src in enumerate(plan.to)]
                for p in plan.parts]

    async def fold() -> None:  # 3.
        for p, futures in enumerate(arriving):
            for s, fut in enumerate(futures):
                await fut
                await reduce_step(out[bounds[p]:bounds[p + 1]], theirs[s, bounds[p]:bounds[p + 1]], op)

    if len(local) == 1:  # alone on my host: my blocks are my host's partials
        await copy_step(out, x[r * m:(r + 1) * m])
        sends = [[(g, as_bytes(part(x, g, p))) for g in served] for p in plan.parts]
        await together(send_parts(comm, sends), fold())
        scratch_pool.give(raw)
        return
    async with common.DomainCall(comm, list(local), 1 + plan.h) as dom:  # index 0 is the flat domain's
        await dom.claim_data(comm, x.nbytes)
        slots = [common.data_view(dom, q, x.dtype, x.size) for q in range(len(local))]
        peers = [q for q in range(len(local)) if q != a]
        copy_in = [g for g in range(n) if plan.keeper[g] != a]  # what my peers reduce
        ready = [asyncio.get_running_loop().create_future() for _ in plan.parts]  # partials of part p made
        stream = x.nbytes >= tunefile.stream_min(comm.group)  # the copies bypass the caches

        async def reduce_parts() -> None:
            for p in plan.parts:
                await common.copy_off_loop(dom, x.nbytes, [(part(slots[a], g, p), part(x, g, p)) for g in copy_in],
                                           stream)  # 1.
                dom.post(comm, 1 + p)
                await dom.wait_all(comm, 1 + p)
                for g in served:  # 2. my host's partials, in my slot
                    dst = part(slots[a], g, p)
                    await common.reduce_off_loop(dom, dst.nbytes * len(local), dst,
                                                 [part(slots[q], g, p) for q in peers], dst, op, first=part(x, g, p))
                ready[p].set_result(None)
                dst = out[bounds[p]:bounds[p + 1]]
                await common.reduce_off_loop(dom, dst.nbytes * len(local), dst,
                                             [part(slots[q], r, p) for q in peers], dst, op, first=part(x, r, p))
            await fold()

        async def send_ready() -> None:
            for p in plan.parts:
                await ready[p]
                for g in served:
                    await comm.send(g, as_bytes(part(slots[a], g, p)))

        await together(send_ready(), reduce_parts())
    scratch_pool.give(raw)  # only after success: a failed call may still have frames landing in it
