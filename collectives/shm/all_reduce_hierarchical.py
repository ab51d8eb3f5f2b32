"""Hierarchical all_reduce for groups that span nodes: reduce inside each node over shared
memory, all_reduce across nodes over TCP among one leader per node, broadcast inside each node.

How it works (the group's ranks fall into nodes by ``runtime.nodes``; on each node the
**local** ranks are numbered 0..k-1 in group order and local rank 0 is the node's **leader**;
S_p = local rank p's data slot; x is cut into k chunks, chunk c owned by local rank c):

1. copy-in: S_p[c] = x[c] for every chunk c != p; post phase 1;
2. wait for every local peer's phase 1; reduce my chunk: x[p] <op>= S_q[p] for q != p in order;
   publish it, S_p[p] = x[p]; post phase 2;
3. leader: wait for every local phase 2; gather the node's sum: x[c] = S_c[c] for c != 0;
4. leaders only: all_reduce x among the leaders over TCP (the TCP table's algorithm, run on a
   sub-communicator of the call: same tag, same fingerprint checks);
5. leader: S_0 = x; post phase 3.  Others: wait for the leader's phase 3; x = S_0.

A node with one rank skips 1-3 and 5; a group on a single node is better served by
all_reduce_shm (this file is what it falls back to when the group spans nodes). Without shared
memory (``RINGWEAVE_SHM=0``), and for arrays up to FLAT_MAX_NBYTES (64 KiB), the whole group runs
the TCP table's algorithm instead.

Worked example, 4 ranks, nodes A = {0, 2} and B = {1, 3}, rank g contributes [g] (sum)::

    1-3  node A: leader 0 holds 0+2 = [2]     node B: leader 1 holds 1+3 = [4]
    4    leaders 0 and 1 all_reduce over TCP: both hold [6]
    5    rank 2 copies [6] from rank 0's slot; rank 3 from rank 1's

Signature: ``await run(comm, x, op)`` like collectives/all_reduce_ring.py.
"""

from __future__ import annotations

import numpy as np

from collectives.shm import all_reduce_shm, common

# Arrays up to this run the TCP table's algorithm over the whole group instead (recursive doubling
# there): three phases, two of them waits on shared memory, cost more than the flat algorithm's
# log2(n) rounds across hosts (bench/results/all_reduce.md#hierarchical-flat-path).
FLAT_MAX_NBYTES = 64 << 10


async def run(comm, x: np.ndarray, op: str) -> None:
    comm = comm if type(comm) is common.Link else common.Link(comm)  # all_reduce_shm's fallback: wrapped
    n = comm.size
    if n == 1:
        return
    nodes = None if x.nbytes <= FLAT_MAX_NBYTES else common.nodes_of(comm.group)
    if nodes is None or not common.shm_enabled(comm.group) or all(len(members) == 1 for members in nodes):
        return await common.tcp_algorithm("all_reduce", x.nbytes, n, common.host_layout(comm.group))(comm, x, op)
    index, local = next((i, m) for i, m in enumerate(nodes) if comm.rank in m)
    leaders = [members[0] for members in nodes]
    k, p = len(local), local.index(comm.rank)
    if k == 1:  # alone on my node: only the leaders' all_reduce
        await _across(comm, leaders, x, op)
        return
    async with common.session(comm, local, 1 + index) as dom:  # index 0 is the flat domain's
        slots, chunk = await all_reduce_shm.scatter_reduce(comm, dom, x, op, p, k)  # 1.-2. over the node
        others = [c for c in range(k) if c != p]
        if p == 0:
            await dom.wait_all(comm, 2)  # 3. the node's sum, gathered by the leader
            await common.copy_off_loop(dom, x.nbytes, [(chunk(x, c), chunk(slots[c], c)) for c in others])
            await _across(comm, leaders, x, op)  # 4. leaders over TCP
            await common.copy_off_loop(dom, x.nbytes, [(slots[0], x)])  # 5. publish the result
            dom.post(comm, 3)
        else:
            await dom.wait_all(comm, 3, peers=[0])  # 5. the leader's result
            await common.copy_off_loop(dom, x.nbytes, [(x, slots[0])])


async def _across(comm, leaders: list[int], x: np.ndarray, op: str) -> None:
    """All_reduce among the leaders over TCP (nothing to do with one node)."""
    if len(leaders) > 1:
        sub = common.SubComm(comm, leaders)
        # the leaders, one per host: the table's choice for ranks spread over hosts, whatever the
        # layout of the whole group
        await common.tcp_algorithm("all_reduce", x.nbytes, len(leaders), "spread")(sub, x, op)
