"""Threads that share a group never get a wrong answer (collectives/blocking.py, "Threads").

The calls of a group are matched across ranks in the order each rank makes them; two threads
sharing a group may interleave differently on each rank, which paired one thread's array with
the other thread's: 166 of 400 sums were wrong at 2 ranks, silently. Now each call carries the
name of the thread that made it, so such a pairing fails on every rank with a
CollectiveMismatchError naming both threads, and the rule (one thread per group, or an order
every rank keeps) is in the README.

Ranks here are Communicators in threads of this process; their threads are named alike across
ranks, as those of a real job's processes are.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from collectives import Communicator
from runtime.errors import CollectiveMismatchError

N = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_threads(jobs: dict[str, object]) -> dict[str, object]:
    """Runs each job (name -> fn) in a thread of that name; returns name -> result or exception."""
    out: dict[str, object] = {}

    def wrap(name, fn):
        try:
            out[name] = fn()
        except BaseException as exc:  # returned, checked by the caller
            out[name] = exc

    names = list(jobs)  # "thread-name@rank": a thread of that name runs the job
    threads = [threading.Thread(target=wrap, args=(key, fn), name=key.split("@")[0]) for key, fn in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return {k: out.get(k) for k in names}


@pytest.fixture
def comms():
    port = _free_port()
    made = _in_threads({f"make@{r}": (lambda r=r: Communicator(rank=r, world_size=N, master_addr="127.0.0.1",
                                                             master_port=port, timeout=20)) for r in range(N)})
    comms = [made[f"make@{r}"] for r in range(N)]
    assert all(isinstance(c, Communicator) for c in comms), comms
    yield comms
    _in_threads({f"close@{r}": comms[r].close for r in range(N)})


@pytest.mark.timeout(90)
def test_two_threads_sharing_a_group_never_get_a_wrong_sum(comms):
    calls = 50

    def worker(comm, k):
        wrong, ok = 0, 0
        for i in range(calls):
            v = (k + 1) * 1000 + i  # a value per thread and call: a mixed pair sums to something else
            x = np.full(8, v * (comm.rank + 1), np.float64)
            try:
                comm.all_reduce(x)
            except CollectiveMismatchError as exc:
                return ok, wrong, exc
            if (x == v * N * (N + 1) / 2).all():
                ok += 1
            else:
                wrong += 1
        return ok, wrong, None

    results = _in_threads({f"worker-{k}@{r}": (lambda r=r, k=k: worker(comms[r], k)) for r in range(N) for k in (0, 1)})
    for key, res in results.items():
        assert isinstance(res, tuple), (key, res)
        ok, wrong, exc = res
        assert wrong == 0, f"{key}: {wrong} wrong sums ({ok} right)"
        assert exc is None or "thread=worker-" in str(exc), (key, exc)
    mismatched = [res[2] for res in results.values() if res[2] is not None]
    if mismatched:  # once a pairing went wrong, every rank's group failed: both sides stopped
        assert {str(e) for e in mismatched} and len(mismatched) >= N, results


@pytest.mark.timeout(60)
def test_calls_from_differently_named_threads_fail_on_every_rank(comms):
    """Rank 0 calls from thread "loader", rank 1 from thread "trainer": a CollectiveMismatchError
    on both, naming both threads (it was a silent pairing)."""
    x = [np.ones(4, np.float32) for _ in range(N)]
    results = _in_threads({"loader@0": lambda: comms[0].all_reduce(x[0]),
                           "trainer@1": lambda: comms[1].all_reduce(x[1])})
    for key, res in results.items():
        assert isinstance(res, CollectiveMismatchError), (key, res)
        assert "thread=loader" in str(res) and "thread=trainer" in str(res), res


@pytest.mark.timeout(60)
def test_one_group_per_thread_runs_concurrently(comms):
    groups = _in_threads({f"main@{r}": (lambda r=r: [comms[r].new_group(range(N)) for _ in range(2)])
                          for r in range(N)})

    def worker(r, k):
        for i in range(30):
            x = np.full(3, i + k, np.int64)
            comms[r].all_reduce(x, group=groups[f"main@{r}"][k])
            assert (x == N * (i + k)).all(), x
        return "ok"

    results = _in_threads({f"worker-{k}@{r}": (lambda r=r, k=k: worker(r, k)) for r in range(N) for k in (0, 1)})
    assert set(results.values()) == {"ok"}, results
