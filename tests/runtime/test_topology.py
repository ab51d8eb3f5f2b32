"""A group's host topology (runtime/topology.py): worked out from the node ids of its members, the
same on every member, again when the runtime is given other ids."""

from __future__ import annotations

import pytest

from runtime.topology import HostTopology


@pytest.mark.parametrize("ids, nodes, layout", [
    ("aaaa", [[0, 1, 2, 3]], "one"),
    ("abcd", [[0], [1], [2], [3]], "spread"),
    ("aabbb", [[0, 1], [2, 3, 4]], "packed"),
    ("abab", [[0, 2], [1, 3]], "mixed"),
    ("aaba", [[0, 1, 3], [2]], "mixed"),  # node a in two runs
    ("", [], "one"),
])
def test_layouts(ids, nodes, layout):
    t = HostTopology.of(list(ids))
    assert [list(n) for n in t.nodes] == nodes and t.layout == layout and t.hosts == len(nodes)
    assert t.one_host == (layout == "one")
    for i, members in enumerate(nodes):
        assert all(t.node_of(r) == i for r in members)


async def test_groups_follow_their_runtimes_node_ids(ranks):
    async def body(g):
        sub = g.new_group([1, 2, 3])
        assert g.topology.layout == "one" and sub.topology.layout == "one"  # tasks of one process
        g.runtime.nodes = ["x", "y", "x", "y"]
        assert (g.topology.layout, sub.topology.layout) == ("mixed", "mixed")
        assert [list(n) for n in sub.topology.nodes] == [[0, 2], [1]]  # group ranks 0..2 = world 1..3
        with pytest.raises(ValueError, match="3 node ids for a world of 4"):
            g.runtime.nodes = ["x", "y", "z"]
        return g.topology
    topologies = await ranks(4, body)
    assert len(set(topologies)) == 1  # the same on every member
