"""Helpers shared by the benchmarks in bench/: sizes, statistics, an iteration's two
times over the ranks, the bus-bandwidth factors, a fixed-width table, JSON output, a
busbw plot and the memory-bandwidth reference. Plain functions; no ringweave imports,
so any benchmark (or a peer's process, such as an mpirun rank) can use them.

    from bench.common import parse_sizes, stats, busbw_factor
    parse_sizes("4:64M:4")          # [4, 16, 64, ..., 16777216, 67108864]
    parse_sizes("4,4096,1M")        # [4, 4096, 1048576]
    stats([3e-6, 1e-6, 2e-6])       # {'median_s': 2e-06, 'min_s': 1e-06, ...}
    busbw_factor("all_reduce", 4)   # 1.5 = 2(n-1)/n

Not here: anything that talks to a network or a library under test; that is
each benchmark's own business (bench/collectives.py, bench/p2p.py).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_UNITS = {"": 1, "B": 1, "K": KiB, "KB": KiB, "KIB": KiB, "M": MiB, "MB": MiB, "MIB": MiB,
          "G": GiB, "GB": GiB, "GIB": GiB}


# --- sizes -------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"4"`` -> 4, ``"64K"`` -> 65536, ``"1MiB"`` -> 1048576 (binary units, case-insensitive).

    Raises:
        ValueError: not a non-negative integer with an optional K/M/G unit; the message quotes it.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r} is not a byte count such as 4, 4096, 64K, 16M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(spec: str) -> list[int]:
    """A size list: ``"a,b,c"`` (each a :func:`parse_size`) or a geometric range ``"lo:hi[:factor]"``
    (factor default 2: every power of two from lo to hi, both included when they are on the grid).

    Raises:
        ValueError: a bad size, lo > hi, a factor below 2, or an empty result.
    """
    spec = spec.strip()
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"size range {spec!r} must be lo:hi or lo:hi:factor, e.g. 4:64M:4")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 else 2
        if factor < 2 or lo > hi or lo == 0:
            raise ValueError(f"size range {spec!r}: need 0 < lo <= hi and factor >= 2")
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= factor
    else:
        out = [parse_size(p) for p in spec.split(",") if p.strip()]
    if not out:
        raise ValueError(f"size list {spec!r} is empty")
    return out


def fmt_bytes(n: int) -> str:
    """4 -> '4 B', 65536 -> '64 KiB', 67108864 -> '64 MiB' (exact units only, else bytes)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# --- statistics and bandwidth ------------------------------------------------------------------

def stats(times_s) -> dict:
    """Median, min, quartiles and count of a list of durations in seconds."""
    t = sorted(float(x) for x in times_s)
    if not t:
        return {"n": 0, "median_s": float("nan"), "min_s": float("nan"), "p25_s": float("nan"),
                "p75_s": float("nan")}
    q = statistics.quantiles(t, n=4, method="inclusive") if len(t) > 1 else [t[0]] * 3
    return {"n": len(t), "median_s": statistics.median(t), "min_s": t[0], "p25_s": q[0], "p75_s": q[2]}


# --- per-iteration times over the ranks ---------------------------------------------------------
# Every rank stamps each timed call with t0 and t1 (time.perf_counter: CLOCK_MONOTONIC on Linux, one
# clock for every process of a host). The ranks max-reduce [t1 - t0 | t0 | t1] element-wise, and
# from that maximum come both figures of an iteration:
#   call = max over ranks of (t1 - t0): the slowest rank's own call, each rank's clock starting when
#          the barrier lets it out (a rank let out early is charged its wait for the others);
#   last = max t1 - max t0: from the last rank's entry to the last rank's exit, on one clock only.
# last <= call always: for the rank r with the largest t1, max t1 - max t0 <= t1[r] - t0[r].
TIMINGS = ("call", "last")
TIMED = {"call": "the slowest rank's own t1 - t0",
         "last": "max t1 - max t0 over the ranks, from the last rank's entry to the last rank's exit"}


def stamps(t0, t1) -> np.ndarray:
    """One rank's timed iterations (``t0``, ``t1``: arrays ``(..., iters)``) as the array the ranks
    max-reduce element-wise: ``[t1 - t0 | t0 | t1]`` along the last axis."""
    t0, t1 = np.asarray(t0, np.float64), np.asarray(t1, np.float64)
    return np.concatenate([t1 - t0, t0, t1], axis=-1)


def iteration_times(reduced, one_clock: bool) -> dict:
    """Per-iteration times from the element-wise maximum over the ranks of :func:`stamps`:
    ``{"call": max(t1 - t0), "last": max(t1) - max(t0)}``, ``last`` None unless ``one_clock``
    (the ranks' t0 and t1 read one clock)."""
    reduced = np.asarray(reduced, np.float64)
    k = reduced.shape[-1] // 3
    call, t0, t1 = reduced[..., :k], reduced[..., k:2 * k], reduced[..., 2 * k:]
    return {"call": call, "last": t1 - t0 if one_clock else None}


def shuffled(k: int, *key: int) -> list[int]:
    """A permutation of ``range(k)`` drawn from the integers ``key``: the same in every process, on
    any Python or NumPy (splitmix64 of each index and the key, sorted), so that ranks agree on an
    order without a message."""
    seed = 0
    for x in key:
        seed = _mix(seed ^ x)
    return sorted(range(k), key=lambda i: _mix(seed ^ i))


def _mix(x: int) -> int:  # splitmix64's finalizer
    x = (x + 0x9E3779B97F4A7C15) % 2 ** 64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2 ** 64
    return x ^ (x >> 31)


def clock_id() -> int | None:
    """This host's clock as a number all of one host's processes share (the first 48 bits of
    /proc/sys/kernel/random/boot_id; exact in a float64, so the ranks can compare it with a
    max-reduce); None where perf_counter is not CLOCK_MONOTONIC or the boot id cannot be read.
    Network namespaces (bench/netem.py's emulated hosts) share both."""
    if "CLOCK_MONOTONIC" not in time.get_clock_info("perf_counter").implementation:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return int(f.read().strip().replace("-", "")[:12], 16)
    except (OSError, ValueError):
        return None


# Bus-bandwidth factors exactly as nccl-tests (doc/PERFORMANCE.md) define them: busbw = algbw * factor,
# algbw = size / time, where size is the total buffer nccl-tests reports for the op (see
# bench/collectives.py, "sizes"). gather/scatter follow nccl-tests' gather/scatter tests.
_BUSBW = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' factor turning algbw into busbw for ``op`` on ``world`` ranks (0 for barrier)."""
    if op not in _BUSBW:
        raise ValueError(f"no bus-bandwidth factor for {op!r}; known: {sorted(_BUSBW)}")
    return _BUSBW[op](world) if world > 0 else 0.0


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes per second in GB/s (10**9, as nccl-tests); 0 for an empty or unmeasured row."""
    return nbytes / seconds / 1e9 if seconds and seconds > 0 and nbytes else 0.0


def copy_bandwidth(nbytes: int = 64 * MiB, reps: int = 7) -> dict:
    """Single-thread NumPy copy of ``nbytes`` (``np.copyto`` between two warm arrays), in GB/s of bytes
    copied per second (STREAM's "Copy" would count read + write, 2x this). Returns
    ``{"nbytes", "median_gbps", "best_gbps"}``. The reference for reading a shared-memory busbw."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault the pages in; not timed
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    s = stats(times)
    return {"nbytes": nbytes, "median_gbps": gbps(nbytes, s["median_s"]), "best_gbps": gbps(nbytes, s["min_s"])}


# --- output ------------------------------------------------------------------------------------

class Table:
    """A fixed-width text table printed one row at a time (rows appear as they are measured).

    ``columns`` is a list of ``(key, header, width, format)``; ``format`` is a format spec
    such as ``".2f"`` or a callable; a missing or None value prints as ``-``.
    """

    def __init__(self, columns, out=print):
        self.columns = columns
        self.out = out

    def header(self) -> None:
        self.out("#" + " ".join(f"{h:>{w}}" for _, h, w, _ in self.columns)[1:])

    def row(self, values: dict) -> str:
        cells = []
        for key, _, width, fmt in self.columns:
            v = values.get(key)
            if v is None or (isinstance(v, float) and v != v):
                s = "-"
            elif callable(fmt):
                s = fmt(v)
            else:
                s = format(v, fmt)
            cells.append(f"{s:>{width}}")
        line = " ".join(cells)
        self.out(line)
        return line


def out_path(out_dir: str | None, name: str) -> str:
    """Where a result file goes: under ``out_dir`` (``--out-dir``, the user's) or else the current
    directory, never the source tree; absolute, so the script can say where it went."""
    return os.path.abspath(os.path.join(out_dir or os.getcwd(), name))


def write_json(path: str, obj) -> None:
    """Writes ``obj`` as indented JSON, creating the folder; NaN becomes null.
    An empty ``path`` writes nothing."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def clean(x):
        if isinstance(x, float) and x != x:
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, np.generic):
            return x.item()
        return x

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(clean(obj), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def plot_busbw(path: str, series: dict, title: str, reference_gbps: float | None = None) -> str:
    """A PNG of busbw (GB/s) against size, one panel per op, one line per series.

    Args:
        series: ``{op: {label: [(nbytes, busbw_gbps), ...]}}``.
        reference_gbps: a horizontal line (the memory-copy reference), or None.

    Returns:
        A one-line message: where the plot went, or why it was skipped (matplotlib missing).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"plot skipped: matplotlib is not importable ({e}); pip install matplotlib"
    ops = [op for op in series if any(series[op].values())]
    if not ops:
        return "plot skipped: no rows with a bandwidth"
    cols = min(3, len(ops))
    rows = (len(ops) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for label, points in sorted(series[op].items()):
            pts = sorted((s, b) for s, b in points if s > 0 and b > 0)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
        if reference_gbps:
            ax.axhline(reference_gbps, color="grey", linestyle=":", linewidth=1, label="1-core copy")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", linewidth=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"
