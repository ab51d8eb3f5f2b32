"""Hierarchical all_reduce for groups that span hosts: reduce inside each host over shared
memory, all_reduce across hosts over TCP among one leader per host, broadcast inside each host.

How it works (the group's ranks fall into hosts by ``group.topology.nodes``; on each host the
**local** ranks are numbered 0..k-1 in group order and local rank 0 is the host's **leader**;
S_p = local rank p's data slot; x is cut into k chunks, chunk c owned by local rank c):

1. copy-in: S_p[c] = x[c] for every chunk c != p; post phase 1;
2. wait for every local peer's phase 1; reduce my chunk: x[p] <op>= S_q[p] for q != p in order;
   publish it, S_p[p] = x[p]; post phase 2;
3. leader: wait for every local phase 2; gather the host's sum: x[c] = S_c[c] for c != 0;
4. leaders only: all_reduce x among the leaders over TCP (``across``: the algorithm the table
   chooses for one rank per host, run on a SubComm of the call: same tag, same fingerprint checks);
5. leader: S_0 = x; post phase 3.  Others: wait for the leader's phase 3; x = S_0.

A host with one rank skips 1-3 and 5. The registry runs it where shared memory is on; its table
picks it for arrays over 64 KiB when some host holds several of the group's ranks (below, the
flat TCP algorithm is faster: bench/results/all_reduce.md#hierarchical-flat-path). On a single
host it works too (one leader, nothing across), though all_reduce_shm serves that better.

Worked example, 4 ranks, hosts A = {0, 2} and B = {1, 3}, rank g contributes [g] (sum)::

    1-3  host A: leader 0 holds 0+2 = [2]     host B: leader 1 holds 1+3 = [4]
    4    leaders 0 and 1 all_reduce over TCP: both hold [6]
    5    rank 2 copies [6] from rank 0's slot; rank 3 from rank 1's

Signature: ``await run(comm, x, op, across)`` like tcp/all_reduce_ring.py, plus
``across``, the leaders' all_reduce (``run(comm, x, op)``), which the registry binds.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from collectives.comm import Comm, SubComm
from collectives.algorithms.shared_memory import all_reduce_shm
from collectives.slots import common

async def run(comm: Comm, x: np.ndarray, op: str, across: Callable) -> None:
    n = comm.size
    if n == 1:
        return
    topology = comm.group.topology
    index = topology.node_of(comm.rank)
    local = topology.nodes[index]
    leaders = [members[0] for members in topology.nodes]
    k, p = len(local), local.index(comm.rank)
    if k == 1:  # alone on my host: only the leaders' all_reduce
        await _across(comm, leaders, x, op, across)
        return
    async with common.DomainCall(comm, local, 1 + index) as dom:  # index 0 is the flat domain's
        slots, chunk = await all_reduce_shm.scatter_reduce(comm, dom, x, op, p, k)  # 1.-2. over the host
        others = [c for c in range(k) if c != p]
        if p == 0:
            await dom.wait_all(comm, 2)  # 3. the host's sum, gathered by the leader
            await common.copy_off_loop(dom, x.nbytes, [(chunk(x, c), chunk(slots[c], c)) for c in others])
            await _across(comm, leaders, x, op, across)  # 4. leaders over TCP
            await common.copy_off_loop(dom, x.nbytes, [(slots[0], x)])  # 5. publish the result
            dom.post(comm, 3)
        else:
            await dom.wait_all(comm, 3, peers=[0])  # 5. the leader's result
            await common.copy_off_loop(dom, x.nbytes, [(x, slots[0])])


async def _across(comm: Comm, leaders: list[int], x: np.ndarray, op: str, across: Callable) -> None:
    """All_reduce among the leaders over TCP (nothing to do with one host)."""
    if len(leaders) > 1:
        await across(SubComm(comm, leaders), x, op)
