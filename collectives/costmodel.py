"""A cost model of every registered algorithm: seconds from latency, overhead and bandwidth terms.

A :class:`Link` holds one transport's terms, LogP/Hockney style: ``alpha`` (seconds for a message
whose sender waited for the one before: a round), ``o`` (seconds for each further message sent
back to back, which does not wait) and ``beta`` (seconds per byte). :class:`Machine` holds a link
per transport (``loopback``: TCP inside a host; ``network``: TCP between hosts; ``shm``: shared
memory), ``gamma`` (seconds per byte reduced) and ``copy`` (seconds per byte copied in memory).

:func:`predict` gives one algorithm's time for ``nbytes`` (the registry's size: one rank's
input) on ``p`` ranks; :func:`ranking` orders a collective's algorithms by it. The formulas follow
each algorithm file's message counts and sizes, segmenting included (SEGMENT_NBYTES, the
EXCHANGE/RECV_NOW thresholds, the chain's segment_bounds, the folds of a non-power-of-two world),
and give the critical path of one rank: e.g. ring all_reduce
``2(p-1) nseg alpha + 2(p-1)/p n beta + (p-1)/p n gamma``. Every formula is written out in
docs/design.md, "The cost model".

What it is not: a simulator. It ignores contention between ranks unless the terms were measured
under it (collectives/tune.py measures every pair at once for that reason) and the overlap of
reductions with transfers; the tuner times the real algorithms wherever the model's candidates are
close and trusts the clock over the model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from collectives.algorithms.tcp.broadcast_chain import segment_bounds
from collectives.tuning import SEGMENT_NBYTES
from runtime.sharedmem.domains import SMALL_NBYTES
from runtime.transport import RECV_NOW_NBYTES

__all__ = ["Link", "Machine", "FORMULAS", "predict", "ranking"]


@dataclass(frozen=True)
class Link:
    """One transport's terms, in seconds: a round (``alpha``), a message sent back to back with
    the one before (``o``), a byte (``beta``)."""
    alpha: float  # e.g. 30e-6: half a ping-pong of a tiny message
    o: float  # e.g. 8e-6: each further message of a burst
    beta: float  # e.g. 1e-9: 1 GB/s

    def msg(self, nbytes: float) -> float:
        """One round carrying ``nbytes``."""
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Machine:
    """The terms of a machine and layout; ``network`` None: one host (loopback serves TCP)."""
    loopback: Link
    shm: Link
    gamma: float  # seconds per byte reduced, e.g. 0.5e-9
    copy: float  # seconds per byte copied, e.g. 0.2e-9
    network: Link | None = None

    def tcp(self, hosts: int) -> Link:
        """The link TCP messages cross: between hosts where there are several and it is known."""
        return self.network if hosts > 1 and self.network is not None else self.loopback

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Machine":
        """The inverse of :meth:`to_json`; ValueError naming a missing or bad term."""
        links = {}
        for name in ("loopback", "shm", "network"):
            raw = d.get(name)
            if raw is None and name == "network":
                links[name] = None
                continue
            if not isinstance(raw, dict) or set(raw) != {"alpha", "o", "beta"}:
                raise ValueError(f"model.{name} must be {{alpha, o, beta}}, got {raw!r}")
            links[name] = Link(**{k: _term(f"model.{name}.{k}", v) for k, v in raw.items()})
        return cls(links["loopback"], links["shm"], _term("model.gamma", d.get("gamma")),
                   _term("model.copy", d.get("copy")), links["network"])


def _term(where: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where} must be a finite number >= 0, got {v!r}")
    return float(v)


def _log2(p: int) -> int:
    return max(0, (p - 1).bit_length())  # ceil(log2 p)


def _pow2_below(p: int) -> int:
    return 1 << (p.bit_length() - 1)  # the largest power of two <= p


def _segs(nbytes: float, seg: int = SEGMENT_NBYTES) -> int:
    return max(1, math.ceil(nbytes / seg))


def _fold(link: Link, m: Machine, p: int, nbytes: float, out: float | None = None) -> float:
    """The fold and unfold of a non-power-of-two world (ops.Fold): the array in, reduced
    (``out`` None) or placed, and ``out`` bytes (default the array) back."""
    if p == _pow2_below(p):
        return 0.0
    back = nbytes if out is None else out
    return link.msg(nbytes) + link.msg(back) + (nbytes * m.gamma if out is None else 0.0)


# -- one function per algorithm: (machine, p ranks, nbytes as registry.choose gets it, hosts) -> s --

def all_reduce_ring(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    chunk = math.ceil(n / p)
    nseg = _segs(chunk)
    return 2 * (p - 1) * (t.alpha + (nseg - 1) * t.o) + 2 * (p - 1) / p * n * t.beta + (p - 1) / p * n * m.gamma


def all_reduce_halving_doubling(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t, q = m.tcp(hosts), _pow2_below(p)
    steps, msgs, size = _log2(q), 0, n
    for _ in range(steps):  # reduce-scatter halves; the all-gather doubles back the same sizes
        size /= 2
        msgs += _segs(size) - 1 if n > 2 * RECV_NOW_NBYTES else 0
    vol = (q - 1) / q * n
    return _fold(t, m, p, n) + 2 * steps * t.alpha + 2 * msgs * t.o + 2 * vol * t.beta + vol * m.gamma


def all_reduce_recursive_doubling(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t, q = m.tcp(hosts), _pow2_below(p)
    return _fold(t, m, p, n) + _log2(q) * (t.msg(n) + n * m.gamma + (n * m.copy if n else 0.0))


def all_reduce_shm(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    s = m.shm
    if n <= SMALL_NBYTES:  # one phase: copy in, reduce every peer's slot
        return s.alpha + n * s.beta + (p - 1) * n * (m.gamma + s.beta)
    part = (p - 1) / p * n
    return 2 * s.alpha + (2 * part + n / p) * s.beta + part * (m.gamma + s.beta)


def all_reduce_hierarchical(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    local = max(1, math.ceil(p / hosts))
    across = min(all_reduce_ring(m, hosts, n, hosts), all_reduce_halving_doubling(m, hosts, n, hosts)) \
        if hosts > 1 else 0.0  # (equal hosts: k flows of n/k share the host's link: an all_reduce of n)
    if p % hosts:  # unequal hosts: through the leaders, stage after stage (+ the leader's gather and spread)
        return all_reduce_shm(m, local, n) + m.shm.alpha + n * m.shm.beta + across
    s, part = m.shm, (local - 1) / local * n
    # equal hosts: one copy-in, local rank a reduces chunk a over the host, its all_reduce across,
    # the others copy it out; part by part, the crossing overlapping the reduction and the copies
    inside = 2 * s.alpha + n * s.beta + part * (m.gamma + s.beta) + part * s.beta
    return max(inside, across) + 2 * s.alpha


def all_gather_ring(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    return (p - 1) * (t.alpha + (_segs(n) - 1) * t.o + n * t.beta)


def all_gather_bruck(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    return _log2(p) * t.alpha + (p - 1) * n * t.beta + 2 * p * n * m.copy  # + the rotation in and out


def all_gather_direct(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    return t.alpha + (p - 2) * t.o + (p - 1) * n * t.beta


def all_gather_recursive_doubling(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t, q = m.tcp(hosts), _pow2_below(p)
    return _fold(t, m, p, n, out=p * n) + _log2(q) * t.alpha + (p - 1) * n * t.beta


def all_gather_shm(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    return m.shm.alpha + p * n * m.shm.beta  # my block in, the p-1 others out


def all_gather_hierarchical(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    local = max(1, math.ceil(p / hosts))  # a host's link carries the other hosts' blocks in, once
    crossing = m.tcp(hosts).msg((hosts - 1) * local * n) if hosts > 1 else 0.0
    return m.shm.alpha + all_gather_shm(m, p, n) + crossing  # the copies mostly overlap it: an upper bound


def reduce_scatter_ring(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t, block = m.tcp(hosts), n / p
    nseg = _segs(block) if block > RECV_NOW_NBYTES else 1
    return (p - 1) * (t.alpha + (nseg - 1) * t.o) + (p - 1) * block * (t.beta + m.gamma)


def reduce_scatter_shm(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    part = (p - 1) / p * n
    return m.shm.alpha + part * m.shm.beta + part * (m.gamma + m.shm.beta)


def reduce_scatter_hierarchical(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    local = max(1, math.ceil(p / hosts))  # a host's link carries one partial of each of its blocks per other host
    crossing = m.tcp(hosts).msg((hosts - 1) / hosts * n) + (hosts - 1) * n / p * m.gamma if hosts > 1 else 0.0
    return m.shm.alpha + reduce_scatter_shm(m, local, n) + crossing


def broadcast_tree(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    return _log2(p) * m.tcp(hosts).msg(n)  # the root sends ceil(log2 p) whole copies in turn


def broadcast_flat(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    return t.alpha + (p - 2) * t.o + (p - 1) * n * t.beta


def broadcast_chain(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    segs = segment_bounds(int(n))
    seg = (segs[0][1] - segs[0][0])
    return (p - 1) * t.msg(seg) + (len(segs) - 1) * (t.o + seg * t.beta)  # fill the line, then stream


def broadcast_shm(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    return m.shm.alpha + 2 * n * m.shm.beta  # in once, out on every other rank at once


def reduce_tree(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    return _log2(p) * (m.tcp(hosts).msg(n) + n * m.gamma)


def reduce_rabenseifner(m: Machine, p: int, n: float, hosts: int = 1, itemsize: int = 4) -> float:
    if n == 0 or (n // itemsize) % p:
        return reduce_tree(m, p, n, hosts)  # the file falls back to the tree
    return reduce_scatter_ring(m, p, n, hosts) + gather_direct(m, p, n / p, hosts)


def gather_direct(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    return t.alpha + (p - 2) * t.o + (p - 1) * n * t.beta


def gather_tree(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    forwarded = sum(min(1 << i, p) for i in range(_log2(p))) * n  # a subtree per round, each forwarded
    return _log2(p) * t.alpha + forwarded * t.beta + (p - 1) * n * m.copy


scatter_direct, scatter_tree = gather_direct, gather_tree  # mirror images


def all_to_all_direct(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    t = m.tcp(hosts)
    return (p - 1) * t.alpha + (p - 1) / p * n * t.beta


def barrier_dissemination(m: Machine, p: int, n: float = 0, hosts: int = 1) -> float:
    return _log2(p) * m.tcp(hosts).alpha


def barrier_shm(m: Machine, p: int, n: float = 0, hosts: int = 1) -> float:
    return m.shm.alpha


def scan_recursive_doubling(m: Machine, p: int, n: float, hosts: int = 1) -> float:
    return _log2(p) * (m.tcp(hosts).msg(n) + n * m.gamma)  # every round: the whole array out, in and reduced


FORMULAS = {
    "all_reduce": {"ring": all_reduce_ring, "halving_doubling": all_reduce_halving_doubling,
                   "recursive_doubling": all_reduce_recursive_doubling, "shm": all_reduce_shm,
                   "hierarchical": all_reduce_hierarchical},
    "all_gather": {"ring": all_gather_ring, "bruck": all_gather_bruck, "direct": all_gather_direct,
                   "recursive_doubling": all_gather_recursive_doubling, "shm": all_gather_shm,
                   "hierarchical": all_gather_hierarchical},
    "reduce_scatter": {"ring": reduce_scatter_ring, "shm": reduce_scatter_shm,
                       "hierarchical": reduce_scatter_hierarchical},
    "broadcast": {"tree": broadcast_tree, "flat": broadcast_flat, "chain": broadcast_chain, "shm": broadcast_shm},
    "reduce": {"tree": reduce_tree, "rabenseifner": reduce_rabenseifner},
    "gather": {"tree": gather_tree, "direct": gather_direct},
    "scatter": {"tree": scatter_tree, "direct": scatter_direct},
    "all_to_all": {"direct": all_to_all_direct},
    "barrier": {"dissemination": barrier_dissemination, "shm": barrier_shm},
    "all_gather_v": {"ring": all_gather_ring},
    "all_to_all_v": {"direct": all_to_all_direct},
    "gather_v": {"direct": gather_direct},
    "scatter_v": {"direct": scatter_direct},
    "scan": {"recursive_doubling": scan_recursive_doubling},
}


def predict(m: Machine, collective: str, algorithm: str, p: int, nbytes: float, hosts: int = 1) -> float:
    """Seconds the model gives ``algorithm`` of ``collective`` for ``nbytes`` on ``p`` ranks over
    ``hosts`` hosts; 0 on one rank. KeyError: no formula of that name."""
    if p <= 1:
        return 0.0
    return FORMULAS[collective][algorithm](m, p, nbytes, hosts)


def ranking(m: Machine, collective: str, p: int, nbytes: float, hosts: int = 1,
            allowed=None) -> list[tuple[float, str]]:
    """(seconds, algorithm) of every algorithm of ``collective`` (those in ``allowed`` when given),
    fastest first; ties by name."""
    names = FORMULAS[collective] if allowed is None else [a for a in FORMULAS[collective] if a in allowed]
    return sorted((predict(m, collective, a, p, nbytes, hosts), a) for a in names)
