"""Merge the per-rank collective traces of a job into one Chrome trace file.

    RINGWEAVE_TRACE=/tmp/tr python -m runtime.launch -n 4 -m trainer
    python -m tools.trace /tmp/tr -o job.trace.json      # open it in ui.perfetto.dev

One timeline (process) per rank, one track per process group, one span per
collective call with its bytes, algorithm and outcome in the span's args.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from runtime.trace import merge


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir", help="the RINGWEAVE_TRACE directory of the job")
    p.add_argument("-o", "--output", default=None, help="merged file (default <trace_dir>/job.trace.json)")
    args = p.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.trace_dir, "trace-rank*.json")))
    if not paths:
        print(f"no trace-rank*.json files in {args.trace_dir}", file=sys.stderr)
        return 1
    out = args.output or os.path.join(args.trace_dir, "job.trace.json")
    merged = merge(paths)
    with open(out, "w") as f:
        json.dump(merged, f)
    spans = sum(1 for e in merged["traceEvents"] if e["ph"] == "X")
    print(f"merged {len(paths)} ranks, {spans} spans -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
