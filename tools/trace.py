"""Merge the per-rank collective traces of a job into one Chrome trace file.

    RINGWEAVE_TRACE=/tmp/tr python -m runtime.launch -n 4 -m trainer
    python -m tools.trace /tmp/tr -o job.trace.json      # open it in ui.perfetto.dev

One timeline (process) per rank, one track per process group, one span per
collective call with its bytes, algorithm and outcome in the span's args.

The merged file is written as the ranks write theirs (runtime/owndir.py): into a
directory that is this user's and that group and others may not write in (else a
one-line error says why), mode 0600, under a fresh name renamed into place, so a
link another user planted under the output's name is replaced, never followed.
The per-rank files are read as untrusted input: regular files only, never
through a link, and a file that is not a trace is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from runtime import owndir
from runtime.errors import RingweaveError
from runtime.trace import merge, read_traces


def write(path: str, doc: dict) -> None:
    """Writes ``doc`` as JSON to ``path``, mode 0600, in a directory checked to be ours alone.

    Raises:
        PrivateDirError: the directory is another user's, or others may write in it.
        OSError: it is missing, or the file could not be written.
    """
    where = os.path.dirname(path) or "."
    dfd = owndir.open_dir(where, create=False, what="the output's directory")
    try:
        with owndir.replacing(dfd, os.path.basename(path)) as f:
            json.dump(doc, f)
    finally:
        os.close(dfd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.trace", description=__doc__.splitlines()[0])
    p.add_argument("trace_dir", help="the RINGWEAVE_TRACE directory of the job")
    p.add_argument("-o", "--output", default=None, help="merged file (default <trace_dir>/job.trace.json)")
    args = p.parse_args(argv)
    out = args.output or os.path.join(args.trace_dir, "job.trace.json")
    if os.path.basename(out) in ("", ".", ".."):
        p.error(f"--output {out!r} names a directory, not a file")
    try:
        traces = read_traces(args.trace_dir)
        if not traces:
            print(f"tools.trace: no trace-rank*.json files in {args.trace_dir}", file=sys.stderr)
            return 1
        merged = merge(traces)
        write(out, merged)
    except (OSError, ValueError, RingweaveError) as exc:  # PrivateDirError: not safely ours to write in
        print(f"tools.trace: {exc}", file=sys.stderr)
        return 1
    spans = sum(1 for e in merged["traceEvents"] if e.get("ph") == "X")
    print(f"merged {len(traces)} ranks, {spans} spans -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
