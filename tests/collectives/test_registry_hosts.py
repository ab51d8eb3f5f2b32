"""The selection table's rules for groups that span hosts (Rule.hosts == "several"): across
hosts, where links bound the time, the broadcast takes the pipelined chain, the reduce
Rabenseifner from 1 MiB, all_gather direct from 1 MiB gathered with one rank per host (ring
with several per host, and from 2 MiB at 8 ranks and more) and all_reduce ring from 4 MiB at 8-16 ranks (from 256 KiB with several ranks per host); one host's loopback keeps its own
choices (figures in bench/results/)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from collectives import registry
from runtime.topology import HostTopology


def group_on(nodes: str):
    """A stand-in group whose rank i is on host nodes[i] (what registry.choose reads of a group)."""
    return SimpleNamespace(topology=HostTopology.of(nodes), size=len(nodes), shm_enabled=True)


@pytest.mark.parametrize("shm", ["0", "1"])
def test_broadcast_takes_the_chain_only_across_hosts(monkeypatch, shm):
    monkeypatch.setenv("RINGWEAVE_SHM", shm)
    two_hosts, one_host = group_on("abab"), group_on("aaaa")
    assert not two_hosts.topology.one_host and one_host.topology.one_host

    def tcp(collective, nbytes, world, group=None):  # the table's choice without shared memory, by hosts
        return registry.choose(collective, nbytes, world, group=group, subcall=True)

    assert tcp("broadcast", 128 << 10, 4, two_hosts)[0] == "chain"
    assert tcp("broadcast", 64 << 10, 4, two_hosts)[0] == "flat"       # below the chain's sizes
    assert tcp("broadcast", 16 << 20, 8, group_on("ab" * 4))[0] == "chain"
    assert tcp("broadcast", 512 << 10, 16, group_on("ab" * 8))[0] == "chain"
    assert tcp("broadcast", 256 << 10, 16, group_on("ab" * 8))[0] == "tree"  # 9-16 ranks: from 512 KiB
    assert tcp("broadcast", 16 << 20, 17, group_on("ab" * 8 + "a"))[0] == "tree"  # more ranks: not measured
    assert tcp("broadcast", 1 << 20, 4, one_host)[0] == "tree"
    assert tcp("broadcast", 1 << 20, 4)[0] == "tree"                    # no group: one host
    # the default table: across hosts the chain, shared memory or not ("shm" needs one host); on
    # one host "shm" when shared memory is on
    assert registry.choose("broadcast", 1 << 20, 4, group=two_hosts) == ("chain", registry.ALGORITHMS["broadcast"]["chain"])
    assert registry.choose("broadcast", 1 << 20, 4, group=one_host)[0] == ("tree" if shm == "0" else "shm")
    # reduce: Rabenseifner from 1 MiB across hosts, from 16 MiB on one
    assert tcp("reduce", 1 << 20, 4, two_hosts)[0] == "rabenseifner"
    assert tcp("reduce", 1 << 20, 4, one_host)[0] == "tree"
    assert tcp("reduce", 16 << 20, 4, one_host)[0] == "rabenseifner"
    # ... with several ranks per host in runs: the tree at every size; broadcast's tree to 1 MiB
    assert tcp("reduce", 1 << 20, 4, group_on("aabb"))[0] == "tree"
    assert tcp("reduce", 64 << 20, 8, group_on("aaaabbbb"))[0] == "tree"
    assert tcp("broadcast", 512 << 10, 4, group_on("aabb"))[0] == "tree"
    assert tcp("broadcast", 1 << 20, 4, group_on("aabb"))[0] == "chain"
    assert tcp("broadcast", 64 << 10, 4, group_on("aabb"))[0] == "flat"
    # all_gather from 1 MiB gathered across hosts: direct with one rank per host, ring with each
    # host's ranks in one run (the launcher's layout); interleaved ranks keep the one-host choice
    four_hosts, packed = group_on("abcd"), group_on("aabb")
    assert [g.topology.layout for g in (one_host, four_hosts, packed, two_hosts)] == \
        ["one", "spread", "packed", "mixed"]
    assert tcp("all_gather", 256 << 10, 4, four_hosts)[0] == "direct"
    assert tcp("all_gather", 256 << 10, 4, packed)[0] == "ring"
    assert tcp("all_gather", 256 << 10, 4, two_hosts)[0] == "recursive_doubling"
    assert tcp("all_gather", 256 << 10, 4, one_host)[0] == "recursive_doubling"
    assert tcp("all_gather", 64 << 10, 4, four_hosts)[0] == "recursive_doubling"
    assert tcp("all_gather", 64 << 10, 4, packed)[0] == "recursive_doubling"
    assert tcp("all_gather", 1 << 20, 8, group_on("aaaabbbb"))[0] == "ring"
    # ... and at 8 ranks direct from 1 MiB gathered, ring from 2 MiB (recursive doubling to 4 MiB on one)
    eight_hosts, eight_on_one = group_on("abcdefgh"), group_on("a" * 8)
    assert tcp("all_gather", 128 << 10, 8, eight_hosts)[0] == "direct"
    assert tcp("all_gather", 256 << 10, 8, eight_hosts)[0] == "ring"
    assert tcp("all_gather", 256 << 10, 8, eight_on_one)[0] == "recursive_doubling"
    assert tcp("all_gather", 64 << 10, 8, eight_hosts)[0] == "recursive_doubling"
    # all_reduce: ring from 4 MiB across hosts at 8-16 ranks; halving-doubling at 4 ranks and on one host
    assert tcp("all_reduce", 4 << 20, 8, eight_hosts)[0] == "ring"
    assert tcp("all_reduce", 4 << 20, 16, group_on("ab" * 8))[0] == "ring"
    assert tcp("all_reduce", 2 << 20, 8, eight_hosts)[0] == "halving_doubling"
    assert tcp("all_reduce", 4 << 20, 8, eight_on_one)[0] == "halving_doubling"
    assert tcp("all_reduce", 64 << 20, 4, two_hosts)[0] == "halving_doubling"
    assert tcp("all_reduce", 64 << 20, 32, group_on("ab" * 16))[0] == "halving_doubling"  # not measured
    # ... and from 256 KiB with several ranks per host in runs (recursive doubling below)
    assert tcp("all_reduce", 256 << 10, 4, group_on("aabb"))[0] == "ring"
    assert tcp("all_reduce", 1 << 20, 8, group_on("aaaabbbb"))[0] == "ring"
    assert tcp("all_reduce", 128 << 10, 4, group_on("aabb"))[0] == "recursive_doubling"
    assert tcp("all_reduce", 1 << 20, 4, group_on("abcd"))[0] == "halving_doubling"
    # every other collective: the same on one host and across hosts
    for collective in registry.TABLES:
        if collective not in ("broadcast", "reduce", "all_gather"):
            for nbytes in (4, 1 << 20, 64 << 20):
                assert tcp(collective, nbytes, 4, two_hosts) == tcp(collective, nbytes, 4, one_host)
