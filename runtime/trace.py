"""A per-rank trace of collective calls, in the Chrome trace-event format.

Turned on with ``RINGWEAVE_TRACE=<dir>`` (or ``Runtime(trace_dir=...)``): every
collective call of every group becomes one complete event ("ph": "X") with its
start, duration, bytes sent, algorithm, group, sequence number and the peers it
waited on; at shutdown each rank writes ``<dir>/trace-rank<R>.json``.
``python -m tools.trace <dir>`` merges them into one file, one timeline
(process) per rank, that Perfetto (ui.perfetto.dev) and chrome://tracing open.

Timestamps are microseconds of the wall clock (``time.time_ns``), so ranks on
one machine line up exactly; across machines they are as good as the clocks'
synchronisation. The buffer is bounded (``max_events``); past it the oldest
events are dropped and the count of dropped events is written in the file.

Not here: anything about what a collective does (collectives/ fills ``args``).
"""

from __future__ import annotations

import collections
import json
import os
import time

MAX_EVENTS = 200_000


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
        """Writes ``trace-rank<R>.json`` (atomically) and returns its path."""
        if self.out_dir is None:
            return None
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"trace-rank{self.rank}.json")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)
        return path


def merge(paths: list[str]) -> dict:
    """Merges per-rank trace files into one trace (one process per rank)."""
    events, dropped = [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        events.extend(data["traceEvents"])
        other = data.get("otherData", {})
        dropped[str(other.get("rank", path))] = other.get("dropped_events", 0)
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"dropped_events": dropped}}
