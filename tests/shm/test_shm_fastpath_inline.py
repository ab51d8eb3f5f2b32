"""collectives/slots/inline.py: the small shared-memory all_reduce and barrier run inline, from the
public call straight to the compiled protocol.

* every dtype and op the inline path takes, against NumPy folding the ranks' inputs in rank order,
  bit for bit, with the path counted as taken;
* deterministic proof that it is taken: a rank whose peer has already posted completes its call
  without suspending, without a Call record and within a small number of Python function calls
  (the path through calls.py and group.run makes a Call and several times the calls);
* the guarantees kept: a mismatch is the typed error; a peer SIGKILLed or SIGSTOPped while a rank
  waits in an inline call gives PeerLostError / CollectiveTimeoutError within the deadline; the
  blocking Communicator's calls, on the calling thread, equal the closed forms with a peer late.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import collectives as C
from collectives.slots import fastpath
from runtime import group as group_module
from runtime.errors import CollectiveMismatchError
from runtime.sharedmem import domains, segments, waits
from tests.shm.test_shm_fastpath import inputs, reference
from tests.shm.test_shm_processes import _finish, _free_port, _read_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("fastpath_inline_rank.py"))
OPS = ("sum", "avg", "prod", "min", "max")

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not (fastpath.SUPPORTED and segments.shm_usable()),
                                 reason="no compiled shm path here")]


def inline_calls(g) -> int:
    return domains.statistics(g)["0d0"]["inline"]


async def test_every_dtype_and_op_equals_the_numpy_fold(ranks):
    n = 2
    cases = [(np.dtype(t), op, count) for t in sorted(fastpath.NATIVE, key=str) for op in OPS
             for count in (1, 333, domains.SMALL_NBYTES // np.dtype(t).itemsize)]
    counted = []

    async def body(g):
        await C.barrier(group=g)  # the domain is set up (the normal path)
        got = []
        for i, (dtype, op, count) in enumerate(cases):
            x = inputs(n, count, dtype, op, i)[g.rank].reshape(1, count).copy()  # any shape
            await C.all_reduce(x, op=op, group=g)
            got.append(x.reshape(-1))
        counted.append(inline_calls(g))
        return got

    results = await ranks(n, body)
    assert sum(counted) >= len(cases), counted  # each call completed inline on a rank at least
    for i, (dtype, op, count) in enumerate(cases):
        want = reference(inputs(n, count, dtype, op, i), op)
        for r in range(n):
            got = results[r][i]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (dtype, op, count, r)


async def _posted(g, calls_ahead: int = 1) -> None:
    """Waits (bounded) until every peer has posted phase 1 of this rank's next call."""
    dom = domains.existing(g)
    deadline = time.monotonic() + 10
    while not dom.reached_all(g._seq + calls_ahead, 1):
        assert time.monotonic() < deadline, "the peer never posted"
        await asyncio.sleep(0.001)


def _run_once(coro, calls: list) -> bool:
    """Steps ``coro`` once, counting Python function calls; True if it completed in that step."""
    def count(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        coro.send(None)
    except StopIteration:
        return True
    finally:
        sys.setprofile(None)
    coro.close()
    return False


@pytest.mark.parametrize("what", ["all_reduce", "barrier"])
async def test_the_last_to_arrive_completes_without_suspending_or_a_call_record(ranks, monkeypatch, what):
    made = []
    init = group_module.Call.__init__

    def counted_init(self, *args, **kw):
        made.append(args[1] if len(args) > 1 else None)
        init(self, *args, **kw)

    async def body(g):
        g.runtime.call_turn_s = math.inf  # no loop turn between calls: the step below is the whole call
        x = np.ones(4, np.float32)
        await C.all_reduce(x, group=g)  # the domain is set up
        for _ in range(4):  # the plan made, the fingerprint's text in both slots
            await (C.all_reduce(x, group=g) if what == "all_reduce" else C.barrier(group=g))
        x[:] = 1
        if g.rank == 1:
            await (C.all_reduce(x, group=g, timeout=10) if what == "all_reduce" else C.barrier(group=g, timeout=10))
            return None
        await _posted(g)
        monkeypatch.setattr(group_module.Call, "__init__", counted_init)
        calls: list = []
        before = inline_calls(g)
        coro = C.all_reduce(x, group=g) if what == "all_reduce" else C.barrier(group=g)
        completed = _run_once(coro, calls)
        monkeypatch.setattr(group_module.Call, "__init__", init)
        return completed, calls, inline_calls(g) - before, x.copy()

    out = await ranks(2, body)
    completed, calls, inline_now, x = out[0]
    assert completed, "the call suspended although its peer had posted"
    assert made == [], f"a Call record was made: {made}"
    assert inline_now == 1
    assert len(calls) <= 20, f"{len(calls)} Python calls: {calls}"
    if what == "all_reduce":
        assert np.all(x == 2)


async def test_two_kinds_alternating_get_their_text_from_the_compiled_entry(ranks, monkeypatch):
    """barrier; all_reduce; barrier, round after round: most calls find the other kind's text in their slot. The
    compiled entry writes it (no write from Python), the slot then holds the call's text, and the
    results are exact."""
    writes = []

    async def body(g):
        x = np.ones(4, np.float32)
        for _ in range(3):
            await C.barrier(group=g)
            await C.all_reduce(x, group=g)
        dom = domains.existing(g)
        real = type(dom).write_fingerprint_text
        monkeypatch.setattr(type(dom), "write_fingerprint_text",
                            lambda self, *a: writes.append(a) or real(self, *a))
        before = inline_calls(g)
        for i in range(20):
            await C.barrier(group=g)
            x[:] = g.rank + i
            await C.all_reduce(x, group=g)
            assert np.all(x == 2 * i + 1), (i, x)
            await C.barrier(group=g)  # three calls a round: a slot's kind changes from round to round
            for parity in (0, 1):  # each slot holds the text of the last call that used it
                off = waits.OFF_FP + parity * waits.FP_NBYTES + 8
                fp = dom._fp_text[parity].encode()[:waits.FP_MAX]
                text = len(fp).to_bytes(4, "little") + fp
                assert bytes(dom.ctl[dom.rank].mm[off:off + len(text)]) == text, parity
        return inline_calls(g) - before

    out = await ranks(2, body)
    assert writes == [], writes
    assert sum(out) >= 60, out  # every call completed inline on the rank that arrived last


async def test_a_mismatch_on_the_inline_path_is_the_typed_error(ranks):
    async def body(g):
        for _ in range(3):
            await C.all_reduce(np.ones(4, np.float32), group=g)  # inline from the second call on
        if g.rank == 1:
            await _posted(g)  # rank 0 is in its all_reduce: the barrier meets it inline
            await C.barrier(group=g, timeout=20)
        else:
            await C.all_reduce(np.ones(4, np.float32), group=g, timeout=20)

    out = await ranks(2, body, return_exceptions=True)
    assert all(isinstance(e, CollectiveMismatchError) for e in out), out
    assert "barrier" in str(out[0]) and "all_reduce" in str(out[0]), out[0]


async def test_a_setting_changed_between_calls_takes_effect_at_the_next(ranks, monkeypatch):
    async def body(g):
        x = np.ones(4, np.float32)
        for _ in range(3):
            await C.all_reduce(x, group=g)
        taken = inline_calls(g)
        monkeypatch.setenv("RINGWEAVE_ALGO_ALL_REDUCE", "ring")
        for _ in range(3):
            x[:] = 1
            await C.all_reduce(x, group=g)
            assert np.all(x == 2)
        return taken, inline_calls(g)

    monkeypatch.delenv("RINGWEAVE_ALGO_ALL_REDUCE", raising=False)
    out = await ranks(2, body)
    assert sum(t for t, _ in out) > 0
    assert all(before == after for before, after in out), out  # the table's ring ran them


# -- between processes ---------------------------------------------------------------------------

def _words(proc: subprocess.Popen, word: str, timeout_s: float = 60) -> list[str]:
    return _read_until(proc, word, timeout_s).split()


def _start(mode: str) -> list[subprocess.Popen]:
    port, procs = _free_port(), []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
                   RINGWEAVE_SHM_COMPILED="1", RINGWEAVE_JOB=f"inline-{mode}-{os.getpid()}-{port}",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("RINGWEAVE_SHM", None)
        env.pop("RINGWEAVE_STORE_HOSTED", None)
        procs.append(subprocess.Popen([sys.executable, SCRIPT, mode], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.parametrize("fault, error, within_s", [("kill", "PeerLostError", (0.0, 3.0)),
                                                    ("stop", "CollectiveTimeoutError", (0.9, 3.0))])
def test_a_peer_killed_or_stopped_during_an_inline_call_gives_the_typed_error_in_time(fault, error, within_s):
    procs = _start(fault)
    try:
        _words(procs[1], "READY")
        if fault == "stop":
            procs[1].send_signal(signal.SIGSTOP)
        words = _words(procs[0], "ENTER")
        assert int(words[2]) > 0, "the inline path never served rank 0"
        _words(procs[0], "REST")  # rank 0 entered inline, and its peer is not coming
        if fault == "kill":
            time.sleep(0.3)
            procs[1].send_signal(signal.SIGKILL)
            t = time.monotonic()
        words = _words(procs[0], "CAUGHT", 30)
        assert words[2] == error, words
        seconds = float(words[3]) if fault == "stop" else time.monotonic() - t
        assert within_s[0] <= seconds <= within_s[1], f"{error} after {seconds:.2f} s"
        procs[0].wait(30)
    finally:
        if fault == "stop" and procs[1].poll() is None:
            procs[1].send_signal(signal.SIGCONT)
        _finish(procs)


def test_the_communicators_calls_run_inline_on_the_calling_thread():
    procs = _start("blocking")
    try:
        oks = [_words(p, "OK", 120) for p in procs]
        for p in procs:
            assert p.wait(30) == 0
    finally:
        _finish(procs)
    inline_total, calls = sum(int(w[2]) for w in oks), int(oks[0][3])
    assert inline_total >= calls // 2, oks  # most calls completed inline on one rank at least
