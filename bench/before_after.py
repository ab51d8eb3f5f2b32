"""Two sets of bench/collectives.py runs, before and after a change, as one markdown table.

    python bench/before_after.py --before b1.json b2.json ... --after a1.json a2.json ...

Rows of the default algorithm, matched by (op, bytes). Per row and peer: the median over the runs
of the peer's ratio (peer time / ringweave time, > 1: ringweave faster), before and after, and
after / before (< 0.90: the change made that ratio more than 10% worse). Also the median times
and, where the runs have them, the largest ticker gap (tick) and its idle floor. Medians, not
means: the machine is shared and single runs swing by 2x.
"""

from __future__ import annotations

import argparse
import json
import statistics


def load(paths: list[str]) -> tuple[dict, list[str], dict]:
    rows: dict[tuple, list[dict]] = {}
    peers: list[str] = []
    meta = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        for r in data["rows"]:
            if not r.get("default", True):
                continue
            rows.setdefault((r["op"], r["bytes"]), []).append(r)
            peers += [k for k, v in r.items() if isinstance(v, dict) and "ratio" in v and k not in peers]
    return rows, peers, meta


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", nargs="+", required=True)
    p.add_argument("--after", nargs="+", required=True)
    a = p.parse_args(argv)
    before, peers_b, _ = load(a.before)
    after, peers_a, meta = load(a.after)
    peers = [q for q in peers_a if q in peers_b]
    head = ["op", "size", "before (us)", "after (us)"]
    for q in peers:
        head += [f"x{q} before", f"x{q} after", "after/before"]
    head += ["tick (ms)", "idle (ms)"]
    print(f"<!-- {meta.get('command', '')} ; runs: {len(a.before)} before, {len(a.after)} after -->")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    worse = []
    for key in sorted(after, key=lambda k: (list(after).index(k))):
        if key not in before:
            continue
        rb, ra = before[key], after[key]
        cells = [key[0], size(key[1]), fmt(med(r["time_us"] for r in rb), ".1f"), fmt(med(r["time_us"] for r in ra), ".1f")]
        for q in peers:
            xb = med(r.get(q, {}).get("ratio") for r in rb)
            xa = med(r.get(q, {}).get("ratio") for r in ra)
            change = xa / xb if xa and xb else None
            if change is not None and change < 0.9:
                worse.append(f"{key[0]} {size(key[1])} x{q} {change:.2f}")
            cells += [fmt(xb, ".2f"), fmt(xa, ".2f"), fmt(change, ".2f") + (" **" if change and change < 0.9 else "")]
        cells += [fmt(med(r.get("tick_gap_ms") for r in ra), ".1f"), fmt(med(r.get("idle_gap_ms") for r in ra), ".1f")]
        print("| " + " | ".join(cells) + " |")
    print()
    print("ratios more than 10% worse after (**): " + (", ".join(worse) if worse else "none"))


if __name__ == "__main__":
    main()
