"""``python -m collectives.tune -n N``: measure this machine, then write the rules the runtime loads.

    python -m collectives.tune -n 4            # this host, 4 ranks: the bench grid, 4 B .. 64 MiB
    python -m collectives.tune -n 2 --quick    # a few small sizes, seconds (a smoke test)
    python -m collectives.tune -n 4 --all      # time every algorithm, not only the model's close ones
    python -m collectives.tune -n 4 --explain  # the rules, lines and settings this machine has for 4 ranks

It launches N ranks on this host (``python -m runtime.launch``), which (``measure``, also the probe at
init's: collectives/tuneprobe.py):

1. **probe** the cost model's terms (collectives/costmodel.py), every pair of ranks at once, so
   contention is in the figures;
2. **time the settings**: the compiled small shared-memory path on and off (``shm_compiled``),
   the shared-memory all_reduce's copies streamed or not at 1-64 MiB (``shm_stream_min``);
3. **time** the algorithms at every size of the grid (those the model puts within CLOSE of its
   best, the table's choice; ``--all``: every one); the slowest rank's median; the clock picks,
   and the table's choice stays within TIE of the fastest;
4. **fit** each algorithm's line ``alpha + n beta`` (collectives/tunefit.py): a boundary between
   two sizes with different winners where their lines cross (else the geometric midpoint), past
   the grid the lower envelope of the lines timed at its top (``--quick``: the table);
5. rank 0 **writes** the rules file (collectives/tunefile.py) for shared memory on and off, the
   first rank of each other host its copy where that host's filesystem lacks it.

Across hosts: ``--launched`` under any launcher with ``--nnodes`` (``bench/netem.py -n 2 --per-node 2
-- -m collectives.tune --launched``); the probe also pairs ranks on two hosts (``network``), the file
is keyed to the world's shape (tunefile.shape) and the table's choices are its layout's.

``--explain`` prints what the file gives (or, for a group size not tuned, what the nearest size's
lines give). Not here: the formulas (costmodel.py), loading the file (tunefile.py), choosing (registry.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

import runtime
from collectives import api, costmodel, p2p, registry, tunefile, tunefit
from collectives.comm import reduce_step
from collectives.slots import common, fastpath
from runtime import args as types
from runtime import env
from runtime.sharedmem.segments import shm_usable

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
       "barrier")
BLOCKED = {"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"}  # the size is n blocks
GRID = tuple(4 << (2 * k) for k in range(13))  # 4 B .. 64 MiB in x4 steps: bench/collectives.py's default grid
QUICK_GRID = (4, 64 << 10)
CLOSE = 3.0  # time the algorithms the model puts within this factor of its fastest
TIE = 0.05  # the table's choice stays unless another is this much faster
ITEMSIZE = 4  # float32, as the bench grid
SHM_ONLY = tunefile.SHM_ONLY
STREAM_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)  # the shared-memory all_reduce, streaming copies or not
NEVER = 1 << 62  # shm_stream_min where streaming never won
BURST = 16  # small messages sent back to back, for a link's ``o``
_now = time.perf_counter  # every duration measured (tests give each rank a clock of its own)


def registry_nbytes(collective: str, size: int, p: int) -> int:
    """The bytes registry.choose sees for the bench's ``size`` (nccl-tests': the whole array, the
    gathered output, the scattered input), float32, as bench/collectives.py builds its cases."""
    if collective == "barrier":
        return 0
    if collective in BLOCKED:
        block = max(1, size // ITEMSIZE // p)
        return block * ITEMSIZE * (p if collective in ("reduce_scatter", "all_to_all") else 1)
    return max(1, size // ITEMSIZE) * ITEMSIZE


def caller(collective: str, nbytes: int, p: int, rank: int):
    """A function that starts one call of ``collective`` on ``nbytes`` with a given algorithm."""
    count = nbytes // ITEMSIZE
    x = np.zeros(count, np.float32)  # zeros: sums stay finite however often they run
    wide = np.zeros(count * p, np.float32)
    small = np.zeros(count // p if collective in ("reduce_scatter",) else count, np.float32)
    calls = {
        "all_reduce": lambda a: api.all_reduce(x, algorithm=a),
        "all_gather": lambda a: api.all_gather(wide, x, algorithm=a),
        "reduce_scatter": lambda a: api.reduce_scatter(small, x, algorithm=a),
        "broadcast": lambda a: api.broadcast(x, src=0, algorithm=a),
        "reduce": lambda a: api.reduce(x, dst=0, algorithm=a),
        "gather": lambda a: api.gather(wide if rank == 0 else None, x, dst=0, algorithm=a),
        "scatter": lambda a: api.scatter(x, wide if rank == 0 else None, src=0, algorithm=a),
        "all_to_all": lambda a: api.all_to_all(small, x, algorithm=a),
        "barrier": lambda a: api.barrier(algorithm=a),
    }
    return calls[collective]


async def agreed_max(values) -> np.ndarray:
    """Every rank's ``values``, the largest of each over the ranks (the same array on every rank)."""
    a = np.array(values, np.float64).ravel()
    await api.all_reduce(a, op="max")
    return a


async def _clock(fn, reps: int) -> float:
    t0 = _now()
    for _ in range(reps):
        await fn()
    return (_now() - t0) / reps


def partners(nodes, rank: int) -> tuple[int | None, int | None]:
    """The probe's partners of ``rank`` among hosts ``nodes`` (a topology's ranks per host):
    (one on its host, one on another). Inside a host the ranks pair by their place on it (0-1,
    2-3, ...: ``r ^ 1`` on one host); across, the i-th rank of host h with the i-th of host
    ``h ^ 1``. None where that rank or host does not exist (an odd count): it measures nothing."""
    h = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    mine, j = nodes[h], nodes[h].index(rank)
    inside = mine[j ^ 1] if (j ^ 1) < len(mine) else None
    across = nodes[h ^ 1][j] if (h ^ 1) < len(nodes) and j < len(nodes[h ^ 1]) else None
    return inside, across


async def link_times(partner: int | None, lead: bool, sizes, quick: bool, tag: int) -> list[float]:
    """Half a ping-pong at each of ``sizes`` with ``partner`` (``lead``: this rank sends first),
    then a burst of BURST small messages and a reply; zeros without a partner. Every rank calls it
    (its barriers are the group's), every pair at once."""
    measured = []
    for nbytes in sizes:
        buf, reps = np.zeros(nbytes, np.uint8), (10 if quick else 30) if nbytes <= 64 << 10 else (3 if quick else 8)

        async def pingpong(buf=buf):
            if partner is None:
                return
            if lead:
                await p2p.send(buf, partner, tag=tag)
                await p2p.recv(buf, partner, tag=tag)
            else:
                await p2p.recv(buf, partner, tag=tag)
                await p2p.send(buf, partner, tag=tag)
        await _clock(pingpong, 2)
        await api.barrier()
        measured.append(await _clock(pingpong, reps) / 2 if partner is not None else 0.0)
    tiny = np.zeros(8, np.uint8)

    async def bursts():
        if partner is None:
            return
        for _ in range(BURST):
            await (p2p.send(tiny, partner, tag=tag + 1) if lead else p2p.recv(tiny, partner, tag=tag + 1))
        await (p2p.recv(tiny, partner, tag=tag + 2) if lead else p2p.send(tiny, partner, tag=tag + 2))
    await api.barrier()
    measured.append(await _clock(bursts, 3 if quick else 10))
    return measured


def fitted_link(sizes, halves, t_burst: float) -> costmodel.Link:
    """A link's terms from :func:`link_times`' figures (the largest over the ranks)."""
    alpha = float(halves[0])
    xs = np.array(sizes[1:], np.float64)
    beta = float(max(1e-13, np.dot(xs, np.asarray(halves[1:]) - alpha) / np.dot(xs, xs)))
    o = float(min(alpha, max(0.0, (t_burst - 2 * alpha) / (BURST - 1))))
    return costmodel.Link(alpha, o, beta)


async def probe(rt, quick: bool) -> costmodel.Machine:
    """The model's terms on this machine, the same on every rank (the largest any rank saw): TCP
    inside a host (``loopback``) between ranks that share one, between hosts (``network``, where
    the group spans several) between ranks on different ones, every pair at once."""
    r, topo = rt.rank, rt.world.topology
    inside, across = partners(topo.nodes, r)
    h = topo.node_of(r)
    sizes = (8, 1 << 20) if quick else (8, 64 << 10, 1 << 20, 4 << 20)
    measured = await link_times(inside, topo.nodes[h].index(r) % 2 == 0, sizes, quick, tag=7)
    if topo.hosts > 1:
        measured += await link_times(across, h % 2 == 0, sizes, quick, tag=10)
    a, b = np.zeros(1 << 20, np.float32), np.zeros(1 << 20, np.float32)
    await reduce_step(a, b, "sum")  # compiles the kernel first
    measured.append(await _clock(lambda: reduce_step(a, b, "sum"), 5 if quick else 20) / a.nbytes)

    async def copy():
        np.copyto(a, b)
    measured.append(await _clock(copy, 5 if quick else 20) / a.nbytes)
    # shared memory's round: a barrier of one host's ranks (a group per host where there are several)
    shm = rt.world.shm_enabled and shm_usable() and max(len(n) for n in topo.nodes) > 1
    host = api.new_subgroups(ranks=[list(n) for n in topo.nodes])[0] if shm and topo.hosts > 1 else None
    if shm:
        await api.barrier(group=host, algorithm="shm")
    measured.append(await _clock(lambda: api.barrier(group=host, algorithm="shm"), 20 if quick else 100)
                    if shm else 0.0)

    m = await agreed_max(measured)
    k = len(sizes) + 1
    network = fitted_link(sizes, m[k:2 * k - 1], m[2 * k - 1]) if topo.hosts > 1 else None
    # no two ranks on one host (every rank on a host of its own): TCP inside a host is not measured
    loopback = fitted_link(sizes, m[:k - 1], m[k - 1]) if any(m[:k - 1]) or network is None else network
    gamma, copy_s, shm_alpha = m[-3:]
    shared = costmodel.Link(float(shm_alpha) or loopback.alpha, float(shm_alpha) or loopback.alpha, float(copy_s))
    return costmodel.Machine(loopback, shared, float(gamma), float(copy_s), network)


def candidates(machine: costmodel.Machine, collective: str, p: int, nbytes: int, shm: bool, every: bool,
               layout: str = "one", hosts: int = 1) -> list[str]:
    """The algorithms to time: the model's close ones (among all, and among the TCP ones), the
    table's choices (shared memory on and off), or every one that can run here (ranks laid out
    on ``hosts`` hosts as ``layout``, runtime/topology.py)."""
    runnable = [a for a in registry.ALGORITHMS[collective] if registry.NEEDS.get(a, lambda s, lay: True)(shm, layout)]
    if every:
        return sorted(runnable)
    chosen = {registry._chosen(collective, nbytes, p, state, layout, hosts)[0] for state in {shm, False}}
    for allowed in (runnable, [a for a in runnable if a not in SHM_ONLY]):
        ranked = costmodel.ranking(machine, collective, p, nbytes, hosts, allowed)
        chosen |= {a for t, a in ranked if t <= CLOSE * ranked[0][0] or a == ranked[0][1]}
    return sorted(chosen)


async def time_calls(starts: dict, quick: bool) -> dict[str, float]:
    """The slowest rank's median seconds of each of ``starts`` (name -> a function starting one
    call), interleaved iteration by iteration; the same dict on every rank."""
    names = list(starts)
    first = []
    for name in names:  # warm-up, and an estimate of how many iterations fit the budget
        await api.barrier()
        t0 = _now()
        await starts[name]()
        first.append(_now() - t0)
    slowest = float((await agreed_max(first)).max())
    budget, lo, hi = (0.02, 2, 3) if quick else (0.4, 3, 15)
    iters = int(min(hi, max(lo, budget / max(slowest * len(names), 1e-6))))
    times = np.zeros((iters, len(names)))
    for i in range(iters):
        for j, name in enumerate(names):
            await api.barrier()
            t0 = _now()
            await starts[name]()
            times[i, j] = _now() - t0
    worst = (await agreed_max(times)).reshape(times.shape)
    return {name: float(np.median(worst[:, j])) for j, name in enumerate(names)}


async def time_algorithms(rt, collective: str, nbytes: int, names: list[str], quick: bool) -> dict[str, float]:
    """:func:`time_calls` of ``collective`` on ``nbytes`` with each algorithm of ``names``."""
    start = caller(collective, nbytes, rt.world_size, rt.rank)
    return await time_calls({name: functools.partial(start, name) for name in names}, quick)


def pick(times: dict[str, float], allowed, table: str | None) -> str | None:
    """The fastest of ``allowed`` measured; the table's choice where it is within TIE of it."""
    mine = {a: t for a, t in times.items() if a in allowed}
    if not mine:
        return table
    best = min(mine, key=lambda a: (mine[a], a))
    return table if table in mine and mine[table] <= mine[best] * (1 + TIE) else best


def fits_of(measured: dict) -> dict:
    """Each algorithm's line (tunefit.fit) over the sizes it was timed at: ``{collective: {name: [a, b]}}``."""
    out: dict = {}
    for collective, by_size in measured.items():
        points: dict = {}
        for nbytes, times in by_size.items():
            for name, t in times.items():
                points.setdefault(name, []).append((int(nbytes), t))
        lines = {name: list(tunefit.fit(pts)) for name, pts in points.items() if any(t > 0 for _, t in pts)}
        if lines:
            out[collective] = lines
    return out


@contextlib.contextmanager
def setting(name: str, value: str):
    """``os.environ[name] = value`` inside the block, as before after it."""
    old = env.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


async def measure_compiled(rt, quick: bool) -> bool | None:
    """Whether the compiled small shared-memory path is faster here: a 1 KiB all_reduce and a
    barrier on two groups of every rank, one made with RINGWEAVE_SHM_COMPILED=1 and one with 0
    (read when a group's domain is made); the heuristic's choice stays within TIE. None: no
    shared memory, or no compiled path on this machine."""
    p = rt.world_size
    if not (rt.world.shm_enabled and shm_usable() and fastpath.SUPPORTED):
        return None
    x, groups = np.zeros(256, np.float32), {}
    for value in ("1", "0"):
        with setting(env.SHM_COMPILED.name, value):
            groups[value] = api.new_subgroups(ranks=[list(range(p))])[0]
            await api.all_reduce(x, group=groups[value], algorithm="shm")  # its domain, made under the setting
            await api.barrier()  # every rank made its domain before any restores the setting

    async def small(g):
        await api.all_reduce(x, group=g, algorithm="shm")
        await api.barrier(group=g, algorithm="shm")
    times = await time_calls({v: functools.partial(small, g) for v, g in groups.items()}, quick)
    heuristic = "1" if common.own_cores(rt.world, p) else "0"
    return pick(times, times, heuristic) == "1"


async def measure_stream_min(rt, sizes, quick: bool) -> int | None:
    """The shared-memory all_reduce's ``shm_stream_min``: the smallest of ``sizes`` (bytes) from
    which copies by non-temporal stores win at every larger size too, cut at the geometric
    midpoint below it (:data:`NEVER` where they never win); within TIE the default's side stays.
    None: no shared memory, or no sizes."""
    if not (rt.world.shm_enabled and shm_usable()) or not sizes:
        return None
    default, won = env.SHM_STREAM_MIN.get(), []
    for nbytes in sizes:
        x = np.zeros(nbytes // ITEMSIZE, np.float32)

        async def run(threshold: int, x=x):
            with setting(env.SHM_STREAM_MIN.name, str(threshold)):
                await api.all_reduce(x, algorithm="shm")
        times = await time_calls({"stream": functools.partial(run, 0), "plain": functools.partial(run, NEVER)}, quick)
        won.append(pick(times, times, "stream" if nbytes >= default else "plain") == "stream")
    return stream_cut(sizes, won)


def stream_cut(sizes, won) -> int:
    """The threshold from (size, whether streaming won there) in rising size: where it wins from
    some size on; :data:`NEVER` where it does not win at the largest."""
    cut = NEVER
    for i in range(len(sizes) - 1, -1, -1):
        if not won[i]:
            break
        cut = int(math.sqrt(sizes[i - 1] * sizes[i])) + 1 if i else sizes[0]
    return cut


async def measure(rt, ops, grid, quick: bool, every: bool, stream_sizes=(), budget_s: float | None = None,
                  say=lambda *a, **k: None, beyond: bool = True) -> dict:
    """A rules file's content for this world, the same on every rank: the model's terms, each
    collective of ``ops`` timed at ``grid`` (bench sizes), the winners, the fitted lines, and the
    settings measured. Keyed to the world's shape (hosts, most ranks on one: tunefile.shape); the
    table's choices and the candidates are those of its layout. ``budget_s``: no further size is
    started once the slowest rank has spent this long (agreed, so every rank stops at the same
    size); the lines then carry the rules past it. ``beyond`` False (or ``quick`` without a
    budget): past the grid, the table."""
    p, t0, topo = rt.world_size, _now(), rt.world.topology
    hosts, per_host = tunefile.shape(rt.world, p)
    layout = topo.layout
    machine = await probe(rt, quick)
    say("# model: " + "; ".join(f"{name} alpha {ln.alpha * 1e6:.1f} us, o {ln.o * 1e6:.1f} us, {_rate(ln.beta)}"
                                for name, ln in (("loopback", machine.loopback), ("network", machine.network))
                                if ln is not None)
        + f"; shared memory alpha {machine.shm.alpha * 1e6:.1f} us; reduce {_rate(machine.gamma)}, copy "
        f"{_rate(machine.copy)}", flush=True)
    shm = rt.world.shm_enabled
    rules: dict = {"shm": {}, "tcp": {}} if shm else {"tcp": {}}
    first = next(iter(rules))
    measured: dict = {}
    settings: dict = {}
    if hosts == 1:  # each setting is timed on the world's own shared memory: one host's
        compiled = await measure_compiled(rt, quick)
        if compiled is not None:
            settings["shm_compiled"] = compiled
        stream = await measure_stream_min(rt, tuple(stream_sizes), quick)
        if stream is not None:
            settings["shm_stream_min"] = stream
    say(f"# settings: {settings}", flush=True)
    over = False
    for collective in ops:
        sizes = sorted({registry_nbytes(collective, s, p) for s in (grid if collective != "barrier" else (0,))})
        winners: dict = {state: [] for state in rules}
        for nbytes in sizes:
            if budget_s is not None and (over or float((await agreed_max([_now() - t0]))[0]) > budget_s):
                over = True
                break
            names = candidates(machine, collective, p, nbytes, shm, every, layout, hosts)
            times = await time_algorithms(rt, collective, nbytes, names, quick) if len(names) > 1 else {}
            measured.setdefault(collective, {})[str(nbytes)] = times
            for state in rules:
                on = state == "shm"
                allowed = [a for a in names if on or a not in SHM_ONLY]
                table = registry._chosen(collective, nbytes, p, on, layout, hosts)[0]
                winners[state].append((nbytes, pick(times, allowed, table)))
            if times:
                say(f"{collective:>14} {nbytes:>10} B  " + "  ".join(
                    f"{a}{'*' if a == winners[first][-1][1] else ''} {t * 1e6:.0f}us"
                    for a, t in sorted(times.items(), key=lambda kv: kv[1])), flush=True)
        if not winners[first]:
            continue
        lines = fits_of({collective: measured[collective]}).get(collective, {})
        last = measured[collective][str(winners[first][-1][0])]  # a line past the grid: timed at its top
        for state in rules:
            tail = {a: ln for a, ln in lines.items() if a in last and (state == "shm" or a not in SHM_ONLY)}
            rules[state][collective] = tunefit.thresholds(winners[state], lines,
                                                          beyond and (not quick or budget_s is not None), past=tail)
    return {"format": tunefile.FORMAT, "key": tunefile.machine_key(p, hosts, per_host), "model": machine.to_json(),
            "rules": rules, "times": measured, "fits": fits_of(measured), "settings": settings,
            "written": time.strftime("%Y-%m-%d %H:%M:%S")}


def _rate(seconds_per_byte: float) -> str:
    return f"{1e-9 / seconds_per_byte:.2f} GB/s" if seconds_per_byte > 0 else "unbounded"


def explain(rules: tunefile.TuneRules | None, world: int, hosts: int = 1) -> str:
    """What registry.choose takes from ``rules`` for ``world`` ranks on ``hosts`` hosts of this
    machine's kind (as many on each as fit: -n 4 --hosts 2 is 2x2), as text."""
    key = tunefile.machine_key(world, hosts, -(-world // hosts))
    if rules is None:
        where = "this machine" if hosts == 1 else f"{hosts} hosts x {key['per_host']} of this machine's kind"
        return (f"no rules for {world} ranks on {where} ({tunefile.default_path(key)}; RINGWEAVE_TUNE="
                f"{int(env.TUNE.get())}): the built-in table chooses")
    out = [f"rules: {rules.path}", f"key: {json.dumps(rules.key, sort_keys=True)}",
           f"settings: {json.dumps(rules.settings, sort_keys=True)} (RINGWEAVE_SHM_COMPILED / "
           "RINGWEAVE_SHM_STREAM_MIN, where set, win)"]
    m = rules.model
    if m is not None:
        out.append("model terms: " + "; ".join(
            f"{name} alpha {link.alpha * 1e6:.1f} us, o {link.o * 1e6:.1f} us, 1/beta {_rate(link.beta)}"
            for name, link in (("loopback", m.loopback), ("network", m.network), ("shm", m.shm)) if link is not None)
            + f"; reduce {_rate(m.gamma)}, copy {_rate(m.copy)}")
    for collective in sorted(rules.fits):
        out.append(f"{collective}: t = alpha + n beta, fitted to the times measured")
        for name, (alpha, beta) in sorted(rules.fits[collective].items(), key=lambda kv: kv[1][0]):
            over = "shm" if name in SHM_ONLY else "tcp"
            out.append(f"  {name:>20} ({over})  alpha {alpha * 1e6:9.1f} us  1/beta {_rate(beta)}")
    for state, table in sorted(rules.rules.items()):
        for collective, entries in sorted(table.items()):
            lo, parts = 0, []
            for upto, name in entries:
                parts.append(f"{lo}..{'' if upto is None else upto} B {name or '(table)'}")
                lo = (upto or 0) + 1
            out.append(f"[{state}] {collective}: " + ", ".join(parts))
    return "\n".join(out)


async def shared(rt, doc: dict) -> dict:
    """Rank 0's ``doc`` on every rank (JSON, never pickle: its length, then its bytes)."""
    data = json.dumps(doc, sort_keys=True).encode() if rt.rank == 0 else b""
    size = np.array([len(data)], np.int64)
    await api.broadcast(size, src=0)
    buf = np.frombuffer(data, np.uint8).copy() if rt.rank == 0 else np.zeros(int(size[0]), np.uint8)
    await api.broadcast(buf, src=0)
    return json.loads(buf.tobytes())


async def write_on_every_host(rt, doc: dict, path: str) -> bool:
    """Rank 0 writes ``doc`` (the same on every rank) to ``path``; then the first rank of each
    other host writes its own copy where that host does not hold it already (hosts with a
    filesystem of their own; emulated hosts share one). Returns whether this rank wrote."""
    topo, wrote = rt.world.topology, False
    if rt.rank == 0:
        tunefile.save(doc, registry.ALGORITHMS, path)
        wrote = True
    await api.barrier()
    if rt.rank != 0 and topo.nodes[topo.node_of(rt.rank)][0] == rt.rank and not tunefile.holds(path, doc):
        tunefile.save(doc, registry.ALGORITHMS, path)
        wrote = True
    await api.barrier()
    return wrote


async def loaded_by_a_job(rt, doc: dict, path: str, ops) -> str:
    """Whether every rank of this world, as a job of its shape, now loads the file at ``path``
    (tunefile.for_group), and what registry.choose then takes for each of ``ops`` at the
    smallest size timed, as a line of text (the same on every rank)."""
    registry.forget()
    rules = tunefile.for_group(rt.world)
    missing = await agreed_max([0.0 if rules is not None and rules.path == path else 1.0 + rt.rank])
    if missing[0]:
        return (f"# NOT loaded by rank {int(missing[0]) - 1} of a job of this shape (RINGWEAVE_TUNE="
                f"{int(env.TUNE.get())}, RINGWEAVE_TUNE_FILE={env.TUNE_FILE.get() or ''}): the table chooses there")
    p, chosen = rt.world_size, []
    for collective in ops:
        sizes = sorted(int(n) for n in doc["times"].get(collective, {}))
        if sizes:
            chosen.append(f"{collective} {sizes[0]} B {registry.choose(collective, sizes[0], p, group=rt.world)[0]}")
    return f"# every rank of a job of this shape loads it; it chooses {', '.join(chosen) or 'as the table'}"


def command(args, hosts: int, per_host: int) -> str:
    """The command recorded in the file."""
    flags = (" --quick" if args.quick else "") + (" --all" if args.all else "") + (
        f" --max-size {args.max_size}" if args.max_size is not None else "") + (
        f" --ops {','.join(args.ops)}" if tuple(args.ops) != OPS else "")
    if hosts == 1:
        return f"python -m collectives.tune -n {hosts * per_host}{flags}"
    return f"python -m collectives.tune --launched{flags} (on {hosts} hosts, at most {per_host} ranks on one)"


async def rank_main(args) -> None:
    rt = await runtime.init()
    p, r = rt.world_size, rt.rank
    say = print if r == 0 else (lambda *a, **k: None)
    try:
        hosts, per_host = tunefile.shape(rt.world, p)
        stream_sizes = () if args.quick or "all_reduce" not in args.ops or hosts > 1 else STREAM_SIZES
        grid = QUICK_GRID if args.quick else tuple(s for s in GRID if args.max_size is None or s <= args.max_size)
        doc = await measure(rt, args.ops, grid, args.quick, args.all, stream_sizes, say=say,
                            beyond=args.max_size is None)
        doc["command"] = command(args, hosts, per_host)
        doc = await shared(rt, doc)
        path = args.out or tunefile.default_path(doc["key"])
        await write_on_every_host(rt, doc, path)
        say(f"# rules written to {path} (RINGWEAVE_TUNE=0 ignores them)", flush=True)
        line = await loaded_by_a_job(rt, doc, path, args.ops) if args.out is None else ""
        say(line or f"# a job loads them with RINGWEAVE_TUNE_FILE={path}", flush=True)
    finally:
        await runtime.shutdown()


def size(text: str) -> int:
    """Bytes from ``4096``, ``64K``, ``1M`` or ``1G`` (binary units); ValueError otherwise."""
    units = {"": 0, "K": 10, "M": 20, "G": 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if not t[:-1 if t[-1:] in units else None].isdigit():
        raise ValueError(f"{text!r} is not a size such as 4096, 64K or 1M")
    return int(t[:-1]) << units[t[-1]] if t[-1] in units else int(t)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m collectives.tune", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--nproc", type=types.positive_int, default=2, help="ranks on this host, as the jobs to tune run (default 2)")
    p.add_argument("--quick", action="store_true", help="a few small sizes and iterations (seconds)")
    p.add_argument("--all", action="store_true", help="time every algorithm, not only the model's close ones")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list from {OPS} (default all)")
    p.add_argument("--out", default=None, help="the file to write (default: the cache's, keyed to this machine)")
    p.add_argument("--timeout-s", type=types.positive_seconds, default=900.0, help="stop the ranks after this long (default 900)")
    p.add_argument("--max-size", type=size, default=None,
                   help="time the grid up to this size (bytes, or 64K, 1M), past it the table (default: to 64M)")
    p.add_argument("--explain", action="store_true",
                   help="print the rules this machine has for -n ranks (lines, boundaries, settings); measure nothing")
    p.add_argument("--hosts", type=types.positive_int, default=1,
                   help="with --explain: the rules for -n ranks on this many hosts of this kind (default 1)")
    p.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad or args.nproc < 2:
        p.error(f"--ops: unknown {bad}; choose from {OPS}" if bad else "-n must be 2 or more")
    if args.hosts != 1 and not args.explain:
        p.error("--hosts goes with --explain; to measure across hosts, launch --launched on each (--nnodes)")
    if args.max_size is not None and args.max_size < GRID[0]:
        p.error(f"--max-size {args.max_size}: below the grid's smallest size, {GRID[0]} B")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.explain:
        per_host = -(-args.nproc // args.hosts)
        print(explain(tunefile.rules_for(args.nproc, args.hosts, per_host, registry.ALGORITHMS), args.nproc,
                      args.hosts))
        return 0
    if args.launched:
        asyncio.run(rank_main(args))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([root] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    cmd = [sys.executable, "-m", "runtime.launch", "-n", str(args.nproc), "--max-time-s", str(args.timeout_s),
           "-m", "collectives.tune", *argv, "--launched"]
    return subprocess.call(cmd, env=dict(os.environ, PYTHONPATH=path))


if __name__ == "__main__":
    sys.exit(main())
