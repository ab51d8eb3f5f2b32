"""Which algorithm runs a collective: name -> function, and the default selection table.

Every collective has a table, an ordered list of :class:`Rule`; the first rule that fits the
group's hosts (``Rule.hosts``) and whose ``applies(nbytes, world)`` holds names the algorithm
(``nbytes`` is the size of one rank's input, ``world`` the group size). Overrides, first wins:

1. ``algorithm="ring"`` on the call;
2. the environment, ``RINGWEAVE_ALGO_<COLLECTIVE>=<name>``, e.g.
   ``RINGWEAVE_ALGO_ALL_REDUCE=ring`` (read at each call);
3. the rules file ``python -m collectives.tune`` wrote for this machine and layout
   (collectives/tunefile.py; ``RINGWEAVE_TUNE=0`` turns it off);
4. the table.

Some algorithms can run only somewhere (:data:`NEEDS`): the shared-memory ones need it on, and
"shm" every rank on one host. The table skips them elsewhere, and an override naming one there
gets the table's choice instead. :func:`choose` is the one way in; what it returns is what runs,
so the call's fingerprint and trace name it.

Every rank must run the same algorithm, so its name is part of the call's fingerprint
(collectives/ops.py): a rank whose override differs gets a ``CollectiveMismatchError`` naming
both choices, not a hang. The table depends only on values that are already in the fingerprint
(bytes, group size) and on facts that are the same on every member (the group's
``topology``, whether shared memory is on: agreed at init), so ranks that agree on the call
agree on the table's choice.

Not here: the algorithms (one file each, ``collectives/algorithms/tcp/<collective>_<name>.py`` and
``collectives/algorithms/shared_memory/``), argument checks (ops.py), opening the call (calls.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from runtime import env
from runtime.errors import SettingError
from runtime.sharedmem.segments import shm_usable
from runtime.topology import LAYOUTS

from collectives import tunefile
from collectives.algorithms.shared_memory import (all_gather_hierarchical, all_gather_shm, all_reduce_hierarchical,
                                                  all_reduce_shm, barrier_shm, broadcast_shm,
                                                  reduce_scatter_hierarchical, reduce_scatter_shm)
from collectives.algorithms.tcp import (all_gather_bruck, all_gather_direct, all_gather_recursive_doubling,
                                        all_gather_ring, all_gather_v_ring, all_reduce_halving_doubling,
                                        all_reduce_recursive_doubling, all_reduce_ring, all_to_all_direct,
                                        all_to_all_v_direct, barrier_dissemination, broadcast_chain, broadcast_flat,
                                        broadcast_tree, gather_direct, gather_tree, gather_v_direct,
                                        reduce_rabenseifner, reduce_scatter_ring, reduce_tree, scan_recursive_doubling,
                                        scatter_direct, scatter_tree, scatter_v_direct)

__all__ = ["ALGORITHMS", "HOSTS", "NEEDS", "TABLES", "Rule", "always", "choose", "env_var"]

ALGORITHMS: dict[str, dict[str, Callable]] = {
    "all_reduce": {"ring": all_reduce_ring.run,
                   "halving_doubling": all_reduce_halving_doubling.run,
                   "recursive_doubling": all_reduce_recursive_doubling.run,
                   "shm": all_reduce_shm.run, "hierarchical": all_reduce_hierarchical.run},
    "all_gather": {"ring": all_gather_ring.run, "bruck": all_gather_bruck.run, "direct": all_gather_direct.run,
                   "recursive_doubling": all_gather_recursive_doubling.run, "shm": all_gather_shm.run,
                   "hierarchical": all_gather_hierarchical.run},
    "reduce_scatter": {"ring": reduce_scatter_ring.run, "shm": reduce_scatter_shm.run,
                       "hierarchical": reduce_scatter_hierarchical.run},
    "broadcast": {"tree": broadcast_tree.run, "flat": broadcast_flat.run, "chain": broadcast_chain.run,
                  "shm": broadcast_shm.run},
    "reduce": {"tree": reduce_tree.run, "rabenseifner": reduce_rabenseifner.run},
    "gather": {"tree": gather_tree.run, "direct": gather_direct.run},
    "scatter": {"tree": scatter_tree.run, "direct": scatter_direct.run},
    "all_to_all": {"direct": all_to_all_direct.run},
    "barrier": {"dissemination": barrier_dissemination.run, "shm": barrier_shm.run},
    # a count per rank (collectives/uneven.py)
    "all_gather_v": {"ring": all_gather_v_ring.run},
    "all_to_all_v": {"direct": all_to_all_v_direct.run},
    "gather_v": {"direct": gather_v_direct.run},
    "scatter_v": {"direct": scatter_v_direct.run},
    "scan": {"recursive_doubling": scan_recursive_doubling.run},  # scan and exscan (collectives/prefix.py)
}


@dataclass(frozen=True)
class Rule:
    """One row of a selection table: use ``algorithm`` when ``applies(nbytes, world)`` and the
    group's ranks sit on hosts as ``hosts`` says (``ProcessGroup.topology.layout``, see
    runtime/topology.py): "any"; "one" host; "several" hosts (messages cross a network: on one
    host TCP runs over loopback, where the kernel's copies, not any link, bound the time);
    "spread" (a host per rank), "packed" (each host one contiguous run of ranks, the launcher's
    layout) or "grouped" (several hosts, some with several ranks: packed or mixed). ``why``: one
    line of reason and the measurement behind it (bench/results/)."""
    algorithm: str
    applies: Callable[[int, int], bool]
    why: str = ""
    hosts: str = "any"  # a key of HOSTS

    def fits(self, layout: str) -> bool:
        """Whether the rule may apply to ranks laid out so on hosts (a topology's layout)."""
        return layout in HOSTS[self.hosts]


HOSTS = {"any": LAYOUTS, "one": ("one",), "several": ("spread", "packed", "mixed"), "spread": ("spread",),
         "packed": ("packed",), "grouped": ("packed", "mixed")}

# Where an algorithm can run at all, (shared memory on, layout) -> bool; the rest run anywhere.
NEEDS: dict[str, Callable[[bool, str], bool]] = {
    "shm": lambda shm, layout: shm and layout == "one",  # every rank maps every peer's segments
    "hierarchical": lambda shm, layout: shm,  # shared memory inside each host, TCP between hosts
}


def always(nbytes: int, world: int) -> bool:
    return True


def _pow2(world: int) -> bool:
    return world & (world - 1) == 0


# The default tables, first rule that applies wins. Sizes: nbytes is one rank's input (all_gather:
# its block, so the gathered output is nbytes * world). Figures: bench/results/<collective>.md.
SHM = "one copy in, one copy out: bench/results/shm.md#beside-openmpi"
GRID = "bench/results/machine-c2-m24g-amd-epyc-nogpu.md (the default grid's rows over 1.10x)"
ONE_PHASE = ("one hand-off per rank (its slot, then every copy out) against shm's chunked pipeline, ahead in 15 of "
             "16 runs at 4 ranks on 2 cores, 64 MiB: "
             "bench/results/all_gather.md#one-host-4-ranks-on-2-cores-64-mib-the-hierarchical-algorithm-against-shm")
HIER = "a block crosses into each host once, (H-1)/H of it per link: bench/results/all_gather.md#several-ranks-per-host"
TABLES: dict[str, list[Rule]] = {
    "all_reduce": [
        Rule("shm", always, why=SHM),
        Rule("hierarchical", lambda nbytes, world: nbytes > 64 << 10, hosts="grouped",
             why="shm in hosts, TCP among one leader each: bench/results/all_reduce.md#hierarchical-flat-path"),
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
        Rule("hierarchical", lambda nbytes, world: world >= 3 and nbytes * world >= 32 << 20, hosts="one", why=ONE_PHASE),
        Rule("shm", always, why=SHM),
        Rule("hierarchical", lambda nbytes, world: nbytes * world >= 1 << 20, hosts="grouped", why=HIER),
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
    "reduce_scatter": [Rule("hierarchical", lambda nbytes, world: world >= 3 and nbytes >= 32 << 20, hosts="one",
                            why=ONE_PHASE),
                       Rule("shm", always, why=SHM),
                       Rule("hierarchical", lambda nbytes, world: nbytes >= 1 << 20, hosts="grouped", why=HIER),
                       Rule("ring", always, why="bench/results/reduce_scatter.md#ring-blocks-on-the-fast-path")],
    "broadcast": [
        Rule("shm", lambda nbytes, world: world > 4 or nbytes >= 1 << 20, why=GRID
             + ": below, TCP's one send and receive straight off the socket beat the slot's two copies and hand-offs"),
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
        Rule("rabenseifner", lambda nbytes, world: nbytes >= 16 << 20 and world > 2,
             why="the work spread over every rank: bench/results/reduce.md#rabenseifner-against-the-tree; at 2 "
                 "ranks the tree's one step beat its two at 16 and 64 MiB: " + GRID),
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
    "barrier": [Rule("shm", always, why=SHM), Rule("dissemination", always)],
    "all_gather_v": [Rule("ring", always, "one algorithm (not measured): bandwidth-optimal whatever the counts")],
    "all_to_all_v": [Rule("direct", always, "one algorithm (not measured), as all_to_all")],
    "gather_v": [Rule("direct", always, "one algorithm (not measured): a block per message to the root")],
    "scatter_v": [Rule("direct", always, "one algorithm (not measured): a block per message from the root")],
    "scan": [Rule("recursive_doubling", always, "one algorithm (not measured): ceil(log2 n) latencies, not n - 1")],
}


def env_var(collective: str) -> str:
    """The variable that overrides ``collective``'s table (runtime/env.py ``ALGO``)."""
    return env.ALGO[collective].name


def choose(collective: str, nbytes: int, world: int, override: str | None = None, group=None, *,
           subcall: bool = False) -> tuple[str, Callable]:
    """The algorithm (name, run function) that runs one call: the override where it can run
    (:data:`NEEDS`), else the table's choice. ``group`` (a ProcessGroup) gives the hosts
    (``group.topology``; without one: a single host) and may rule shared memory out
    (``group.shm_enabled``; ``RINGWEAVE_SHM=0`` and an unwritable /dev/shm rule it out
    everywhere). ``subcall``: a call that another collective opens (compressed.py, device.py)
    takes the table's choice without shared memory, whatever the environment says: it may run
    after calls opened later, which the shared-memory algorithms cannot (a rank's calls enter a
    domain in the order they run).

    Raises:
        ValueError: an unknown collective, or an override naming an algorithm
            that does not exist (a SettingError when the environment names it);
            the message lists the ones that do.
    """
    algorithms = ALGORITHMS.get(collective)
    if algorithms is None:
        raise ValueError(f"unknown collective {collective!r}; known: {sorted(ALGORITHMS)}")
    layout = "one" if group is None else group.topology.layout
    hosts, per_host = tunefile.shape(group, world)
    shm = not subcall and (group is None or group.shm_enabled) and shm_usable()
    reader = _SETTINGS_READERS.get(collective)
    if reader is None:
        reader = _SETTINGS_READERS[collective] = env.raw_reader(env.ALGO[collective], env.TUNE, env.TUNE_FILE)
    key = (collective, nbytes, world, override, subcall, shm, layout, hosts, per_host, reader())
    chosen = _CHOICES.get(key)
    if chosen is None:
        chosen = _choose(collective, algorithms, nbytes, world, override, subcall, shm, layout, hosts, per_host)
        if len(_CHOICES) > 4096:
            _CHOICES.clear()
        _CHOICES[key] = chosen
    return chosen


# A call's choice is a pure function of its arguments, the group's hosts and shared memory, and the
# raw text of the settings that name an algorithm or the tuning rules (RINGWEAVE_ALGO_<COLLECTIVE>,
# RINGWEAVE_TUNE, RINGWEAVE_TUNE_FILE): a training loop's calls repeat, and one look-up on those is
# cheaper than parsing the settings and finding the rules again. A setting changed between calls
# changes the key, so it still takes effect at the next call.
_CHOICES: dict[tuple, tuple[str, Callable]] = {}
_SETTINGS_READERS: dict[str, Callable[[], tuple]] = {}


def _choose(collective: str, algorithms: dict, nbytes: int, world: int, override: str | None, subcall: bool,
            shm: bool, layout: str, hosts: int, per_host: int) -> tuple[str, Callable]:
    """:func:`choose` without the memo."""
    from_env = override is None and not subcall
    if from_env:
        override = env.ALGO.get(collective)
    if override is not None:
        fn = algorithms.get(override)
        if fn is None:
            error = SettingError if from_env else ValueError
            where = f"environment variable {env_var(collective)}=" if from_env else "algorithm="
            raise error(f"{where}{override!r} is not a {collective} algorithm; choose from {sorted(algorithms)}")
        need = NEEDS.get(override)
        if need is None or need(shm, layout):
            return override, _parts(collective, override, fn, nbytes, hosts)
    return _chosen(collective, nbytes, world, shm, layout, hosts, tunefile.rules_for(world, hosts, per_host, ALGORITHMS))


def _parts(collective: str, name: str, fn: Callable, nbytes: int, hosts: int) -> Callable:
    """``fn``, given the parts the table chooses for it: the hierarchical all_reduce gets its
    leaders' all_reduce (one rank per host, "spread", over TCP) as ``across``."""
    if name != "hierarchical" or collective != "all_reduce":
        return fn
    return functools.partial(fn, across=_chosen(collective, nbytes, hosts, False, "spread", hosts)[1])


def _chosen(collective: str, nbytes: int, world: int, shm: bool, layout: str, hosts: int,
            tuned: tunefile.TuneRules | None = None) -> tuple[str, Callable]:
    """The choice of the rules file ``tuned`` where it names an algorithm that can run here, else
    the table's (the first rule that can run, fits and applies) for ranks on ``hosts`` hosts laid
    out as ``layout``, remembered (_CHOSEN)."""
    key = (collective, nbytes, world, shm, layout, hosts, tuned)
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        return chosen
    name = None if tuned is None else tuned.pick(collective, shm, nbytes)
    need = NEEDS.get(name)
    if name is None or not (need is None or need(shm, layout)):  # the table's choice
        for rule in TABLES[collective]:
            need = NEEDS.get(rule.algorithm)
            if (need is None or need(shm, layout)) and rule.fits(layout) and rule.applies(nbytes, world):
                name = rule.algorithm
                break
        else:  # pragma: no cover - every table ends with a rule that always applies
            raise ValueError(f"no {collective} algorithm applies to {nbytes} bytes on {world} ranks ({layout})")
    chosen = name, _parts(collective, name, ALGORITHMS[collective][name], nbytes, hosts)
    if len(_CHOSEN) > 4096:
        _CHOSEN.clear()
    _CHOSEN[key] = chosen
    return chosen


# (collective, nbytes, world, shared memory on, layout, hosts, rules file) -> the choice. The rules are
# pure functions of those: a training loop's calls repeat, and a look-up is cheaper than walking
# the lambdas (bench/results/runtime.md#choosing-from-the-table). The tables are fixed at import;
# code that edits them afterwards must call forget().
_CHOSEN: dict[tuple, tuple[str, Callable]] = {}


def forget() -> None:
    """Forgets every choice made and the rules files read (after a table or a rules file changed
    in this process)."""
    forget_choices()
    tunefile.forget()


def forget_choices() -> None:
    """Forgets every choice made, not the rules (after tunefile.install)."""
    _CHOSEN.clear()
    _CHOICES.clear()
