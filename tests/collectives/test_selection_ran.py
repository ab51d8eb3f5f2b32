"""The algorithm a call names is the algorithm that ran: what ``registry.choose`` returns is what
runs, and the call's fingerprint and trace carry its name, whether the table chose it, the
caller asked for one that cannot run there (shared memory across hosts, shared memory switched
off), or the hierarchical all_reduce serves a group that spans hosts.

Each case checks the answer against the closed form and the trace event of every rank: its
``algorithm`` and the fingerprint (``op``) ending in ``algo=<that name>``.
"""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives import registry
from runtime.sharedmem import segments

pytestmark = pytest.mark.timeout(120)
SHM_ON = segments.shm_usable()  # the suite also runs with RINGWEAVE_SHM=0
BIG = 100_003  # float32 elements: over the hierarchical rule's 64 KiB


def ran(g) -> list[tuple[str, str]]:
    """(collective, algorithm) of every traced call, checked against the fingerprint's ``algo=``."""
    out = []
    for e in g.runtime.tracer.events:
        fingerprint, algorithm = e["args"]["op"], e["args"]["algorithm"]
        assert fingerprint.split(" algo=", 1)[1].split(" ", 1)[0] == algorithm, e["args"]
        out.append((e["name"], algorithm))
    return out


async def test_across_hosts_the_trace_names_the_hierarchical_or_the_tcp_algorithm(ranks, tmp_path):
    """Hosts A B A B: ``algorithm="shm"`` cannot run (it needs one host), so the table's choice
    runs and is named: recursive doubling for a small array, the hierarchical all_reduce for a
    large one (shared memory on) or the TCP table's choice (off); broadcast's and barrier's TCP
    algorithms likewise. Before, all of these were traced and fingerprinted as "shm"."""
    async def body(g):
        g.runtime.nodes = list("ABAB")
        tcp = {c: registry.choose(c, nbytes, 4, group=g, subcall=True)[0]  # the TCP table, these hosts
               for c, nbytes in (("all_reduce", BIG * 4), ("broadcast", 8000))}
        g.runtime.tracer.out_dir = str(tmp_path)
        small, big = np.full(16, g.rank + 1.0, np.float32), np.full(BIG, g.rank + 1.0, np.float32)
        await C.all_reduce(small, group=g, algorithm="shm")
        await C.all_reduce(big, group=g, algorithm="shm")
        b = np.arange(1000, dtype=np.float64) * (g.rank == 0)
        await C.broadcast(b, src=0, group=g, algorithm="shm")
        await C.barrier(group=g)
        np.testing.assert_array_equal(small, 10.0)
        np.testing.assert_array_equal(big, 10.0)
        np.testing.assert_array_equal(b, np.arange(1000))
        return ran(g), tcp
    for names, tcp in await ranks(4, body, transport="tcp"):
        assert names == [("all_reduce", "recursive_doubling"),
                         ("all_reduce", "hierarchical" if SHM_ON else tcp["all_reduce"]),
                         ("broadcast", tcp["broadcast"]), ("barrier", "dissemination")], names


@pytest.mark.parametrize("how", ["group", "environment"])
async def test_shared_memory_off_the_trace_names_the_tcp_algorithm(ranks, tmp_path, monkeypatch, how):
    """One host, shared memory switched off (a group's ``shm_enabled``, or ``RINGWEAVE_SHM=0``):
    the default all_reduce and an explicit ``algorithm="shm"`` run the TCP table's choice and
    are named so (before: "shm", which then fell back by itself)."""
    if how == "environment":
        monkeypatch.setenv("RINGWEAVE_SHM", "0")

    async def body(g):
        if how == "group":
            g.shm_enabled = False
        g.runtime.tracer.out_dir = str(tmp_path)
        for algorithm in (None, "shm"):
            x = np.full(1000, g.rank + 1.0, np.float32)
            await C.all_reduce(x, group=g, algorithm=algorithm)
            np.testing.assert_array_equal(x, 1.0 + 2.0 + 3.0)
        await C.all_gather(np.empty(3 * 5, np.int64), np.full(5, g.rank), group=g)
        return ran(g)
    for names in await ranks(3, body, transport="tcp"):
        assert names == [("all_reduce", "recursive_doubling")] * 2 + [("all_gather", "direct")], names
