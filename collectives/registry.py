"""Which algorithm runs a collective: name -> function, and the default selection table.

Every collective has a table, an ordered list of :class:`Rule`; the first rule
whose ``applies(nbytes, world)`` holds names the algorithm (``nbytes`` is the
size of one rank's input, ``world`` the group size). Overrides, first wins:

1. ``algorithm="ring"`` on the call;
2. the environment, ``RINGWEAVE_ALGO_<COLLECTIVE>=<name>``, e.g.
   ``RINGWEAVE_ALGO_ALL_REDUCE=ring`` (read at each call);
3. the table.

Every rank must run the same algorithm, so its name is part of the call's
fingerprint (collectives/ops.py): a rank whose override differs gets a
``CollectiveMismatchError`` naming both choices, not a hang. The table itself
depends only on values that are already in the fingerprint (bytes, group
size) and on facts that are the same on every member (whether the group spans
hosts, ``Rule.hosts``; whether shared memory is usable), so ranks that agree on
the call agree on the table's choice.

Not here: the algorithms (one file each, ``collectives/<collective>_<name>.py``),
argument checks (ops.py), the public calls (api.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from runtime import env
from runtime.errors import SettingError

from collectives import (all_gather_bruck, all_gather_direct, all_gather_recursive_doubling, all_gather_ring,
                         all_gather_v_ring, all_reduce_halving_doubling, all_reduce_recursive_doubling,
                         all_reduce_ring, all_to_all_direct, all_to_all_v_direct, barrier_dissemination,
                         broadcast_chain, broadcast_flat, broadcast_tree, gather_direct, gather_tree, gather_v_direct,
                         reduce_rabenseifner, reduce_scatter_ring, reduce_tree, scatter_direct, scatter_tree,
                         scatter_v_direct)

ALGORITHMS: dict[str, dict[str, Callable]] = {
    "all_reduce": {"ring": all_reduce_ring.run,
                   "halving_doubling": all_reduce_halving_doubling.run,
                   "recursive_doubling": all_reduce_recursive_doubling.run},
    "all_gather": {"ring": all_gather_ring.run, "bruck": all_gather_bruck.run, "direct": all_gather_direct.run,
                   "recursive_doubling": all_gather_recursive_doubling.run},
    "reduce_scatter": {"ring": reduce_scatter_ring.run},
    "broadcast": {"tree": broadcast_tree.run, "flat": broadcast_flat.run, "chain": broadcast_chain.run},
    "reduce": {"tree": reduce_tree.run, "rabenseifner": reduce_rabenseifner.run},
    "gather": {"tree": gather_tree.run, "direct": gather_direct.run},
    "scatter": {"tree": scatter_tree.run, "direct": scatter_direct.run},
    "all_to_all": {"direct": all_to_all_direct.run},
    "barrier": {"dissemination": barrier_dissemination.run},
    # a count per rank (collectives/uneven.py)
    "all_gather_v": {"ring": all_gather_v_ring.run},
    "all_to_all_v": {"direct": all_to_all_v_direct.run},
    "gather_v": {"direct": gather_v_direct.run},
    "scatter_v": {"direct": scatter_v_direct.run},
}


@dataclass(frozen=True)
class Rule:
    """One row of a selection table: use ``algorithm`` when ``applies(nbytes, world)``, and,
    for a rule with ``hosts="several"``, only when the group spans more than one host (its
    messages cross a network; on one host TCP runs over loopback, where the kernel's copies,
    not any link, bound the time, and the best algorithm can differ). ``hosts="spread"`` and
    ``"packed"`` narrow that to a layout (collectives.shm.common.host_layout): every rank on a
    host of its own, or each host holding one contiguous run of ranks, several on at least one
    (the launcher's layout with ``-n K`` per node). ``why``: one line of reason and the
    measurement behind it (bench/results/)."""
    algorithm: str
    applies: Callable[[int, int], bool]
    why: str = ""
    hosts: str = "any"  # "any" | "several" | "spread" | "packed"

    def fits(self, layout: str) -> bool:
        """Whether the rule may apply to ranks laid out so on hosts (a host_layout)."""
        if self.hosts == "any":
            return True
        return layout != "one" if self.hosts == "several" else layout == self.hosts


def always(nbytes: int, world: int) -> bool:
    return True


def _pow2(world: int) -> bool:
    return world & (world - 1) == 0


# The default tables, first rule that applies wins. Sizes: nbytes is one rank's input (all_gather:
# its block, so the gathered output is nbytes * world). Figures: bench/results/<collective>.md.
TABLES: dict[str, list[Rule]] = {
    "all_reduce": [
        Rule("ring", lambda nbytes, world: nbytes >= 256 << 10, hosts="packed",
             why="crosses hosts twice a step, not K/2 arrays: bench/results/all_reduce.md#several-ranks-per-host"),
        Rule("recursive_doubling", lambda nbytes, world: nbytes <= (256 << 10 if world <= 4 else 64 << 10),
             why="log2(n) rounds of a small array: bench/results/all_reduce.md#where-recursive-doubling-hands-over"),
        Rule("ring", lambda nbytes, world: 8 <= world <= 16 and nbytes >= 4 << 20, hosts="several",
             why="link-bound at 8-16 ranks: bench/results/all_reduce.md#rings-across-hosts"),
        Rule("halving_doubling", lambda nbytes, world: _pow2(world) or nbytes <= 1 << 20,
             why="the bandwidth optimum in 2 log2(n) rounds: bench/results/all_reduce.md#re-measured-on-a-quiet-machine"),
        Rule("ring", always,  # halving-doubling's fold would send the array twice more
             why="other world sizes: bench/results/all_reduce.md#first-table-on-a-loaded-machine"),
    ],
    "all_gather": [
        Rule("ring", lambda nbytes, world: world >= 8 and nbytes * world >= 2 << 20, hosts="several",
             why="link-bound at 8+ ranks: bench/results/all_gather.md#across-hosts-at-8-and-16-ranks"),
        Rule("ring", lambda nbytes, world: nbytes * world >= 1 << 20, hosts="packed",
             why="a block crosses once per host, not per rank: bench/results/all_gather.md#several-ranks-per-host"),
        Rule("direct", lambda nbytes, world: world <= 8 and nbytes * world >= 1 << 20, hosts="spread",
             why="one message per peer across hosts: bench/results/all_gather.md#under-1-gbits-links-at-4-ranks"),
        Rule("recursive_doubling",
             lambda nbytes, world: world in (2, 4, 8) and nbytes * world <= (4 << 20 if world == 8 else 1 << 20),
             why="log2(n) messages straight into place: bench/results/all_gather.md#after-the-fast-path-took-1-mib"),
        Rule("direct", lambda nbytes, world: world <= 8,
             why="n-1 independent messages straight into place: bench/results/all_gather.md#at-6-and-8-ranks"),
        Rule("bruck", lambda nbytes, world: nbytes * world <= 1 << 20,
             why="ceil(log2 n) messages, not n-1: bench/results/all_gather.md#bruck-against-ring"),
        Rule("ring", always, why="bandwidth optimum, segmented: bench/results/all_gather.md#bruck-against-ring"),
    ],
    "reduce_scatter": [Rule("ring", always, why="bench/results/reduce_scatter.md#ring-blocks-on-the-fast-path")],
    "broadcast": [
        Rule("tree", lambda nbytes, world: 128 << 10 <= nbytes < 1 << 20, hosts="packed",
             why="crosses between hosts as seldom as the chain: bench/results/broadcast.md#several-ranks-per-host"),
        Rule("chain", lambda nbytes, world: nbytes >= (128 << 10 if world <= 8 else 512 << 10) and world <= 16,
             hosts="several", why="every link busy at once: bench/results/broadcast.md#chain-across-hosts"),
        Rule("flat", lambda nbytes, world: nbytes <= (64 << 10 if world <= 4 else 16 << 10) and world <= 8,
             why="one latency for every receiver: bench/results/broadcast.md#flat-at-6-and-8-ranks"),
        Rule("tree", always, why="the root sends log2(n) copies: bench/results/broadcast.md#chain-on-one-host"),
    ],
    "reduce": [
        Rule("tree", always, hosts="packed",
             why="one array between two hosts: bench/results/reduce.md#several-ranks-per-host"),
        Rule("rabenseifner", lambda nbytes, world: nbytes >= 1 << 20, hosts="several",
             why="the root's link carries (n-1)/n of the array: bench/results/reduce.md#rabenseifner-across-hosts"),
        Rule("rabenseifner", lambda nbytes, world: nbytes >= 16 << 20,
             why="the work spread over every rank: bench/results/reduce.md#rabenseifner-against-the-tree"),
        Rule("tree", always, why="log2(n) rounds: bench/results/reduce.md#tree-on-the-fast-path"),
    ],
    "gather": [
        Rule("direct", lambda nbytes, world: world <= 8 or nbytes >= 1 << 20,
             why="every block crosses once: bench/results/gather_scatter.md#direct-against-the-trees"),
        Rule("tree", always, why="log2(n) rounds for small blocks on 9+ ranks (not measured)"),
    ],
    "scatter": [
        Rule("direct", lambda nbytes, world: world <= 8 or nbytes >= 1 << 20,
             why="every block crosses once: bench/results/gather_scatter.md#direct-against-the-trees"),
        Rule("tree", always, why="log2(n) rounds for small blocks on 9+ ranks (not measured)"),
    ],
    "all_to_all": [Rule("direct", always, why="bench/results/all_to_all.md#rounds-of-sendrecv-against-posted-receives")],
    "barrier": [Rule("dissemination", always)],
    "all_gather_v": [Rule("ring", always, "one algorithm (not measured): bandwidth-optimal whatever the counts")],
    "all_to_all_v": [Rule("direct", always, "one algorithm (not measured), as all_to_all")],
    "gather_v": [Rule("direct", always, "one algorithm (not measured): a block per message to the root")],
    "scatter_v": [Rule("direct", always, "one algorithm (not measured): a block per message from the root")],
}


# -- shared memory (collectives/shm) ----------------------------------------------------------
# "shm" heads the tables of the collectives it serves, whenever RINGWEAVE_SHM is not "0" and
# /dev/shm is writable (the same on every rank of a node). The table cannot see the group, so
# the shm algorithms check the rest themselves (every rank the same way): a group spanning
# nodes runs all_reduce "hierarchical" (shm inside nodes, TCP among one leader per node) and the
# others the first non-shm rule below. Figures: bench/results/shm.md.
from collectives import shm as _shm  # noqa: E402  (after the tables it extends)
from runtime.shm import shm_usable as _shm_usable  # noqa: E402
from collectives.shm.common import host_layout as _host_layout  # noqa: E402

for _collective, _algorithms in _shm.ALGORITHMS.items():
    ALGORITHMS[_collective].update(_algorithms)
    TABLES[_collective].insert(0, Rule("shm", lambda nbytes, world: _shm_usable(),
                                       why="one copy in, one copy out: bench/results/shm.md#beside-openmpi"))


def env_var(collective: str) -> str:
    """The variable that overrides ``collective``'s table (runtime/env.py ``ALGO``)."""
    return env.ALGO[collective].name


def choose(collective: str, nbytes: int, world: int, override: str | None = None,
           group=None) -> tuple[str, Callable]:
    """The algorithm (name, run function) for one call. ``group``, when given, may
    rule the shared-memory path out (``group.shm_enabled`` False: a communicator
    built with ``shm=False``).

    Raises:
        ValueError: an unknown collective, or an override naming an algorithm
            that does not exist (a SettingError when the environment names it);
            the message lists the ones that do.
    """
    algorithms = ALGORITHMS.get(collective)
    if algorithms is None:
        raise ValueError(f"unknown collective {collective!r}; known: {sorted(ALGORITHMS)}")
    from_env = override is None
    if from_env:
        override = env.ALGO.get(collective)
    if override is not None:
        fn = algorithms.get(override)
        if fn is None:
            error = SettingError if from_env else ValueError
            where = f"environment variable {env_var(collective)}=" if from_env else "algorithm="
            raise error(f"{where}{override!r} is not a {collective} algorithm; choose from {sorted(algorithms)}")
        return override, fn
    shm_off = (group is not None and not getattr(group, "shm_enabled", True)) or not _shm_usable()
    return _chosen(collective, nbytes, world, shm_off, _host_layout(group) if group is not None else "one")


def spans_hosts(group) -> bool:
    """Whether the group's members are on more than one host (the same on every member)."""
    return _host_layout(group) != "one"


def _chosen(collective: str, nbytes: int, world: int, shm_off: bool, layout: str) -> tuple[str, Callable]:
    """:func:`_from_table`, remembered (_CHOSEN)."""
    key = (collective, nbytes, world, shm_off, layout)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        chosen = _from_table(collective, nbytes, world, shm_off, layout)
        if len(_CHOSEN) > 4096:
            _CHOSEN.clear()
        _CHOSEN[key] = chosen
    return chosen


def _from_table(collective: str, nbytes: int, world: int, shm_off: bool, layout: str) -> tuple[str, Callable]:
    """The first rule that applies; ``layout`` is the group's host_layout ("one" without a group)."""
    for rule in TABLES[collective]:
        if (shm_off and rule.algorithm == "shm") or not rule.fits(layout):
            continue
        if rule.applies(nbytes, world):
            return rule.algorithm, ALGORITHMS[collective][rule.algorithm]
    raise ValueError(f"no {collective} algorithm applies to {nbytes} bytes on {world} ranks")  # pragma: no cover


def first_tcp_rule(collective: str, nbytes: int, world: int, layout: str = "one") -> tuple[str, Callable]:
    """The algorithm (name, run function) of the first rule of ``collective``'s table that
    applies and is not the shared-memory one: the table's choice with shm ruled out, ignoring
    overrides. For calls that must run over TCP (compressed.py's sub-calls, whose order is not
    the order they run in) and for the shm algorithms' fallback (collectives/shm/common.py).
    ``layout``: how the ranks that will run it sit on hosts (collectives.shm.common.host_layout;
    default one host), which decides whether the rules with ``Rule.hosts`` apply.

    Raises:
        ValueError: no such rule (not with the default tables: each ends with one that always applies).
    """
    return _chosen(collective, nbytes, world, True, layout)


# (collective, nbytes, world, shm ruled out, layout) -> the table's choice. The rules are pure
# functions of those, the shared-memory one of RINGWEAVE_SHM and /dev/shm (read per call into "shm
# ruled out"): a training loop's calls repeat, and a look-up is cheaper than walking the lambdas
# (bench/results/runtime.md#choosing-from-the-table). The tables are fixed at import; code that
# edits them afterwards must call _CHOSEN.clear().
_CHOSEN: dict[tuple, tuple[str, Callable]] = {}
