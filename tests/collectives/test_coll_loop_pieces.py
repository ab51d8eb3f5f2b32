"""Large collectives hand the event loop back between bounded pieces of work (docs/design.md,
"The loop's turns"): no callback of the loop (a task's step, a socket's read) copies,
reduces, reads or writes more than one piece, ``runtime.turns.PIECE_NBYTES`` of memory traffic.

The loop is instrumented, not timed. asyncio's ``Handle._run`` (every callback of the selector
loop) opens an account, and what moves bulk bytes charges it what it reads and writes: NumPy's
copy, the shared-memory streaming copy and fused reduction, the Comm's reduction kernel, avg's
division, the socket's writes (``os.writev``, ``socket.send``) and the protocol's payload reads.
The turn budget is 0 (a turn after every piece) and the piece small, so that arrays of 2-4 MiB
make many pieces; all_reduce (avg), all_gather, reduce_scatter and broadcast run over TCP (the
table's algorithm) and over shared memory, on 2 and 4 ranks as tasks of one loop
(runtime.testing), their answers checked against closed forms. Under uvloop, which reads a socket
again and again within one wake-up, the bytes read between two turns of a ticker task are counted;
a frame kept before its receive was posted reaches the receive in pieces, the loop turning between.
Every TCP algorithm of the collectives, in step and with the receiving rank late (its peers' frames
kept), likewise, a kept frame's zero-filled buffer and sends done at once charged too.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import numpy as np
import pytest

import collectives as C
from collectives import comm, ops
from collectives.slots import common, memops
from runtime import frame_protocol, turns
from runtime.sharedmem import domains, segments
from runtime.testing import run_ranks
from tests.loopturns import counted

pytestmark = pytest.mark.timeout(120)

PIECE = 64 << 10  # the piece in these tests: 2-4 MiB arrays make dozens
SLACK = 4096  # a frame's header goes out with the first piece of its payload
BLOCK = (1 << 18) + 3  # float32 elements: just over 1 MiB, past every algorithm's one-message path
SHM_ON = segments.shm_usable()
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


class Ledger:
    """Bytes of memory traffic charged to the loop callback now running, and the most any one took."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.current = 0
        self.worst = 0
        self.what = ""
        self.charges = 0

    def charge(self, nbytes: int, what: str) -> None:
        if threading.get_ident() != self.thread:  # a worker thread's work does not hold the loop
            return
        self.charges += 1
        self.current += nbytes
        if self.current > self.worst:
            self.worst, self.what = self.current, what

    def turn(self) -> None:
        self.current = 0


def instrument(monkeypatch, ledger: Ledger) -> None:
    """Every primitive that moves bulk bytes on the loop's thread charges ``ledger``."""
    def wrap(owner, name, cost):
        original = getattr(owner, name)

        def charged(*args, **kw):
            result = original(*args, **kw)
            ledger.charge(cost(result, *args), f"{getattr(owner, '__name__', owner)}.{name}")
            return result
        monkeypatch.setattr(owner, name, charged)

    wrap(np, "copyto", lambda _, dst, src, *a: 2 * dst.nbytes)
    wrap(memops, "stream_copy", lambda _, dst, src: 2 * dst.nbytes)
    wrap(memops, "reduce_publish", lambda _, dst, srcs, pub, op: (len(srcs) + 3) * dst.nbytes)
    wrap(comm, "reduce_now", lambda _, dst, src, op: 3 * dst.nbytes)
    wrap(ops, "divide_into", lambda _, x, size: 2 * x.nbytes)
    wrap(os, "writev", lambda sent, fd, parts: 2 * sent)
    wrap(socket.socket, "send", lambda sent, sock, data, *a: 2 * sent)
    original_updated = frame_protocol.FrameProtocol.buffer_updated

    def buffer_updated(self, nbytes):  # a payload read straight into its buffer (the stage's: header mode)
        if self._header is not None:
            ledger.charge(2 * nbytes, "socket read")
        original_updated(self, nbytes)
    monkeypatch.setattr(frame_protocol.FrameProtocol, "buffer_updated", buffer_updated)
    monkeypatch.setattr(turns, "PIECE_NBYTES", PIECE)
    monkeypatch.setattr(turns, "TURN_S", 0.0)  # a turn after every piece: the bound does not depend on speed
    monkeypatch.setattr(common, "OFFLOAD_MIN_NBYTES", 1 << 62)  # in-process peers too: every piece inline


def per_callback(monkeypatch, ledger: Ledger) -> None:
    """An account per callback of asyncio's loop (``Handle._run``): each starts at zero."""
    original_run = asyncio.events.Handle._run

    def run(handle):
        ledger.turn()
        try:
            return original_run(handle)
        finally:
            ledger.turn()
    monkeypatch.setattr(asyncio.events.Handle, "_run", run)


def inputs(op: str, n: int, r: int) -> tuple:
    """(the call's arguments, its keywords, the array that holds the answer, the answer) for rank r of n."""
    if op == "all_reduce":  # avg of r + 1 + i % 7: exact in float32 for 2 and 4 ranks
        count = 2 * BLOCK
        x = (r + 1 + np.arange(count) % 7).astype(np.float32)
        want = ((n * (n + 1) // 2 + n * (np.arange(count) % 7)) / n).astype(np.float32)
        return (x,), {"op": "avg"}, x, want
    if op == "all_gather":
        x = (r * 1000 + np.arange(BLOCK) % 251).astype(np.float32)
        out = np.zeros(n * BLOCK, np.float32)
        want = np.concatenate([(p * 1000 + np.arange(BLOCK) % 251).astype(np.float32) for p in range(n)])
        return (out, x), {}, out, want
    if op == "reduce_scatter":
        i = np.arange(n * BLOCK)
        x = (r + 1 + i % 7).astype(np.float32)
        out = np.zeros(BLOCK, np.float32)
        want = (n * (n + 1) // 2 + n * (i % 7)).astype(np.float32)[r * BLOCK:(r + 1) * BLOCK]
        return (out, x), {"op": "sum"}, out, want
    count = 2 * BLOCK  # broadcast from rank 1
    want = (np.arange(count) % 251).astype(np.float32)
    x = want.copy() if r == 1 else np.zeros(count, np.float32)
    return (x,), {"src": 1}, x, want


async def run_op(op: str, n: int, shm: bool) -> list:
    """One call of ``op`` on n ranks (inputs made before the loop runs them); the ranks' results."""
    made = [inputs(op, n, r) for r in range(n)]

    async def body(g):
        args, kw, got, want = made[g.rank]
        g.shm_enabled = shm
        await getattr(C, op)(*args, group=g, algorithm="shm" if shm else None, **kw)
        return got, want, domains.statistics(g)
    return await run_ranks(n, body, transport="tcp")


@pytest.mark.parametrize("shm", [False, pytest.param(True, marks=pytest.mark.skipif(
    not SHM_ON, reason="no shared memory here (RINGWEAVE_SHM=0)"))], ids=["tcp", "shm"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("op", OPS)
async def test_no_loop_callback_moves_more_than_a_piece(monkeypatch, op, n, shm):
    ledger = Ledger()
    instrument(monkeypatch, ledger)
    per_callback(monkeypatch, ledger)
    results = await run_op(op, n, shm)
    monkeypatch.undo()
    for r, (got, want, stats) in enumerate(results):
        np.testing.assert_array_equal(got, want, err_msg=f"{op} rank {r} of {n}")
        ran_shm = any(d["posts"] for d in stats.values())
        assert ran_shm == shm, f"{op} ran {'over shared memory' if ran_shm else 'over TCP'}"
    assert ledger.worst <= PIECE + SLACK, (
        f"{op} on {n} ranks ({'shm' if shm else 'tcp'}): one loop callback moved {ledger.worst} bytes "
        f"(last through {ledger.what}); a piece is {PIECE}")
    array_nbytes = results[0][1].nbytes
    assert ledger.charges >= array_nbytes // PIECE, "the bulk work was not seen"


def test_uvloop_reads_a_piece_per_turn(monkeypatch):
    """uvloop reads a socket up to 32 times per wake-up while it holds more: the payload's reads
    stop for a turn of the loop when one is overdue (here after every piece)."""
    uvloop = pytest.importorskip("uvloop")
    ledger = Ledger()
    instrument(monkeypatch, ledger)
    async def main():
        async with counted(on_turn=ledger.turn) as turned:  # an account per turn of the loop
            return await run_op("broadcast", 2, False), turned.count

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results, turned = runner.run(main())
    monkeypatch.undo()
    for got, want, _ in results:
        np.testing.assert_array_equal(got, want)
    assert turned >= 2 * BLOCK * 4 // PIECE, "the ticker hardly ran"
    # between two turns of the ticker: at most a piece read (and a piece written by the sender)
    assert ledger.worst <= 2 * PIECE + SLACK, (
        f"{ledger.worst} bytes moved between two turns of the loop (last through {ledger.what})")


async def test_a_frame_kept_before_its_receive_is_copied_in_a_piece_per_turn(monkeypatch):
    """A frame that arrived before its receive was posted is copied into the receive's buffer a
    piece at a time, the loop turning between pieces (here after every piece: TURN_S = 0)."""
    from runtime.testing import make_runtimes
    monkeypatch.setattr(turns, "PIECE_NBYTES", PIECE)
    monkeypatch.setattr(turns, "TURN_S", 0.0)
    rts = await make_runtimes(2, "tcp")
    try:
        data = (np.arange(1 << 20) % 251).astype(np.uint8)
        mailbox = rts[1].actor.mailbox
        await rts[0].actor.send(1, "early", data)
        while not mailbox.has_unexpected():  # kept whole: nobody has asked for it
            await mailbox.wait_kept(10)
        out = np.zeros_like(data)
        async with counted() as turned:
            await rts[1].actor.recv_into(0, "early", out, timeout_s=10)
        np.testing.assert_array_equal(out, data)
        pieces = data.nbytes // turns.piece_items(1, 2)
        assert turned.count >= pieces - 1, f"{turned.count} turns of the loop for {pieces} pieces"
    finally:
        for rt in rts:
            await rt.close()



def late_inputs(op: str, n: int, r: int) -> tuple:
    """(the call's arguments, keywords, the array that holds the answer or None, the answer) of rank
    r of n for the ops below; the root (src, dst) is rank 0."""
    i = np.arange(BLOCK)
    def mine(p, j=0):  # rank p's block j: exact in float32
        return (p * 1000 + j * 10 + i % 7).astype(np.float32)
    if op == "all_reduce":
        x = np.concatenate([mine(r), mine(r)])
        return (x,), {"op": "sum"}, x, np.concatenate([sum(mine(p) for p in range(n))] * 2)
    if op == "broadcast":
        x = np.concatenate([mine(0), mine(0)]) if r == 0 else np.zeros(2 * BLOCK, np.float32)
        return (x,), {"src": 0}, x, np.concatenate([mine(0), mine(0)])
    if op == "reduce":
        x = np.concatenate([mine(r, j) for j in range(n)])
        want = np.concatenate([sum(mine(p, j) for p in range(n)) for j in range(n)])
        return (x,), {"dst": 0, "op": "sum"}, x if r == 0 else None, want
    if op == "gather":
        out = np.zeros(n * BLOCK, np.float32) if r == 0 else None
        return (out, mine(r)), {"dst": 0}, out, np.concatenate([mine(p) for p in range(n)])
    if op == "scatter":
        x = np.concatenate([mine(0, j) for j in range(n)]) if r == 0 else None
        out = np.zeros(BLOCK, np.float32)
        return (out, x), {"src": 0}, out, mine(0, r)
    if op == "all_to_all":
        out = np.zeros(n * BLOCK, np.float32)
        return (out, np.concatenate([mine(r, j) for j in range(n)])), {}, out, np.concatenate([mine(p, r) for p in range(n)])
    out = np.zeros(n * BLOCK, np.float32)  # all_gather
    return (out, mine(r)), {}, out, np.concatenate([mine(p) for p in range(n)])


LATE = [("all_reduce", "recursive_doubling", 3), ("all_reduce", "halving_doubling", 3), ("all_reduce", "ring", 4),
        ("broadcast", "chain", 3), ("broadcast", "tree", 4), ("reduce", "tree", 4), ("reduce", "rabenseifner", 2),
        ("gather", "direct", 4), ("scatter", "tree", 4), ("all_to_all", "direct", 4), ("all_gather", "bruck", 3)]


@pytest.mark.parametrize("op,algo,n", LATE, ids=lambda v: str(v))
@pytest.mark.parametrize("late", [False, True], ids=["in_step", "late"])
async def test_no_callback_moves_more_than_a_piece_when_frames_are_kept(monkeypatch, op, algo, n, late):
    """Every TCP algorithm, with ranks in step and with one rank entering the call late, so that its
    peers' frames arrive before their receives and are kept. A kept frame's buffer is allocated by
    the loop callback that reads its header; a zero-filled one (a bytearray) is charged in full (a
    64 MiB one held the loop for 35 ms), and so are sends done at once (``send_now``), which hand
    the loop back only when the algorithm gives it a turn. Segments are patched down to a piece."""
    import importlib

    from collectives.algorithms.tcp import broadcast_chain
    from runtime import mailbox

    ledger = Ledger()
    instrument(monkeypatch, ledger)
    take = mailbox._BufferPool.take

    def charged_take(pool, nbytes):
        buf = take(pool, nbytes)
        if type(buf.obj) is bytearray:  # zero-filled at once
            ledger.charge(len(buf.obj), "a kept frame's buffer")
        return buf
    monkeypatch.setattr(mailbox._BufferPool, "take", charged_take)
    monkeypatch.setattr(comm, "SEGMENT_NBYTES", PIECE)
    for name in ("all_reduce_ring", "reduce_scatter_ring", "all_gather_ring"):
        monkeypatch.setattr(importlib.import_module(f"collectives.algorithms.tcp.{name}"), "SEGMENT_NBYTES", PIECE)
    monkeypatch.setattr(broadcast_chain, "SEGMENT_MIN_NBYTES", PIECE // 4)  # segments sent at once (send_now)
    monkeypatch.setattr(broadcast_chain, "SEGMENT_MAX_NBYTES", PIECE // 4)
    per_callback(monkeypatch, ledger)
    waiter = 0 if op in ("reduce", "gather") else n - 1  # the rank that receives what the others send

    async def body(g):
        args, kw, got, want = late_inputs(op, n, g.rank)
        if late and g.rank == waiter:
            await asyncio.sleep(0.2)  # the peers' frames to this rank arrive before its receives
        await getattr(C, op)(*args, group=g, algorithm=algo, **kw)
        return got, want, g.runtime.actor.statistics().kept_frames_total
    results = await run_ranks(n, body, transport="tcp")
    monkeypatch.undo()
    for r, (got, want, _) in enumerate(results):
        if got is not None:
            np.testing.assert_array_equal(got, want, err_msg=f"{op} {algo} rank {r} of {n}")
    if late:
        assert results[waiter][2] > 0, "no frame arrived before its receive: the case was not made"
    assert ledger.worst <= PIECE + SLACK, (
        f"{op} {algo} on {n} ranks: one loop callback moved {ledger.worst} bytes (last through "
        f"{ledger.what}); a piece is {PIECE}")
