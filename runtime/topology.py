"""How a group's ranks sit on hosts: :class:`HostTopology`, a pure value worked out from the node
id of every member.

Every rank publishes its node id with its address at init (runtime/init.py); the RankRuntime keeps
them (``RankRuntime.nodes``, by world rank) and each ProcessGroup works its topology out once, when
first asked (``ProcessGroup.topology``). Every member sees the same ids, hence the same topology:
algorithms and the selection table may branch on it without any rank disagreeing.

    >>> HostTopology.of(["a", "b", "a", "b"]).nodes   # ranks of each node, nodes by lowest rank
    ((0, 2), (1, 3))
    >>> HostTopology.of(["a", "a", "b", "b"]).layout
    'packed'

Not here: what the collectives do with it (collectives/registry.py, collectives/algorithms/shared_memory/).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAYOUTS", "HostTopology"]

# "one": a single host; "spread": every rank on a host of its own; "packed": several hosts, each
# holding one contiguous run of ranks, at least one of them more than one rank (the launcher's
# layout with -n K per node); "mixed": the rest (several hosts, ranks interleaved).
LAYOUTS = ("one", "spread", "packed", "mixed")


@dataclass(frozen=True)
class HostTopology:
    """The hosts of a group's ranks (group ranks 0..size-1)."""

    node_ids: tuple[str, ...]  # the node id of each rank, e.g. ("a", "b", "a", "b")
    nodes: tuple[tuple[int, ...], ...]  # the ranks of each node, nodes in order of their lowest rank
    layout: str  # one of LAYOUTS
    hosts: int  # how many hosts the ranks are on (len(nodes)): read at every call's choice

    @classmethod
    def of(cls, node_ids) -> "HostTopology":
        """The topology of ranks whose node ids are ``node_ids`` (one per rank, in rank order)."""
        ids = tuple(str(n) for n in node_ids)
        order: dict[str, list[int]] = {}
        runs = 0  # maximal runs of consecutive ranks on one node
        for r, node in enumerate(ids):
            order.setdefault(node, []).append(r)
            runs += r == 0 or node != ids[r - 1]
        hosts = len(order)
        layout = ("one" if hosts <= 1 else "spread" if hosts == len(ids) else "packed" if runs == hosts
                  else "mixed")
        return cls(ids, tuple(tuple(ranks) for ranks in order.values()), layout, hosts)

    @property
    def one_host(self) -> bool:
        """Whether every rank is on one host."""
        return self.layout == "one"

    def node_of(self, rank: int) -> int:
        """The index in :attr:`nodes` of ``rank``'s node."""
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)
