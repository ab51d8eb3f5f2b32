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
    not any link, bound the time, and the best algorithm can differ: registry notes).
    ``hosts="spread"`` and ``"packed"`` narrow that to a layout (collectives.shm.common.
    host_layout): every rank on a host of its own, or each host holding one contiguous run of
    ranks, several on at least one (the launcher's layout with ``-n K`` per node)."""
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


# The default tables. Figures behind them: see the notes at the end of this file.
def _pow2(world: int) -> bool:
    return world & (world - 1) == 0


TABLES: dict[str, list[Rule]] = {
    "all_reduce": [
        Rule("ring", lambda nbytes, world: nbytes >= 256 << 10,
             "across hosts with several ranks per host in runs (the launcher's layout), from 256 KiB: the "
             "ring crosses between hosts twice a step, halving-doubling sends half the array across per "
             "rank; 1.2-1.5x faster than halving-doubling at 2x2 ranks, 1.2-2.5x at 2x4 on 1 Gbit/s links, two "
             "runs "
             "(bench/netem.py --per-node, figures below; with shared memory on, the hierarchical "
             "algorithm serves these groups instead)", hosts="packed"),
        Rule("recursive_doubling", lambda nbytes, world: nbytes <= (256 << 10 if world <= 4 else 64 << 10),
             "latency-bound: log2(n) rounds of the whole (small) array; fastest to 256 KiB at 4 ranks"),
        Rule("ring", lambda nbytes, world: 8 <= world <= 16 and nbytes >= 4 << 20,
             "across hosts at 8-16 ranks from 4 MiB: 1.2-1.4x faster than halving-doubling at 8 and 16 "
             "ranks on 1 Gbit/s links, two runs each; level at 4 ranks; more than 16 ranks not measured "
             "(bench/netem.py, figures below)",
             hosts="several"),
        Rule("halving_doubling", lambda nbytes, world: _pow2(world) or nbytes <= 1 << 20,
             "2 log2(n) rounds at the bandwidth optimum; beat ring at 4 ranks from 1 to 64 MiB"),
        Rule("ring", always, "other world sizes, where the halving-doubling fold costs two extra full "
                             "transfers: bandwidth optimum, pipelined by 4 MiB segment"),
    ],
    "all_gather": [
        Rule("ring", lambda nbytes, world: world >= 8 and nbytes * world >= 2 << 20,
             "across hosts at 8 ranks and more from 2 MiB gathered: at 8 ranks on 1 Gbit/s links faster than "
             "recursive doubling and direct at 2 and 4 MiB (4 MiB: 32-34 against 36-51 ms), level with direct "
             "at 16 MiB (bench/netem.py, figures below)", hosts="several"),
        Rule("ring", lambda nbytes, world: nbytes * world >= 1 << 20,
             "across hosts with several ranks per host, each host's ranks in one run (the launcher's "
             "layout), from 1 MiB gathered: a block crosses between hosts once per host, not once per "
             "rank; 1.3-2.4x faster than direct at 2x2, 2x4 and 4x2 ranks on 1 Gbit/s links "
             "(bench/netem.py --per-node, figures below)", hosts="packed"),
        Rule("direct", lambda nbytes, world: world <= 8 and nbytes * world >= 1 << 20,
             "across hosts, one rank per host, from 1 MiB gathered: one message per peer; 10-15% faster "
             "than recursive doubling at 1 MiB on 1 Gbit/s links at 4 ranks, three runs, and 0-30% at 8 "
             "ranks, three runs (bench/netem.py, figures below)", hosts="spread"),
        Rule("recursive_doubling",
             lambda nbytes, world: world in (2, 4, 8) and nbytes * world <= (4 << 20 if world == 8 else 1 << 20),
             "log2(n) messages per rank instead of direct's n-1, straight into place: faster than direct "
             "at 4 ranks to 1 MiB gathered (since messages up to 1 MiB take the fast path), a tie at 4 MiB; "
             "at 8 ranks the fastest to 4 MiB (figures below)"),
        Rule("direct", lambda nbytes, world: world <= 8,
             "one round of n-1 independent messages, straight into place; fastest at 2-4 ranks at every "
             "size measured, 16 B to 64 MiB, at 6 ranks too, and level with ring at 8 ranks and 16 MiB "
             "(figures below); more than 8 ranks not measured"),
        Rule("bruck", lambda nbytes, world: nbytes * world <= 1 << 20,
             "latency-bound: ceil(log2 n) messages instead of n - 1; beat ring to 1 MiB gathered (figures below)"),
        Rule("ring", always, "bandwidth optimum, segmented; even with Bruck at 4 MiB, which copies out once more"),
    ],
    "reduce_scatter": [Rule("ring", always)],
    "broadcast": [
        Rule("tree", lambda nbytes, world: 128 << 10 <= nbytes < 1 << 20,
             "across hosts with several ranks per host in runs, 128 KiB to 1 MiB: the tree crosses "
             "between hosts as seldom as the chain there, in fewer messages; at 256 KiB 1.74 / 1.91 ms "
             "(2x2 ranks) and 1.38 / 1.95 ms (2x4) against the chain on 1 Gbit/s links (figures below)",
             hosts="packed"),
        Rule("chain", lambda nbytes, world: nbytes >= (128 << 10 if world <= 8 else 512 << 10) and world <= 16,
             "across hosts: every link busy at once, a segment at a time; 2.0-4.6x faster than the tree from "
             "128 KiB at 4 and 8 ranks on 1 Gbit/s links, 2.0-4.0x from 512 KiB at 12 and 16 (bench/netem.py, "
             "figures below); on one host's loopback it lost to the tree to 1 MiB; more than 16 ranks not "
             "measured", hosts="several"),
        Rule("flat", lambda nbytes, world: nbytes <= (64 << 10 if world <= 4 else 16 << 10) and world <= 8,
             "one latency for every receiver; faster than the tree at 4 ranks to 64 KiB and at 8 ranks to "
             "16 KiB, even at 6 (figures below); more than 8 ranks not measured"),
        Rule("tree", always, "log2(n) rounds; the root sends log2(n) copies, not n-1"),
    ],
    "reduce": [
        Rule("tree", always,
             "across hosts with several ranks per host in runs: the tree sends one array between two "
             "hosts, Rabenseifner's ring and gather more; level or faster at every size measured, 256 KiB "
             "to 16 MiB at 2x2 and 2x4 ranks on 1 Gbit/s links (figures below)", hosts="packed"),
        Rule("rabenseifner", lambda nbytes, world: nbytes >= 1 << 20,
             "across hosts: the root's link carries (n-1)/n of the array instead of log2(n) whole ones; "
             "1.4x faster than the tree at 1 MiB on 1 Gbit/s links at 4 ranks, one rank per host "
             "(bench/netem.py, figures below)", hosts="several"),
        Rule("rabenseifner", lambda nbytes, world: nbytes >= 16 << 20,
             "reduce-scatter then gather: the work spread over every rank; 5-10% faster than the tree at "
             "16 MiB at 4 and 8 ranks, level at 4 MiB (figures below); lengths not a multiple of n use the tree"),
        Rule("tree", always, "log2(n) rounds; the root receives and reduces log2(n) whole arrays"),
    ],
    "gather": [
        Rule("direct", lambda nbytes, world: world <= 8 or nbytes >= 1 << 20,
             "every block crosses once, straight into place; faster than the tree at 3, 4 and 8 ranks at "
             "every size measured (figures below); large blocks at any size of world: the root takes n-1 "
             "blocks either way and the tree forwards them besides"),
        Rule("tree", always, "small blocks on more than 8 ranks (not measured): log2(n) rounds, not n-1 messages"),
    ],
    "scatter": [
        Rule("direct", lambda nbytes, world: world <= 8 or nbytes >= 1 << 20,
             "every block crosses once, straight from the root's input; as gather (figures below)"),
        Rule("tree", always, "small blocks on more than 8 ranks (not measured): log2(n) rounds, not n-1 messages"),
    ],
    "all_to_all": [Rule("direct", always)],
    "barrier": [Rule("dissemination", always)],
    "all_gather_v": [Rule("ring", always, "one algorithm (not measured): bandwidth-optimal whatever the counts")],
    "all_to_all_v": [Rule("direct", always, "one algorithm (not measured), as all_to_all")],
    "gather_v": [Rule("direct", always, "one algorithm (not measured): a block per message to the root")],
    "scatter_v": [Rule("direct", always, "one algorithm (not measured): a block per message from the root")],
}


# -- shared memory (collectives/shm; added by the shared-memory engineer) ---------------------
# "shm" heads the tables of the collectives it serves, whenever RINGWEAVE_SHM is not "0" and
# /dev/shm is writable (the same on every rank of a node). The table cannot see the group, so
# the shm algorithms check the rest themselves (every rank the same way): a group spanning
# nodes runs all_reduce "hierarchical" (shm inside nodes, TCP among one leader per node) and the
# others the first non-shm rule below. Figures: collectives/shm/__init__.py.
from collectives import shm as _shm  # noqa: E402  (after the tables it extends)
from runtime.shm import shm_usable as _shm_usable  # noqa: E402
from collectives.shm.common import host_layout as _host_layout  # noqa: E402

for _collective, _algorithms in _shm.ALGORITHMS.items():
    ALGORITHMS[_collective].update(_algorithms)
    TABLES[_collective].insert(0, Rule("shm", lambda nbytes, world: _shm_usable(),
                                       "ranks on one machine: one copy in, one copy out through /dev/shm"))


def env_var(collective: str) -> str:
    return f"RINGWEAVE_ALGO_{collective.upper()}"


_ENV_VARS = {c: env_var(c) for c in ALGORITHMS}  # formatted once, read at every call


def choose(collective: str, nbytes: int, world: int, override: str | None = None,
           group=None) -> tuple[str, Callable]:
    """The algorithm (name, run function) for one call. ``group``, when given, may
    rule the shared-memory path out (``group.shm_enabled`` False: a communicator
    built with ``shm=False``).

    Raises:
        ValueError: an unknown collective, or an override (argument or
            environment) naming an algorithm that does not exist; the message
            lists the ones that do.
    """
    algorithms = ALGORITHMS.get(collective)
    if algorithms is None:
        raise ValueError(f"unknown collective {collective!r}; known: {sorted(ALGORITHMS)}")
    from_env = override is None
    if from_env:
        override = env.get(_ENV_VARS.get(collective) or env_var(collective)) or None
    if override is not None:
        fn = algorithms.get(override)
        if fn is None:
            where = f"environment variable {env_var(collective)}=" if from_env else "algorithm="
            raise ValueError(f"{where}{override!r} is not a {collective} algorithm; choose from {sorted(algorithms)}")
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


# (collective, nbytes, world, shm ruled out) -> the table's choice. The rules are pure functions of
# those, the shared-memory one of RINGWEAVE_SHM and /dev/shm (read per call into "shm ruled out"):
# a training loop's calls repeat, and walking the table's lambdas cost ~1 us per call. The tables
# are fixed at import; code that edits them afterwards must call _CHOSEN.clear().
_CHOSEN: dict[tuple, tuple[str, Callable]] = {}


# ---------------------------------------------------------------------------------------------
# Figures behind the all_reduce table. 4 ranks, one process each, TCP over loopback, this 2-core
# box, float32 sum, median of 20 runs (8 at >= 4 MiB) of the slowest rank, a barrier before each:
#
#   python -m runtime.launch -n 4 tests/collectives/measure_all_reduce.py --max-mib 1
#   python -m runtime.launch -n 4 tests/collectives/measure_all_reduce.py \
#       --sizes 4194304,16777216,67108864 --algos ring,halving_doubling --runs 8
#
#   bytes      ring (us)   halving_doubling (us)   recursive_doubling (us)
#       4         9425.6          2197.8                  1415.7
#      64         2771.3          2133.0                  1268.3
#    1024         3091.6          2098.1                  1366.3
#    4096         2826.4          2285.2                  1464.6
#   16384         5683.3          6788.3                  4421.1
#   65536         3995.3          2508.1                  1963.5
#  262144         7783.9          3315.2                  2572.9
#    1 Mi         8361.4          6232.9                  6914.4
#    4 Mi        34142.2         29110.0                     -
#   16 Mi       104659.6         98039.2                     -
#   64 Mi       550107.3        377758.7                     -      (busbw 0.18 vs 0.27 GB/s)
#
# CAUTION: measured while other jobs shared the machine (load average 8-9 on 2 cores; a raw
# single-stream TCP loopback copy managed only 0.9 GB/s then), so the absolute times are several
# times what an idle box gives, and only the ordering was used. The ordering was the same in two
# earlier runs. Non-power-of-two worlds were not measured; ring is chosen there above 1 MiB from
# the volume argument (the fold sends the whole array twice more). Remeasure with
# bench/collectives.py on an idle machine before quoting any speed.
#
# Re-measured on a quiet machine (load 0.4) after the transport's writev fix and the receives
# posted ahead, with the benchmark of bench/:
#
#   python bench/collectives.py -n 4 --ops all_reduce --algorithm all \
#       --sizes 4,1K,64K,256K,1M,4M,16M,64M --shm off --iters 15
#
#   bytes      ring (us)   halving_doubling (us)   recursive_doubling (us)
#       4         1671           1461                     717
#    1024         1912           1676                     804
#   64 Ki         1912           1593                     794
#  256 Ki         2606           2179                    1321
#    1 Mi         3513           2832                    3017
#    4 Mi        10270          10196                   13789
#   16 Mi        40436          39409                   57593
#   64 Mi       133953         142263                  224677    (busbw 0.75 vs 0.71 GB/s)
#
# The ordering behind the table holds: recursive doubling up to 256 KiB, halving-doubling from
# 1 MiB; ring and halving-doubling are within noise of each other from 4 MiB (9-19% spread).
#
# Segments. Ring and halving-doubling all_reduce, ring reduce_scatter and all_gather cut messages
# at 4 MiB (1 MiB before), since the transport raises SO_RCVLOWAT while a large payload arrives
# (runtime/transport.py): the receiver is woken per few MiB instead of per 64 KiB packet. A/B on a
# quiet machine, two runs each, ratio = Gloo time / ours (> 1: we are faster):
#
#   python bench/collectives.py -n 4 --ops all_reduce,broadcast,all_gather,reduce_scatter \
#       --sizes 1M,4M,16M,64M --shm off --compare gloo --iters 8
#
#                           1 MiB segments, no lowat    4 MiB segments + lowat
#   all_reduce     16 MiB        0.92 / 0.90               1.08 / 1.08
#   all_reduce     64 MiB        0.88 / 0.92               1.00 / 1.00
#   all_gather     16 MiB        1.14 / 1.24               1.40 / 1.50
#   reduce_scatter 16 MiB        2.26 / 2.22               2.52 / 2.45
#
# 64 MiB all_reduce back to back (10 calls, getrusage per rank; a probe that became bench/floor.py
# --size 64M): user 13-16 -> 8-11 ms, sys 36-45 -> 35-37 ms, wall 110-128 -> 101-103 ms per call.
# The lowat half alone, with 4 MiB segments (floor.py, RINGWEAVE_RCVLOWAT=1 / 0, two runs each, a
# slow period): 127-134 / 134-141 ms wall, 59-61 / 63-64 ms CPU per rank. 2 MiB or 8 MiB segments
# were within noise of 4 MiB.
# At 3 ranks (ring) 1 and 4 MiB segments were within noise of each other (0.92-0.97x Gloo either way).
# Reductions on a worker thread (OFFLOAD_MIN_NBYTES 1 MiB) were no faster with 4 MiB segments either.
# Re-checked at 4-64 MiB with 1, 2 and 4 MiB segments (halving-doubling and ring, --algorithm all,
# two runs each): 4 MiB gave the best or equal busbw at every size (16 MiB: 0.88-0.92 GB/s against
# 0.75-0.82 with 1-2 MiB).
#
# Where a 64 MiB all_reduce's CPU goes, beside Gloo's (session 8). bench/floor.py's gloo mode
# refilled its tensor with torch's fill_, which runs on torch's OpenMP pool (2 threads per rank);
# those threads then spin beside the all_reduce. With that, Gloo took 148-158 ms a call and 68-73 ms
# of CPU per rank against 109-127 ms and 50-58 ms with OMP_NUM_THREADS=1 (two runs each), so the
# "1.33x back to back" of earlier notes was that artifact. The mode now refills through NumPy, as
# ours do. Three runs alternating, `python bench/floor.py -n 4 --modes ringweave-tcp,gloo --size 64M
# --calls 7` (wall / CPU per rank / user / system, ms, the fill included):
#
#   ringweave   126.0 / 58.2 / 18.2 / 39.9    114.2 / 52.4 / 16.4 / 36.0    137.1 / 62.7 / 18.9 / 43.8
#   gloo        118.9 / 55.2 /  9.6 / 45.5    126.3 / 57.2 / 11.1 / 46.0    117.2 / 49.7 /  9.0 / 40.6
#
# and at 16 MiB (--calls 20): 31.7 / 32.6, 35.0 / 33.3, 32.0 / 38.6 ms wall (ours / Gloo). Both are
# bound by the kernel: with the 4 ranks' CPU summed over the 2 cores the wall time is within 10%
# of it, and 70-80% of each rank's CPU is system time, the same bytes copied in and out of the
# loopback's 64 KiB packets (perf: _copy_from_iter + _copy_to_iter 37% of all samples, the TCP
# stack around them most of the rest). We make 40x fewer syscalls (280 against ~11000 per rank
# and call, perf stat) and 15% fewer packets, and spend ~5 ms less system time; Gloo spends ~6 ms
# less user time. Ours, the fill left out (a probe timing only the call, three runs): user 10-20,
# typically 13 ms, of which the reduction of 48 MiB is 4.4 ms alone on a quiet core
# (collectives/kernels, level with np.add) and 5-10 ms beside the other ranks; system 34-48 ms.
# 1.2x Gloo's busbw at 64 MiB would need our CPU per call ~17% (9 ms) lower: all of our user time
# but the reduction itself. Not reachable over loopback TCP on this box.
#
# Tried and not kept: receiving large payloads piece by piece through one reused 256 KiB buffer
# (the transport handing each piece to a reduce or copy into place), so the kernel copies into
# cache-hot memory. A two-process probe (64 MiB over loopback, 10 rounds) was promising: the
# receiver's system time was 4.3-5.9 ms through the small buffer against 10.8-14.5 ms into a
# pre-touched 64 MiB one. In the all_reduce it was not: `python bench/floor.py -n 4 --modes
# ringweave-inproc --size 64M --calls 6`, 182-187 ms per call before against 198-245 ms, user time
# up 4-8 ms per rank (a callback per piece, the all-gather's copy out of the piece buffer) and
# system time no lower.
#
# Where recursive doubling hands over, re-measured after that (4 ranks, three runs, medians in us):
#
#   python bench/collectives.py -n 4 --ops all_reduce --algorithm all --sizes 256K,512K,1M,2M \
#       --shm off --iters 20
#
#   bytes      recursive_doubling      halving_doubling        ring
#  256 Ki      1049 / 1306 / 1096      1829 / 2187 / 1750      1956 / 2218 / 2008
#  512 Ki      1524 / 1869 / 1401      2020 / 2288 / 1877      2410 / 2664 / 2117
#    1 Mi      3177 / 2790 / 2503      3032 / 2908 / 2781      3380 / 3309 / 2873
#    2 Mi      7328 / 7019 / 6307      5815 / 5529 / 4630      6727 / 6331 / 5645
#
# Recursive doubling was faster at 512 KiB here, but the threshold stays at 256 KiB: it sends two
# arrays per rank against halving-doubling's 1.5, which a real network pays for (loopback on this
# box is CPU-bound, not bandwidth-bound), and compressed all_reduce's sub-calls take this table
# too: with 512 KiB, fp16 sent 0.67 instead of 0.5 of the plain bytes (test_wire_bytes_as_stated).

# ---------------------------------------------------------------------------------------------
# Figures behind the all_gather table (size = the gathered output, 4 ranks, TCP, quiet machine):
#
#   python bench/collectives.py -n 4 --ops all_gather --sizes 16,4K,256K,1M,4M --shm off \
#       --algorithm all --iters 20
#
#   bytes      ring (us)   bruck (us)
#      16         631         400
#    4 Ki         673         431
#  256 Ki         807         618
#    1 Mi        1229        1045
#    4 Mi        4006        3914
#
# An earlier run (--sizes 16,1K,64K,256K,1M) gave the same order up to 256 KiB (598 vs 751 us at 16 B)
# and a tie at 1 MiB (1145 vs 1121 us). Bruck needs a scratch of the whole output and copies it
# out once more, so ring keeps the large sizes.
#
# Direct (collectives/all_gather_direct.py) against both, after the 4 MiB segments and SO_RCVLOWAT,
# a slow period of the machine (medians in us, 15 iterations; a second run in brackets):
#
#   python bench/collectives.py -n 4 --ops all_gather --algorithm all --sizes 16,1K,64K,256K,1M,4M,16M \
#       --shm off --compare gloo --iters 15
#
#   bytes      ring            bruck           direct
#      16       959 (855)       929 (635)       783 (653)
#    1 Ki       941 (853)       747 (613)       638 (749)
#   64 Ki       971 (659)       797 (652)       791 (608)
#  256 Ki      1073 (1055)     1349 (1122)      918 (795)
#    1 Mi      1535 (1608)     1888 (1591)     1262 (1502)
#    4 Mi      4713 (4633)     6261 (6290)     4271 (4219)
#   16 Mi     18661 (14759)   40496 (21866)   17441 (14643)
#
# and with --sizes 64,256K,1M,64M --iters 10: 4 ranks 64 MiB ring 54418, direct 53785; 3 ranks
# 60 B 585 / 518 (bruck) / 426, 1 MiB 1096 / 1141 / 958, 64 MiB 44542 / 66136 / 42941. Direct sends
# ring's volume with no dependent steps and no copy-out; it is the default up to 4 ranks. At more
# ranks every rank would talk to every other at once, unmeasured here, so Bruck and ring keep them.
#
# Recursive doubling (collectives/all_gather_recursive_doubling.py) against direct, after the
# small-message path was cut down (4 ranks, --algorithm all runs bruck, direct, recursive doubling
# and ring in turn; three runs, medians in us, direct / recursive doubling):
#
#   python bench/collectives.py -n 4 --ops all_gather --sizes 16,1K,16K,256K,1M --shm off \
#       --algorithm all --iters 40
#
#   bytes       run 1           run 2           run 3
#      16     820 / 804       826 / 770       743 / 720
#    1 Ki     822 / 799       826 / 778       790 / 782
#   16 Ki     816 / 799       828 / 743       791 / 766
#  256 Ki    1196 / 1094     1208 / 1093     1268 / 1100
#    1 Mi    1977 / 2060     2048 / 2042     1978 / 1915
#
# Two messages per rank instead of three, each into place. At 3 ranks (the fold: two more
# messages) it tied direct (60 B 411 / 429 and 405 / 421, 1 MiB 1276 / 1253 and 1453 / 1380); at 8
# ranks (8 processes on 2 cores) runs moved by 2x and neither it nor Bruck won at every size.
# So it is the default at 2 and 4 ranks up to 256 KiB gathered only. (Since raised to 1 MiB
# gathered: figures at the end of this file.)

# ---------------------------------------------------------------------------------------------
# Small messages read straight off the socket (runtime/group.Call.sendrecv, TCPConnection.recv_now;
# used by recursive-doubling all_reduce and all_gather, the dissemination barrier, the broadcast
# tree's receive and ring reduce_scatter's blocks up to 16 KiB; since widened to 1 MiB, see the
# end of this file). 4 B all_reduce back to back,
# 4 ranks on 2 cores, this tree against the one before it (git worktree), interleaved:
#
#   python bench/floor.py -n 4 --modes ringweave-tcp --calls 3000
#
#               wall us/call       CPU us/call/rank (user + system)
#   before      334 / 338 / 403 / 421    146-181 (112-137 + 34-44)
#   after       270 / 287 / 293 / 308    120-130 (82-95 + 32-38)
#
# The same command's bare modes in those runs: blocking sockets 70-73 us wall, 28 us CPU; a
# minimal uvloop protocol 120-123 / 46-50. cProfile of one rank (2000 calls through the launcher)
# found every frame taken off the socket, none through the event loop, ~109 Python calls per
# all_reduce, and most of the remaining time in poll() (blocked, no CPU) and the loopback send.
#
# In bench/collectives.py (issue 3's command, --shm off --compare gloo --iters 20; one run before,
# three after) the barrier went from 592 to 307-348 us (Gloo 789-1121), broadcast 4 B-1 KiB from
# 1.13-1.88x to 1.58-2.57x Gloo, 4 B all_reduce from 1.50x to 1.48-1.85x. (A fifth run, with the
# large-frame read below and in a slower period of the machine: barrier 490 us against Gloo's
# 1034, broadcast 4 B-1 KiB 1.59-2.25x, 4 B all_reduce 1.57x.) Our tiny all_reduce rows
# take 450-730 us interleaved with Gloo's calls in the same processes, against 359 us with no peer
# in the run (--ops all_reduce,broadcast,barrier --sizes 4,1K --iters 60, with and without
# --compare gloo, minutes apart: 359 / 619 us); a 2 ms sleep before each timed call (every
# library) did not close that gap (4 B 615-626 us with it, 492 without), so it is not Gloo's
# threads still running. Tried with this path and not kept: a flat broadcast (root sends to all)
# lost to the tree at most sizes, 4 B-1 MiB, in two --algorithm all runs.
#
# recv_now for frames up to 1 MiB (the head first, then the payload straight into place), which
# only a broadcast's receive uses. Broadcast against the tree before it, two runs each, ours / Gloo
# us (python bench/collectives.py -n 4 --ops broadcast --sizes 4K,16K,64K,256K,1M --shm off
# --compare gloo --iters 30):
#
#   bytes      before                           after
#   64 Ki      528 / 654 (1.24x), 639 / 705     376 / 596 (1.58x), 383 / 748 (1.95x)
#  256 Ki      645 / 766 (1.19x), 671 / 877     470 / 875 (1.86x), 572 / 875 (1.53x)
#    1 Mi     1328 / 1689 (1.27x), 1383 / 1795  1182 / 1437 (1.22x), 1178 / 1658 (1.41x)

# ---------------------------------------------------------------------------------------------
# The fast path widened to messages of up to 1 MiB (sixth session): Connection.send_now writes a
# payload above 16 KiB with its header in one writev from the caller's buffer (what a full socket
# does not take is copied into the transport), so Call.sendrecv reads the peer's reply straight
# off the socket for exchanges up to 1 MiB each way. Three algorithms were changed to use it:
# halving-doubling all_reduce up to 2 MiB, direct all_gather blocks up to 1 MiB, and ring
# reduce_scatter blocks up to 1 MiB. Each now runs one sendrecv per step, with no receives posted
# ahead and no segments. Recursive doubling (already sendrecv) got the larger sends for free.
#
# Each new path was measured against the old one in the same run. A temporary second
# registry entry held the old threshold, and --algorithm all alternated the two every
# iteration. Medians in us, 4 ranks, --shm off, two runs each:
#
#   python bench/collectives.py -n 4 --ops all_reduce --sizes 256K,1M,2M --algorithm all --shm off --iters 40
#   bytes     halving-doubling new / old
#   256 Ki     846 / 1506     698 / 1286
#     1 Mi    2307 / 3457    1528 / 2226
#     2 Mi    4502 / 4972    2763 / 3623
#   (4 and 16 MiB with one sendrecv per step but no fast path, first message > 1 MiB: no gain,
#   6297 / 6854 and 33369 / 31914, so the posted, segmented path keeps them.)
#
#   python bench/collectives.py -n 4 --ops all_gather --sizes 256K,1M,4M --algorithm all --shm off --iters 40
#   bytes     direct new / old
#   256 Ki     520 / 604      617 / 717
#     1 Mi     857 / 901      829 / 952
#     4 Mi    3090 / 3378    3255 / 3413
#
#   python bench/collectives.py -n 4 --ops reduce_scatter --sizes 64K,256K,1M,4M --algorithm all --shm off --iters 40
#   bytes     ring, 1 MiB / 16 KiB threshold
#   256 Ki     781 / 1175     767 / 1080
#     1 Mi    1540 / 1977    1680 / 2148
#     4 Mi    5241 / 5930    4973 / 5504
#
# Recursive doubling (its sends above 16 KiB now written at once), this tree against the one
# before it (git worktree, interleaved): 64 KiB 412, 382 / 492, 559; 256 KiB 498, 486 / 640, 690.
# The table's crossover is unchanged (--algorithm all, 256K, 512K, 1M, two runs): recursive
# doubling first at 256 KiB (796 / 1053 halving-doubling, 1353 / 1481), a tie at 512 KiB (1248 / 1348,
# 1298 / 1259), halving-doubling first at 1 MiB (2932 / 3174, 3549 / 4654).
#
# Issue 3's command (--ops all_reduce,all_gather,reduce_scatter,broadcast,barrier --shm off
# --compare gloo --iters 20), once before and twice after the halving-doubling and direct
# all_gather change (before the reduce_scatter one): all_reduce 1 MiB 1.90x Gloo before, 4.15x and
# 4.72x after; 256 KiB 4.16x before, 8.68x and 8.24x after; all_gather 1 MiB 2.05x before, 2.03x and 4.65x after.

# ---------------------------------------------------------------------------------------------
# Spinning before sleeping (RINGWEAVE_SPIN_US, default 50; TCPConnection.recv_now). This machine is
# a KVM guest with guest halt-polling off (/sys/module/haltpoll/parameters/guest_halt_poll_ns = 0),
# so a rank asleep in poll() idles its virtual CPU, and the wake-up goes through the host. For the
# first 50 us of its wait, recv_now now re-reads the socket with sched_yield between reads.
# 4 B all_reduce back to back, RINGWEAVE_SPIN_US=0 / 50 interleaved:
#
#   python bench/floor.py -n 4 --modes ringweave-tcp --calls 3000
#
#   run        wall us/call (0 / 50)    CPU us/call/rank (0 / 50)
#   a          277 / 140                118 / 69
#   b          226 / 139                 99 / 68
#   c          338 / 149                127 / 74
#   d (final)  231 / 136, 232 / 169     101 / 68, 100 / 83
#
# The CPU per call fell too: the sleep and the wake-up cost more than the spin. A sweep of the
# budget (two runs each, wall us): 0: 259, 245; 20: 165, 166; 50: 143, 143; 100: 159, 145;
# 200: 143, 144; 500: 168, 167. The bare modes of that command in the same period: blocking
# sockets 59 us, a minimal uvloop protocol 106 us, ringweave 147 us.
#
# bench/collectives.py without a peer (--sizes 4,16K,256K,1M --shm off --iters 30, two runs each,
# 0 / 50): all_reduce 4 B 333, 329 / 199, 179 us; 1 MiB 1195, 1057 / 868, 887; barrier 276, 231 /
# 135, 142; broadcast 4 B 207, 208 / 131, 133; all_gather 16 B 367, 391 / 211, 277; reduce_scatter
# 16 B 466, 531 / 245, 419. Broadcast 1 MiB did not move (623, 800 / 667, 730).
#
# With --compare gloo the gain mostly disappears. Five alternating runs of --ops
# all_reduce,broadcast,barrier --sizes 4,1K --iters 40 gave these median ratios to Gloo (0 / 50):
# 4 B all_reduce 1.68 / 1.80, broadcast 4 B 1.82 / 1.95, broadcast 1 KiB 1.77 / 2.27, barrier
# 2.09 / 2.06. Interleaved with Gloo, our 4 B all_reduce takes 460-480 us; in the same minutes
# without the peer it takes 186-201 us. Our calls run slower after Gloo's calls, as after any idle
# period (only ours was measured this way): a 2 ms sleep before each timed call made ours slower (612 against 476 us), and
# a 2 ms sched_yield spin in its place did not help consistently (329 and 557 against 403 and 504).
#
# Where the time goes after the other library's calls: the bench's timed call, instrumented for a
# run with getrusage(RUSAGE_THREAD) around it (not kept; mean over 100 calls per rank, 4 ranks,
# python bench/collectives.py -n 4 --ops all_reduce --sizes 4,256K --shm off --iters 100, without
# and with --compare gloo, minutes apart):
#
#               wall us (median)     user us           system us
#   4 B         107-172 / 365-406    26-49 / 144-171   16-40 / 11-43
#   256 KiB     400-425 / 738-798    20-62 / 211-237   46-93 / 49-99
#
# The same calls use three to five times the user CPU when Gloo's calls run between them. The
# kernel's share did not change. The likeliest cause, not proven here: Gloo waits with its threads
# asleep, so the virtual CPUs idle between our calls (and a 2 ms sleep did the same), and our
# Python then runs on cold caches. A smaller cold footprint would help (less Python per call); a
# faster wait would not.
#
# All_gather's table after the fast path took messages up to 1 MiB (--algorithm all, 4 ranks,
# medians us, two runs; python bench/collectives.py -n 4 --ops all_gather --sizes 256K,1M,4M
# --algorithm all --shm off --iters 30):
#
#   gathered   bruck         direct        recursive doubling   ring
#   256 Ki     547, 531      436, 434      399, 359             745, 690
#     1 Mi     938, 896      702, 674      580, 545             1057, 988
#     4 Mi     3810, 3586    2724, 2485    2749, 2628           3267, 3095
#
# and at 1 MiB with --compare gloo (two runs): direct 1375, 904; recursive doubling 1302, 817. So
# recursive doubling is the default at 2 and 4 ranks up to 1 MiB gathered, and direct above that.
#
# bench/collectives.py --block K runs K calls of one library in a row before the other's. Two
# runs each of --ops all_reduce,broadcast,barrier --sizes 4,1K,256K,1M --iters 40 --compare gloo,
# ratios to Gloo, --block 1 / 5: all_reduce 4 B 1.63, 1.60 / 1.96, 1.82; broadcast 256 KiB 1.64,
# 1.66 / 1.84, 1.90; broadcast 1 MiB 1.46, 1.22 / 1.53, 1.53; barrier 2.01, 2.07 / 2.60, 2.26. Our
# 4 B all_reduce in blocks of 5 took 365-400 us. Without Gloo in the processes it took 186-201 us,
# so having torch and Gloo in the process still costs us even when our calls are back to back.
#
# Broadcast: flat (collectives/broadcast_flat.py, the root sends to each rank in turn) against the
# binomial tree, now that both take the fast path. A flat broadcast was tried before and lost, but
# in --algorithm all runs where it always ran first after the peer's call (the cold slot above).
# Alternating with each other, no peer (python bench/collectives.py -n 4 --ops broadcast --sizes
# 4,1K,16K,64K,256K,1M --algorithm all --shm off --iters 40; three runs, medians us, flat / tree):
#
#   bytes      run 1          run 2          run 3
#       4     118 / 131       72 / 116      123 / 136
#    1 Ki     145 / 153      128 / 145      130 / 145
#   16 Ki     152 / 165      127 / 141      137 / 172
#   64 Ki     158 / 193      150 / 171      167 / 201
#  256 Ki     158 / 237      367 / 312      251 / 248
#    1 Mi     708 / 755      867 / 823      739 / 752
#
# and each alone beside Gloo (--algorithm flat or tree --compare gloo --iters 30, runs alternated,
# three each; ratio to Gloo, flat / tree): 4 B 1.63, 2.57, 2.06 / 2.04, 1.83, 1.80; 1 KiB 1.81,
# 1.86, 2.62 / 1.93, 1.95, 2.29; 16 KiB 2.67, 3.47, 2.93 / 1.80, 1.92, 1.49; 64 KiB 1.31, 2.01,
# 1.69 / 1.56, 1.62, 1.56; 256 KiB and 1 MiB within noise. So flat up to 64 KiB at up to 4 ranks;
# at more ranks the root's n-1 sends in a row were not measured, and the tree keeps them.

# ---------------------------------------------------------------------------------------------
# Gather and scatter: direct (collectives/gather_direct.py, scatter_direct.py: every block
# crosses the network once, between its rank and the root) against the binomial trees, which
# forward blocks through inner ranks (the tree's 4-rank scatter moves 64 MiB in all for a 64 MiB
# input, direct 48). Sizes are the root's whole buffer (n blocks); 4 ranks, medians in us, two
# runs, direct / tree:
#
#   python bench/collectives.py -n 4 --ops scatter,gather --algorithm all \
#       --sizes 16,1K,64K,256K,1M,4M,16M,64M --shm off --iters 12
#
#   bytes      scatter run 1    scatter run 2     gather run 1 *    gather run 2 *
#      16      116 / 373        134 / 278          70 / 124          205 / 295
#    1 Ki      114 / 311        159 / 303          78 / 307          105 / 277
#   64 Ki      283 / 369        155 / 305         312 / 502          184 / 267
#  256 Ki      279 / 472         92 / 500         259 / 232          202 / 332
#    1 Mi      384 / 627        324 / 463         304 / 527          266 / 492
#    4 Mi      980 / 1314       828 / 1473        888 / 1121         567 / 1526
#   16 Mi     4158 / 5722      3995 / 5454       3627 / 4970        4026 / 6066
#   64 Mi    18436 / 25714    17985 / 26479     17316 / 25766      17992 / 25748
#
# (* gather to 4 MiB measured again after its root took blocks up to 1 MiB with sendrecv, each
# read straight off its socket in turn; 64 MiB from the first runs, with every receive posted.
# Before that change direct gather lost to the tree up to 64 KiB: 269 / 123 us at 16 B.)
# At 8 ranks (64 B, 64 KiB, 1 MiB, 16 MiB; --iters 10, one run) direct won every row: scatter
# 528 / 1177, 794 / 1275, 1371 / 1792, 6877 / 10107; gather 577 / 1033, 889 / 1140, 719 / 1418,
# 4787 / 8618. At 3 ranks the two were within noise (60 B scatter 176 / 156, 1 MiB gather
# 339 / 322) or direct ahead. Sending the scatter's blocks all at once (asyncio.gather) instead
# of in turn: 64 MiB 13237 / 13153 and 13536 / 14020 us, 16 MiB 4007 / 3848 and 4009 / 3782
# (at once / in turn), no gain, so in turn. Beside Gloo (--ops gather,scatter --sizes
# 16,1K,64K,1M,16M,64M --compare gloo --iters 12, two runs, ratio Gloo / ours): gather 2.44-5.28
# to 1 MiB, 1.70-1.83 at 16 MiB, 2.54-2.93 at 64 MiB (the tree: 1.16-1.63 to 1 MiB, 2.29 at 64
# MiB); scatter 1.76-3.06 to 1 MiB, 1.03-1.43 at 16 MiB, 1.01-1.03 at 64 MiB (the tree: 0.67).
#
# A pipelined chain broadcast on one host's loopback (the array in segments of 64 KiB-1 MiB down
# the line root, root+1, ...; one sendrecv per step: send segment i-1 on while segment i comes
# in). Against the tree (--ops broadcast --algorithm all --sizes 256K,1M,4M,16M,64M --iters 12,
# segments of nbytes/8 clamped to 64 KiB-1 MiB, then fixed 64 KiB and 256 KiB): 256 KiB
# 506 / 295, 430 / 187, 323 / 266 us; 1 MiB 1596 / 1120, 1169 / 789, 1390 / 970; 4 MiB
# 3802 / 4190, 5256 / 3220, 4500 / 4694; 64 MiB 59331 / 51158, 71704 / 48124, 75340 / 61511
# (chain / tree). Loopback here is bound by the CPU of the kernel's copies, not by any one link,
# and the chain copies as many bytes as the tree in more messages. So on one host the tree stays;
# across hosts, where links bound the time, the chain is the default (below).
#
# all_to_all direct: blocks up to 1 MiB now go round by round, one sendrecv per round (sent at
# once, the peer's block read off its socket), instead of every receive posted first. Same run,
# the new way as a temporary second entry (--ops all_to_all --algorithm all --sizes
# 16,1K,64K,1M,4M --iters 15, 4 ranks, two runs; size = n blocks), medians us, rounds / posted:
# 16 B 354 / 468, 403 / 460; 1 KiB 362 / 399, 404 / 487; 64 KiB 394 / 432, 634 / 617; 1 MiB
# 738 / 854, 746 / 907; 4 MiB (1 MiB blocks) 3015 / 3480, 3101 / 3377; the minima 10-25% lower
# in every row. Beside Gloo after it (--compare gloo --iters 12, two runs): 16 B 1.75, 2.82x;
# 1 KiB 1.39, 1.66x; 64 KiB 1.80, 1.36x; 1 MiB 1.18, 1.45x; 16 MiB 1.11, 0.97x (posted
# receives: 1.05x at 16 B, 1.34x at 1 KiB and 1.08x at 1 MiB in this session's first run).
#
# reduce tree: arrays up to 1 MiB now take each child's partial with sendrecv (read off its
# socket) instead of posted receives. Same run, the old file as a temporary second entry
# (--ops reduce --algorithm all --sizes 16,1K,64K,256K,1M,4M --iters 15, 4 ranks, two runs),
# medians us, new / old: 16 B 84 / 177, 219 / 346; 1 KiB 136 / 128, 194 / 319; 64 KiB 122 / 254,
# 93 / 275; 256 KiB 249 / 417, 344 / 510; 1 MiB 905 / 1189, 965 / 1145; 4 MiB (the same code in
# both) 3987 / 4662, 4585 / 4450.
#
# Flat broadcast at more ranks (--ops broadcast --algorithm all --sizes 64,1K,16K,64K,256K --iters 15,
# two runs each, medians us, flat / tree). 8 ranks: 64 B 463 / 689, 485 / 779; 1 KiB 437 / 509,
# 680 / 875; 16 KiB 378 / 557, 459 / 692; 64 KiB 522 / 556, 635 / 588; 256 KiB 660 / 769, 671 / 734.
# 6 ranks: 64 B 267 / 306, 273 / 296; 1 KiB 283 / 256, 271 / 291; 16 KiB 342 / 329, 286 / 303;
# 64 KiB 351 / 368, 367 / 451; 256 KiB 428 / 609, 681 / 715. So flat to 16 KiB up to 8 ranks.
#
# Where a small call's time goes when it runs cold (after Gloo's calls, or any idle gap). A probe
# (not kept) ran `barrier; t0; all_reduce(4 B); t1` 200 times at 4 ranks with a 7 ms sleep before
# each barrier: the slowest rank's median was 425-647 us (190-290 us without the sleep), and the
# same probe over bare blocking sockets (recursive doubling, one np.add per step) 215-241 us
# (132-142). Of ours, the barrier's exit skew (last rank out minus first, on the shared monotonic
# clock) was 183-250 us cold against 74 us warm, and a rank that leaves early waits that long in
# the all_reduce. A flat barrier (every rank to every other, one round; tried, not kept) left the
# skew where it was (206-215 us), so it is the 2 cores scheduling 4 ranks, not the dissemination's
# chain of messages. Taking NumPy out of the recursive doubling's steps (byte views by
# memoryview.cast, a cached scratch, the kernel called directly; a probe run in the bench beside
# Gloo, 60 iterations, three runs alternating) changed nothing measurable: 553 / 593, 590 / 595,
# 470 / 450 us (stripped / as is).
#
# reduce: Rabenseifner (collectives/reduce_rabenseifner.py: ring reduce-scatter, then direct gather
# to the root) against the tree (--ops reduce --algorithm all --iters 10, 4 ranks, medians in ms,
# rabenseifner / tree; four runs at 16 and 64 MiB, two below):
#   64 KiB 0.42 / 0.21, 0.63 / 0.24; 1 MiB 1.23 / 0.75, 1.10 / 0.93; 4 MiB 5.73 / 5.65, 5.57 / 6.03;
#   16 MiB 21.4 / 22.6, 19.9 / 22.0, 23.2 / 33.0, 19.3 / 21.6;
#   64 MiB 90.7 / 104.2, 86.2 / 87.8, 90.4 / 88.2, 87.3 / 92.3.
# 8 ranks (--iters 6, one run): 1 MiB 8.05 / 4.23, 16 MiB 49.0 / 54.6. So from 16 MiB. The
# reduce-scatter (61 ms at 64 MiB in issue 3's command) plus a direct gather (17 ms) suggested more;
# the two phases do not overlap, and the root takes its three blocks while the others are done.
#
# Tried and not kept: all_reduce as the ring reduce-scatter then the direct all-gather (their own
# rows at 64 MiB, 61 and 62 ms in issue 3's command, summed to less than halving-doubling's
# 136 ms). As an algorithm (--ops all_reduce --algorithm all --sizes 16M,64M --iters 8, two
# runs, ms): 16 MiB 27.3 / 29.8 against halving-doubling's 27.4 / 30.7; 64 MiB 124.6 / 128.5
# against 118.3 / 119.7 (ring 113.1 / 113.4). The all-gather's receives cannot be posted until
# the reduce-scatter has read x, so a rank that finishes first sends into frames its peers keep
# and copy.
#
# Tried and not kept: the binomial-tree broadcast in segments (every segment's receive posted,
# each forwarded to the children as it lands; 1 MiB or 4 MiB segments; --ops broadcast
# --algorithm all --sizes 4M,16M,64M --iters 6, one run each, ms, segmented / whole). 8 ranks,
# 1 MiB: 4 MiB 7.8 / 6.7, 16 MiB 26.4 / 26.5, 64 MiB 119.5 / 126.5; 4 MiB segments: 9.3 / 8.8,
# 28.3 / 27.4, 147.3 / 141.2. 4 ranks, 1 MiB: 5.7 / 4.9, 18.2 / 19.2, 67.7 / 69.2; 4 MiB: 6.8 / 6.7,
# 15.5 / 16.8, 66.0 / 76.6. Level within this box's noise: its loopback is bound by the CPU
# of the kernel's copies, which segments do not reduce. A link-bound network, where a pipeline
# pays off, was not available to measure.
#
# all_gather at 8 ranks (--ops all_gather --algorithm all --sizes 64K,1M,4M,16M --iters 6, two
# runs, medians in us; size = the gathered output), bruck / direct / recursive doubling / ring:
#   64 KiB  2285 / 2764 / 1391 / 3346,     1910 / 1959 / 1329 / 2762
#    1 MiB  5053 / 3790 / 3000 / 4719,     4153 / 3612 / 2310 / 3896
#    4 MiB 10955 / 7880 / 7613 / 9593,    11502 / 8634 / 8540 / 12265
#   16 MiB 51403 / 36460 / 37951 / 36291, 49622 / 34239 / 38810 / 35923
# At 6 ranks (one run, the same sizes less a few bytes to divide by 6): bruck / direct / recursive
# doubling / ring 1521 / 1192 / 1180 / 1944; 3139 / 2303 / 2829 / 3126; 12287 / 8201 / 9630 / 10044;
# 38891 / 28096 / 33251 / 30081. So at 8 ranks recursive doubling to 4 MiB gathered (bruck and
# ring were the defaults there), then direct; direct at every size at 5-7 ranks (6 measured).
#
# Broadcast across hosts: the pipelined chain (collectives/broadcast_chain.py) against the tree and
# flat with every rank in its own network namespace behind 1 Gbit/s links (bench/netem.py -n N
# --rate 1gbit -- --ops broadcast --algorithm all --iters 3-5; medians, chain / tree / flat):
#   4 ranks:  32 KiB 0.30 / 0.34 / 0.25 ms; 64 KiB 0.56 / 0.47 / 0.43; 128 KiB 0.72 / 1.66 / 2.56;
#             256 KiB 1.69 / 3.69 / 5.79 and 1.64 / 3.41 / 5.93; 1 MiB 7.9 / 23.4 / 25.0;
#             4 MiB 38.1 / 78.0 / 103.7; 16 MiB 155 / 345 / 420 (busbw 0.11 GB/s: the link's rate)
#   8 ranks:  64 KiB 1.29 / 0.83 / 2.42 ms; 256 KiB 2.89 / 5.43 / 14.1; 1 MiB 9.8 / 45.4 / 61.1;
#             16 MiB 191 / 552 / 981
# 256 KiB segments instead of nbytes/8 (clamped to 64 KiB-1 MiB) gave the same (4 ranks: 1.92,
# 7.99, 34.6, 141.7 ms at 256 KiB-16 MiB). So across hosts the chain from 128 KiB at up to 8
# ranks (Rule.hosts = "several"); more ranks were not measured (its fill grows with n: it needs
# about (n - 2) / (log2 n - 1) segments to beat the tree). On one host the table is unchanged.
# At 12 and 16 ranks (session 8; bench/netem.py -n N --rate 1gbit -- --ops broadcast --algorithm all
# --sizes 128K,256K,512K,1M --iters 5; ms, chain / tree; 16 ranks also from a first run with 64K and
# 4M): 16 ranks 64 KiB 4.1 / 2.4; 128 KiB 5.5 / 3.7, 7.8 / 5.4; 256 KiB 7.4 / 10.5, 9.0 / 8.6;
# 512 KiB 11.3 / 22.8; 1 MiB 21.1 / 68.0, 20.9 / 63.7; 4 MiB 80 / 282. 12 ranks: 128 KiB 2.4 / 2.4;
# 256 KiB 3.9 / 7.5; 512 KiB 8.1 / 23.3; 1 MiB 12.7 / 50.5. (16 processes on this box's 2 cores are
# CPU-bound below the links' rate there: the chain's busbw was 0.05 GB/s, not 0.11.) At 100 Mbit/s
# and 16 ranks the chain won from 64 KiB (5.1 / 17.0 ms, 1 MiB 81 / 610 ms), but tc's 256 KB burst
# lets the smaller messages through unshaped. So across hosts the chain from 512 KiB at 9-16 ranks;
# more than 16 ranks were not measured.
# The other collectives under the same links at 4 ranks (64 KiB, 1 MiB, 16 MiB; one run):
# all_reduce halving-doubling 0.65 / 12.3 / 223 ms, ring 1.81 / 12.0 / 229, recursive doubling
# 0.62 / 17.3 / 310; all_gather direct 0.64 / 5.6 / 121, ring 0.88 / 5.8 / 119, recursive
# doubling 0.59 / 6.2 / 144, bruck 0.80 / 6.3 / 124. The defaults there were within 3%
# of the best but at all_gather 1 MiB (6.2 against direct's 5.6 ms, 11%); no rule of their own yet.
# Under the same links at 4 ranks (--ops reduce,gather,scatter,all_to_all,reduce_scatter
# --algorithm all --sizes 64K,1M,16M --iters 3, one run, ms): reduce rabenseifner / tree 0.54 / 0.64,
# 12.0 / 16.8, 217 / 282 (so across hosts from 1 MiB: Rule.hosts = "several"); gather direct / tree
# 0.06 / 0.12, 2.2 / 4.5, 103 / 104; scatter direct / tree 0.27 / 0.38, 5.5 / 6.4, 102 / 137.
#
# all_gather across hosts at 4 ranks (bench/netem.py -n 4 --rate 1gbit -- --ops all_gather
# --algorithm all --sizes 64K,256K,1M --iters 5; two runs, us, direct / recursive doubling):
# 64 KiB 645 / 621, 498 / 702; 256 KiB 1176 / 1011, 923 / 1214; 1 MiB 5458 / 6394, 5738 / 6232
# (and 5623 / 6211 in the first run above). So direct from 1 MiB gathered across hosts; below
# that the two took turns.
#
# all_reduce and all_gather across hosts at 8 and 16 ranks (session 8; bench/netem.py -n N --rate 1gbit
# -- --ops all_gather,all_reduce --algorithm all --iters 3; medians in ms). all_reduce, halving-doubling
# / ring:
#   8 ranks:  1 MiB 15.5 / 15.3, 16.3 / 15.5; 2 MiB 35.9 / 31.0; 4 MiB 83.3 / 61.8, 78.9 / 62.3;
#             16 MiB 364 / 270, 369 / 263
#   16 ranks: 256 KiB 15.2 / 32.7; 1 MiB 28.5 / 34.6; 2 MiB 57.5 / 58.7; 4 MiB 121.8 / 83.8, 133.3 / 106.6;
#             16 MiB 450 / 339, 450 / 372
#   4 ranks:  4 MiB 55.1 / 52.9; 16 MiB 229.8 / 218.7 (and 223 / 229 in the first runs above)
# So ring across hosts at 8-16 ranks from 4 MiB; at 4 ranks the two are level and the table is
# unchanged; more ranks were not measured (ring's 2(n-1) steps grow with n). (Recursive doubling was 1.5-2.3x slower than either from 1 MiB.) all_gather at 8
# ranks, gathered size, direct / recursive doubling / ring (three runs at 1 and 4 MiB, two at 2 MiB):
#   1 MiB 7.1 / 7.4 / 7.9, 8.3 / 9.6 / 9.3, 6.8 / 9.0 / 8.3; 2 MiB 18.6 / 20.2 / 16.4, 16.2 / 20.1 / 15.4;
#   4 MiB 42.4 / 42.2 / 31.4, 49.2 / 50.9 / 33.6, 54.5 / 35.6 / 32.0; 16 MiB 143 / 191 / 140, 144 / - / 139
# (bruck: 8.5, 37.7 and 174 ms at 1, 4 and 16 MiB). So at 8 ranks across hosts direct from 1 MiB
# gathered and ring from 2 MiB. At 16 ranks (one run) recursive doubling, bruck, direct and ring
# were within noise of each other at 1 and 4 MiB (14.5-16.8 and 54.8-59.7 ms) and ring was fastest at
# 16 MiB (157 against 209-280 ms), the table's choice there already.
#
# all_gather with several ranks per host (session 8; bench/netem.py -n H --per-node K --shm off --rate
# 1gbit -- --ops all_gather --algorithm all --sizes 256K,1M,4M,16M --iters 3, one run each; the
# launcher's layout, host i holding ranks iK..iK+K-1; ms, gathered size, direct / recursive
# doubling / ring):
#   2 hosts x 2:  256 KiB 1.45 / 1.90 / 1.33; 1 MiB 7.9 / 9.4 / 5.3; 4 MiB 36.1 / 35.4 / 25.7; 16 MiB 142 / 170 / 108
#   2 hosts x 4:  256 KiB 3.2 / 3.4 / 3.0;    1 MiB 16.7 / 19.2 / 7.3; 4 MiB 73.6 / 74.0 / 30.4; 16 MiB 288 / 324 / 130
#   4 hosts x 2:  256 KiB 2.6 / 2.3 / 2.8;    1 MiB 12.3 / 14.6 / 7.0; 4 MiB 69.3 / 55.0 / 30.7; 16 MiB 235 / 244 / 126
# (and 2 x 2 with shm on, the same fallback: 1 MiB 8.3 / 8.4 / 5.9, 16 MiB 141 / 162 / 111). Direct and
# recursive doubling send every rank's block across the hosts' links once per remote rank; the
# ring, with each host's ranks in one run, once per host. So from 1 MiB gathered the ring for
# that layout (Rule.hosts = "packed"), and direct only with one rank per host ("spread", where
# it was measured). Interleaved layouts (host a, b, a, b) keep the one-host rules: the ring would
# cross the link at every step there, and they were not measured.#
# all_reduce with several ranks per host over TCP (shared memory off; the same runs' layout; ms,
# halving-doubling / recursive doubling / ring; a second run is below, with reduce's):
#   2 hosts x 2:  64 KiB 0.63 / 0.62 / 1.79; 256 KiB 3.4 / 4.0 / 2.9; 1 MiB 16.8 / 17.8 / 12.1;
#                 4 MiB 76.2 / 74.5 / 51.5; 16 MiB 298 / 319 / 221
#   2 hosts x 4:  64 KiB 2.2 / 1.6 / 4.8; 256 KiB 7.4 / 8.6 / 5.2; 1 MiB 34.6 / 37.8 / 14.1;
#                 4 MiB 147 / 156 / 63; 16 MiB 599 / 650 / 251
# Per host and direction the ring sends 2(n-1)/n of the array over the link, halving-doubling's
# first reduce-scatter step and last all-gather step alone send K/2 arrays (K ranks per host). So
# the ring from 256 KiB for that layout.#
# reduce and broadcast with several ranks per host (shared memory off; one run each, ms):
#   reduce rabenseifner / tree, 2 hosts x 2: 256 KiB 2.25 / 1.60; 1 MiB 9.6 / 8.0; 4 MiB 42.2 / 35.5;
#     16 MiB 176 / 170; 2 hosts x 4: 256 KiB 3.0 / 1.6; 1 MiB 10.4 / 10.4; 4 MiB 46.1 / 40.9; 16 MiB 193 / 186
#   broadcast chain / tree, 2 hosts x 2: 256 KiB 1.91 / 1.74; 1 MiB 7.6 / 8.4; 4 MiB 34.2 / 36.1;
#     16 MiB 142 / 146; 2 hosts x 4: 256 KiB 1.95 / 1.38; 1 MiB 9.0 / 9.1; 4 MiB 39.1 / 39.9; 16 MiB 145 / 157
# A second run (256 KiB, 1 MiB, 4 MiB): reduce 2.24 / 1.61, 9.2 / 8.0, 42.3 / 35.7 (2 x 2) and
# 3.4 / 2.2, 10.7 / 9.9, 47.0 / 40.4 (2 x 4); broadcast 2.01 / 1.79, 7.6 / 8.6, 33.9 / 35.2 (2 x 2)
# and 1.68 / 0.95, 8.5 / 7.9, 38.2 / 37.4 (2 x 4); all_reduce halving-doubling / ring 3.6 / 2.9,
# 17.1 / 12.1, 75.7 / 53.8 (2 x 2) and 7.4 / 6.3, 34.4 / 14.0, 145.6 / 63.1 (2 x 4).
# With each host's ranks in one run the tree sends the array between two hosts once, as the chain
# does, so the chain only wins from 1 MiB, where its pipeline pays; Rabenseifner's ring and gather
# send more than that between hosts, so the tree there at every size (Rule.hosts = "packed").#
# The same emulation at 10 Gbit/s is not a multi-host regime: all the "hosts" share this box's 2
# cores, and the collectives reach 0.3-0.7 GB/s busbw against the links' 1.25, so the CPU of the
# copies bounds them as on loopback. (bench/netem.py -n N --rate 10gbit -- --ops broadcast,reduce
# --algorithm all --sizes 256K,512K,1M,2M,4M --iters 5, one run each; ms, medians.) There the
# across-host rules lose at 8 ranks up to 1-2 MiB: broadcast chain / tree 256 KiB 2.0 / 1.7,
# 512 KiB 4.5 / 2.7, 1 MiB 7.0 / 5.5, 2 MiB 11.2 / 11.3, 4 MiB 18.7 / 20.2; reduce rabenseifner /
# tree 1 MiB 7.9 / 5.1, 2 MiB 11.7 / 10.9, 4 MiB 22.5 / 23.8. At 4 ranks they held: chain / tree
# 256 KiB 0.50 / 0.51, 1 MiB 2.3 / 2.8, 4 MiB 6.8 / 11.6 (a first run: 0.88 / 0.56 at 256 KiB);
# rabenseifner / tree 1 MiB 2.4 / 2.4, 4 MiB 7.8 / 10.2. The rules stay as the link-bound runs
# set them: a real 10 Gbit/s cluster, where every host has its own cores, was not available to
# say where between the two regimes it falls.
#
# Tried and not kept (session 8): a direct all_reduce for tiny arrays (every rank sends its array
# to every other in one round, reads each peer's straight off its socket, then folds all n in rank
# order): one latency instead of recursive doubling's log2(n) rounds. Against recursive doubling,
# alternating with each other and no peer (--ops all_reduce --algorithm all --sizes 4,1K,16K,64K
# --shm off --iters 40, 4 ranks, two runs, medians us, direct / recursive doubling): 4 B 434 / 354,
# 344 / 336; 1 KiB 486 / 453, 476 / 411; 16 KiB 589 / 487, 547 / 470; 64 KiB 683 / 559, 660 / 487.
# Its minima were 30-50% higher. Three sends and three receives per rank cost more on 2 cores than
# the second round they save.
#
# The same runs beside Gloo (--compare gloo) show what the slot after the peer's call costs:
# --algorithm all puts the variants in a fixed order, and the first after Gloo's call is the cold
# one. There direct (first) took 670 and 702 us at 4 B, and recursive doubling (third) 463 and
# 477 us, 2.52x and 2.43x Gloo's 1166 and 1160 us; run alone in issue 3's command, where it always
# follows Gloo, recursive doubling's 4 B was 1.55-1.97x this session.
#
# Where a cold 4 B all_reduce's time goes, phase by phase (session 8; a probe, not kept: `barrier;
# t0; all_reduce(4 B); t1` 200 times at 4 ranks over TCP, with Call.sendrecv and recv_now wrapped
# to stamp their entry and exit; medians per rank in us, a 7 ms pause before each barrier / none):
#
#   from t0 to the first sendrecv (api checks, table, fingerprint, open_call, watch, the plan)  70-100 / 21
#   first sendrecv (its send and the wait for the partner)                                      50-270 / 23-125
#   between the two rounds (one reduce_now of 1 element)                                        12-26 / 4-5
#   second sendrecv                                                                             40-113 / 17-20
#   from the last sendrecv to t1                                                                 9-18 / 5-7
#   slowest rank, t0 to t1                                                                      450-646 / 214
#   barrier exit skew (last rank out minus first)                                               198-289 / 75
#
# The set-up's time was spread evenly (10th-90th percentile 70-125 us), not a few preempted calls,
# and it was as slow when the 7 ms pause was a busy loop instead of a sleep (91-98 us), so it is not
# the vCPU halting or its clock slowing: every line of Python runs ~4x slower for a while after the
# process has been away from its core, on this nested virtual machine (nested_pvm=1 on the kernel's
# command line). Touching 8 MiB between calls instead (no pause) cost less: 35 us. A shorter path per
# call would shrink this in proportion; last session's probe without NumPy in the rounds did not
# show it (above), and the set-up is already memoised where it repeats (table choice, fingerprint,
# plan). The bench's Gloo peer puts its own calls between ours, so every one of ours is cold there.
