"""A per-rank trace of collective calls, in the Chrome trace-event format.

Turned on with ``RINGWEAVE_TRACE=<dir>`` (or ``RankRuntime(trace_dir=...)``): every
collective call of every group becomes one complete event ("ph": "X") with its
start, duration, bytes sent, algorithm, group, sequence number and the peers it
waited on; at shutdown each rank writes ``<dir>/trace-rank<R>.json``.
``python -m tools.trace <dir>`` merges them into one file, one timeline
(process) per rank, that Perfetto (ui.perfetto.dev) and chrome://tracing open.

Timestamps are microseconds of the wall clock (``time.time_ns``), so ranks on
one machine line up exactly; across machines they are as good as the clocks'
synchronisation. The buffer is bounded (``max_events``); past it the oldest
events are dropped and the count of dropped events is written in the file.

The directory is the user's alone (runtime/owndir.py): made with mode 0700
when missing, refused when another user owns it or group or others may write
in it (checked when the runtime starts, :func:`check_dir`, and again through
the descriptor each file is written under), and each file is made 0600 under
a fresh name and renamed into place, so a link another user planted is never
followed. The files are read back as untrusted input (:func:`read_traces`).

Not here: anything about what a collective does (collectives/ fills ``args``).
"""

from __future__ import annotations

import collections
import json
import os
import re
import time

from runtime import owndir

MAX_EVENTS = 200_000
WHAT = "the trace directory (RINGWEAVE_TRACE)"
_RANK_FILE = re.compile(r"^trace-rank\d+\.json$")


def check_dir(path: str | None) -> None:
    """Makes the trace directory ``path`` (0700) if it is missing, and checks that it is ours
    alone to write in; None: no tracing, nothing to check.

    Raises:
        PrivateDirError: another user's directory, one others may write in, or a link.
    """
    if path is not None:
        os.close(owndir.open_dir(path, create=True, what=WHAT))


class Tracer:
    def __init__(self, rank: int, out_dir: str | None, max_events: int = MAX_EVENTS):
        self.rank = rank
        self.out_dir = out_dir
        self.events: collections.deque = collections.deque(maxlen=max_events)
        self.recorded = 0

    @property
    def enabled(self) -> bool:
        return self.out_dir is not None

    @staticmethod
    def now_us() -> float:
        return time.time_ns() / 1000.0

    def complete(self, name: str, start_us: float, end_us: float, tid: int, args: dict) -> None:
        """Records one finished span (a collective call) on thread ``tid`` (the group id)."""
        self.recorded += 1
        self.events.append({"name": name, "ph": "X", "ts": start_us, "dur": max(0.0, end_us - start_us),
                            "pid": self.rank, "tid": tid, "args": args})

    def to_json(self) -> dict:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                 "args": {"sort_index": self.rank}}]
        return {"traceEvents": meta + list(self.events), "displayTimeUnit": "ms",
                "otherData": {"rank": self.rank, "dropped_events": self.recorded - len(self.events)}}

    def write(self) -> str | None:
        """Writes ``trace-rank<R>.json`` (mode 0600, atomically: see the module docstring) and
        returns its path.

        Raises:
            PrivateDirError: the directory is not ours alone (nothing is written).
            OSError: it could not be written.
        """
        if self.out_dir is None:
            return None
        name = f"trace-rank{self.rank}.json"
        dfd = owndir.open_dir(self.out_dir, create=True, what=WHAT)
        try:
            with owndir.replacing(dfd, name) as f:
                json.dump(self.to_json(), f)
        finally:
            os.close(dfd)
        return os.path.join(self.out_dir, name)


def read_traces(path: str) -> list[dict]:
    """The per-rank files (``trace-rank<R>.json``) of trace directory ``path``, parsed, in name
    order. Only regular files are read, never through a link.

    Raises:
        ValueError: a file is not a rank's trace (the message names it).
        PrivateDirError, OSError: the directory or a file cannot be read safely.
    """
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        traces = []
        for name in sorted(n for n in os.listdir(dfd) if _RANK_FILE.match(n)):
            try:
                doc = json.loads(owndir.read_file(dfd, name, path))
            except ValueError as exc:  # not JSON, not UTF-8
                raise ValueError(f"{os.path.join(path, name)} is not JSON ({exc})") from None
            if not _is_trace(doc):
                raise ValueError(f"{os.path.join(path, name)} is not a rank's trace: a JSON object whose "
                                 f"traceEvents is a list of objects")
            traces.append(doc)
        return traces
    finally:
        os.close(dfd)


def _is_trace(doc) -> bool:
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    return (isinstance(events, list) and all(isinstance(e, dict) for e in events)
            and isinstance(doc.get("otherData", {}), dict))


def merge(traces: list[dict]) -> dict:
    """Merges per-rank traces (:func:`read_traces`) into one trace (one process per rank)."""
    events, dropped = [], {}
    for i, data in enumerate(traces):
        events.extend(data["traceEvents"])
        other = data.get("otherData", {})
        dropped[str(other.get("rank", i))] = other.get("dropped_events", 0)
    events.sort(key=lambda e: (e.get("ph") != "M", _number(e.get("ts", 0))))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"dropped_events": dropped}}


def _number(value) -> float:
    """A timestamp to sort by: a file's non-number sorts first rather than failing the sort."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("-inf")
