"""The tuner's fitted model: ``t(n) = alpha + n beta`` per algorithm, from the times it measured.

collectives/costmodel.py predicts from a few probed terms; this module fits each measured
algorithm's own latency (``alpha``, seconds) and inverse bandwidth (``beta``, seconds per byte) on
the transport it ran over (shared memory or loopback TCP), by least squares on the *relative*
error (each point weighted ``1/t^2``, so a 4 B call fits ``alpha`` as well as 64 MiB fits
``beta``), both terms kept >= 0. The lines are what the rules file calls ``fits``; they

* place a boundary between two measured sizes whose winners differ: where the winners' lines
  cross, when that lies between the two sizes (else the geometric midpoint, as without a fit);
* extrapolate past the largest size measured: the lower envelope of the lines there;
* extrapolate to a group size not measured (:func:`rescale`): each line's ``alpha`` and ``beta``
  scaled by the ratio of costmodel's latency and bandwidth parts at the two sizes.

Pure functions of numbers: the same inputs give the same rules on every rank.
"""

from __future__ import annotations

import math

from collectives import costmodel

__all__ = ["fit", "crossing", "thresholds", "rescale", "winners_from_fits"]

BIG = 1 << 26  # the bytes at which costmodel's bandwidth part is read (64 MiB: the grid's top)


def fit(points) -> tuple[float, float]:
    """``(alpha, beta)`` >= 0 minimising ``sum(((alpha + n beta) - t) / t)^2`` over ``(n, t)``
    points with ``t > 0``; one point (or one size): ``(t, 0)`` at the smallest, as a flat line.

    Raises:
        ValueError: no point with a positive time.
    """
    pts = [(float(n), float(t)) for n, t in points if t > 0 and math.isfinite(t)]
    if not pts:
        raise ValueError("no positive time to fit")
    w = [1.0 / (t * t) for _, t in pts]
    s0 = sum(w)
    s1 = sum(wi * n for wi, (n, _) in zip(w, pts))
    s2 = sum(wi * n * n for wi, (n, _) in zip(w, pts))
    y0 = sum(wi * t for wi, (_, t) in zip(w, pts))
    y1 = sum(wi * n * t for wi, (n, t) in zip(w, pts))
    det = s0 * s2 - s1 * s1
    if det > 1e-12 * s0 * s2:
        alpha, beta = (y0 * s2 - s1 * y1) / det, (s0 * y1 - s1 * y0) / det
        if alpha >= 0 and beta >= 0:
            return alpha, beta
        if alpha < 0 and s2 > 0:  # through the origin
            b = y1 / s2
            if b >= 0:
                return 0.0, b
    return y0 / s0, 0.0  # flat: the weighted mean


def at(line, n: float) -> float:
    return line[0] + n * line[1]


def crossing(a, b) -> float | None:
    """The bytes where lines ``a`` and ``b`` (alpha, beta) meet, or None (parallel)."""
    if a[1] == b[1]:
        return None
    return (b[0] - a[0]) / (a[1] - b[1])


def _cut(lo: int, hi: int, win_lo: str | None, win_hi: str | None, fits: dict) -> int:
    """The last byte count of ``win_lo`` between measured sizes ``lo`` < ``hi``."""
    if win_lo in fits and win_hi in fits:
        x = crossing(fits[win_lo], fits[win_hi])
        if x is not None and lo < x < hi and at(fits[win_lo], lo) <= at(fits[win_hi], lo):
            return int(x)
    return int(math.sqrt(max(lo, 1) * hi))


def envelope(start: float, first: str, fits: dict) -> list[tuple[float, str]]:
    """From ``start`` bytes on, with ``first`` cheapest there: ``(from_bytes, algorithm)`` of the
    lower envelope of the ``fits`` lines (each change where a flatter line crosses below)."""
    out, cur, x0 = [], first, start
    while True:
        nxt = None
        for name, line in sorted(fits.items()):
            if name == cur or line[1] >= fits[cur][1]:
                continue
            x = crossing(fits[cur], line)
            if x is not None and x > x0 and (nxt is None or x < nxt[0]):
                nxt = (x, name)
        if nxt is None:
            return out
        x0, cur = nxt
        out.append(nxt)


def thresholds(winners: list[tuple[int, str | None]], fits: dict, extrapolate: bool,
               past: dict | None = None) -> list[list]:
    """``[upto, algorithm]`` entries from (size, winner) in rising size: a change between two
    sizes at the winners' crossing of ``fits`` (:func:`_cut`); past the last size the lower
    envelope of the lines of ``past`` (default ``fits``; e.g. those timed at the last size and
    allowed there) with ``extrapolate``, else None (the table)."""
    past = fits if past is None else past
    out: list[list] = []

    def add(upto, name):
        if out and out[-1][1] == name:
            out[-1][0] = upto
        else:
            out.append([upto, name])
    for (size, name), (nxt, nname) in zip(winners, winners[1:]):
        add(_cut(size, nxt, name, nname, fits) if nname != name else nxt, name)
    last, name = winners[-1]
    if not extrapolate:
        if name is None:
            add(None, None)
        else:
            add(last, name)
            out.append([None, None])
        return out
    floor = last
    for x, nxt in (envelope(last, name, past) if name in past else []):
        floor = max(int(x), floor + 1)  # rising whole bytes
        add(floor, name)
        name = nxt
    add(None, name)
    return out


def rescale(machine: costmodel.Machine, collective: str, algorithm: str, line, p_from: int, p_to: int):
    """Line ``(alpha, beta)`` measured on ``p_from`` ranks, carried to ``p_to``: each term times
    the ratio of costmodel's latency part (its time for 0 bytes) and bandwidth part (its slope to
    :data:`BIG`) at the two sizes; a part the model gives as 0 keeps the measured term."""
    def parts(p):
        lat = costmodel.predict(machine, collective, algorithm, p, 0)
        return lat, (costmodel.predict(machine, collective, algorithm, p, BIG) - lat) / BIG
    (l0, b0), (l1, b1) = parts(p_from), parts(p_to)
    return (line[0] * (l1 / l0 if l0 > 0 else 1.0), line[1] * (b1 / b0 if b0 > 0 else 1.0))


def winners_from_fits(fits: dict, sizes, allowed) -> list[tuple[int, str | None]]:
    """(size, the cheapest line of ``allowed`` there) for each of ``sizes``; ties by name."""
    mine = {a: line for a, line in fits.items() if a in allowed}
    return [(n, min(mine, key=lambda a: (at(mine[a], n), a)) if mine else None) for n in sizes]
