"""Process groups: who takes part in a collective, and how its messages match.

``new_group(ranks)`` (runtime/rankruntime.py) makes the next group id after the world's 0;
as in torch.distributed, every rank of the world calls it in the same order, members or not.
Each collective call on a group takes the group's next sequence number (a :class:`Call`), and
every message it sends is framed ``c {t: [gid, seq], f: fingerprint}``. The fingerprint says
what the sender is doing, e.g. ``"all_reduce op=sum dtype=float32 count=1000 root=-"``.
Messages of one call between one pair of ranks are matched in order (TCP keeps it) and each
is checked against the receiver's own fingerprint: two ranks in different collectives, or in
the same one with another dtype, length or root, fail with a :class:`CollectiveMismatchError`
naming both calls and both ranks, and the rank that sees it tells every other member.

A group fails as a whole: after a mismatch, a lost peer or a timeout, the pending calls of
the group and every later call raise the same error (as a communicator does after an NCCL
abort), and every member is told, a timeout too (a rank that arrives after its peer gave up
must not take the frames sent before as a success). A peer that aborted fails every group it
is in with its PeerAbortedError. The rules in full, with the stalled-call checks:
docs/design.md.

Not here: the rank's runtime that holds the groups (rankruntime.py), the algorithms and the
arrays (collectives/), the sockets (actor.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import numbers
import time

from runtime import wire
from runtime.topology import HostTopology
from runtime.turns import LoopTurns
from runtime.mailbox import KEPT_NOW_NBYTES
from runtime.transport import RECV_NOW_NBYTES
from runtime.errors import (CollectiveMismatchError, CollectiveTimeoutError, PeerLostError, PeerTimeoutError,
                            RingweaveError, ranks_in_words)

log = logging.getLogger("ringweave.group")
NOTHING, SENT, DONE = 0, 1, 2  # what Call.exchange_now did
WARN_AT_CHECK = 5  # the mismatch check that also logs who the call waits for (at 1+2+4+8+16 = 31 check_s)
_live_runtimes = 0  # RankRuntimes made and not closed in this process (Call.sendrecv; count_runtime)
# The thread that issued the call running in this task, set by the blocking facade
# (collectives/blocking.py): part of every fingerprint, so that ranks whose threads
# interleaved their calls on a group differently fail with a mismatch, never a wrong answer.
issuing_thread: contextvars.ContextVar[str | None] = contextvars.ContextVar("ringweave_issuing_thread",
                                                                            default=None)

def count_runtime(delta: int) -> None:
    """A RankRuntime counts itself in (+1, made) and out (-1, closed): Call.sendrecv waits off
    the loop only while the process has one."""
    global _live_runtimes
    _live_runtimes += delta


def check_timeout(timeout, what: str = "timeout") -> float | None:
    """``timeout`` as float seconds, or None (the runtime's default): every call checks it
    first, before it takes a sequence number or sends a byte, so a bad value fails at once and
    the same way on every rank and every path.

    Raises:
        TypeError: not a number (a bool or a str included), naming ``what`` and the value.
        ValueError: not positive, or not finite (NaN, inf): every wait is bounded.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None, got {type(timeout).__name__} {timeout!r}")
    t = float(timeout)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"{what} must be a positive, finite number of seconds or None, got {timeout!r}")
    return t


class Call:
    """One collective call on one group: the ``comm`` an algorithm talks through, and the
    record of it that ``tools/status`` shows (``gid``, ``seq``, ``fingerprint``, ``started``,
    ``waiting_on``).

    Algorithms use only ``rank``, ``size``, ``send``, ``irecv``, ``recv_into`` and ``sendrecv``
    (and ``exchange_now``, the inline rounds of collectives/inline_tcp.py); ranks are group ranks
    and buffers are bytes-like (memoryviews of arrays).

    Every receive posted by the call stays in ``_outstanding`` until the call ends: what it
    still waits on is derived from it when asked (status, a timeout), not kept up to date
    per message. A receive that failed without being awaited (the call failed on another
    one first) is marked retrieved when the call ends (``cancel_outstanding``), so asyncio
    does not log "exception was never retrieved": the call raises the error itself.
    """
    __slots__ = ("group", "gid", "rank", "size", "seq", "fingerprint", "timeout_s", "started", "deadline",
                 "task", "loop", "expired", "check_at", "checks", "bytes_sent", "algorithm", "_tag", "_packed",
                 "_outstanding", "_actor", "_peers", "__weakref__")

    def __init__(self, group: "ProcessGroup", seq: int, fingerprint: str, timeout_s: float):
        self.group = group
        self.gid = group.gid
        self.rank = group.rank
        self.size = group.size
        self.seq = seq
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.deadline = float("inf")  # loop time; set when the call starts running (Watchdog.watch)
        self.task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the running loop (Watchdog.watch), for futures
        self.expired = False  # the watchdog cancelled it
        self.check_at = float("inf")  # loop time of its next mismatch check (Watchdog.watch)
        self.checks = 0  # mismatch checks made so far (each waits twice as long as the one before)
        self.bytes_sent = 0
        self.algorithm: str | None = None  # shown by runtime tracing
        self._tag = (group.gid, seq)
        self._packed: bytes | None = None  # the frame header, packed at the first send
        self._outstanding: dict[asyncio.Future, tuple[tuple, int]] = {}  # every receive posted: (key, src)
        self._actor = group.runtime.actor
        self._peers = group.ranks  # group rank -> global rank

    @property
    def waiting_on(self) -> set[int]:
        """Group ranks this call has a receive outstanding from (cancelled ones count: the
        deadline gave up on them, and the rank is still missing)."""
        # list(): one step under the GIL, so tools.status may ask from the listener's thread
        return {src for fut, (_, src) in list(self._outstanding.items()) if not fut.done() or fut.cancelled()}

    async def send(self, dst: int, buf) -> None:
        """Sends ``buf`` to group rank ``dst``; returns when ``buf`` may be reused."""
        if not self.send_now(dst, buf):  # a frame up to 1 MiB goes out at once, without a coroutine
            mv = buf if type(buf) is memoryview and buf.format == "B" else memoryview(buf).cast("B")
            self.bytes_sent += mv.nbytes
            await self._actor.connection(self._peers[dst]).send(self._packed, mv)

    def irecv(self, src: int, buf) -> asyncio.Future:
        """Posts a receive from group rank ``src`` into ``buf`` (exact length);
        returns a future to await. Post before sending to avoid a copy."""
        mv = buf if type(buf) is memoryview and buf.format == "B" else memoryview(buf).cast("B")
        peer = self._peers[src]
        key = ("c", peer, self._tag)
        fut = self._actor.post(key, peer, mv, self._check, self.loop)
        error = self.group.error
        if error is not None and not fut.done():
            self._actor.unpost(key, fut)
            fut.set_exception(error)
        if fut.done():
            if not fut.cancelled():
                fut.exception()  # marked retrieved (see the class docstring)
        else:
            self._outstanding[fut] = (key, src)
        return fut

    async def recv_into(self, src: int, buf) -> None:
        await self.irecv(src, buf)

    async def sendrecv(self, dst: int | None, sbuf, src: int, rbuf: memoryview) -> None:
        """Sends ``sbuf`` to group rank ``dst`` (None: nothing) and receives ``src``'s message
        of this call into ``rbuf`` (a byte memoryview of the exact length): the same as
        ``arrived = irecv(src, rbuf); await send(dst, sbuf); await arrived``, which it falls
        back to.

        The fast path: when this is the only call in flight on the runtime, the send is at
        most SEND_NOW_NBYTES (1 MiB; or there is none) and goes out at once (``send_now``),
        the receive is at most RECV_NOW_NBYTES (1 MiB) and nothing of ``src``'s connection
        is staged or kept, ``src``'s frame is read straight from its socket
        (``Connection.recv_now``), its header checked byte for byte against ours (a peer in
        the same call packs the same one), waiting in ``poll()`` for at most the runtime's
        ``inline_wait_s`` (``RINGWEAVE_INLINE_WAIT_US``, default 2000; 0: never) without
        returning to the event loop, the first ``spin_s`` of it (``RINGWEAVE_SPIN_US``, default
        50) re-reading the socket with ``sched_yield`` between reads instead of sleeping. That
        skips the loop's wake-up, the sink callbacks and the receive's future
        (bench/results/transport.md#the-small-message-path). Only while the runtime is the process's only one:
        ranks run as tasks of one loop (runtime.testing) would wait on a peer that cannot run
        until the wait is over. Anything else (another
        frame first, a mismatch, a lost peer, no frame in time) goes to the normal path,
        which reports it as it always does; other tasks of the loop wait at most that long.

        Raises:
            as :meth:`send` and :meth:`irecv` (the group's error, PeerLostError,
            CollectiveMismatchError through the call's check).
        Cancellation: as ``send`` then awaiting the receive; the wait in ``poll()`` cannot
            be cancelled, it ends by itself within ``inline_wait_s``.
        """
        done = self.exchange_now(dst, sbuf, src, rbuf)
        if done == DONE:
            return
        if done == SENT:
            await self.irecv(src, rbuf)  # what was read of it went the usual way
            return
        arrived = self.irecv(src, rbuf)
        if dst is not None:
            await self.send(dst, sbuf)
        await arrived

    def exchange_now(self, dst: int | None, sbuf, src: int, rbuf: memoryview) -> int:
        """:meth:`sendrecv`'s fast path alone, on the caller's thread, without a coroutine:
        DONE (sent, and ``src``'s frame is in ``rbuf``), SENT (sent, or nothing to send, but
        the frame did not come in time or was not ours: receive it the usual way, ``irecv``)
        or NOTHING (nothing sent: the path cannot be taken now)."""
        actor = self._actor
        rt = self.group.runtime
        if not (rt.in_flight == 1 and _live_runtimes == 1 and rt.inline_wait_s > 0 and rbuf.nbytes <= RECV_NOW_NBYTES
                and self.group.error is None):
            return NOTHING
        peer = self._peers[src]
        if actor.has_unexpected():  # frames kept: ours, if among them, is taken from there (a peer ahead)
            key = ("c", peer, self._tag)
            if rbuf.nbytes > KEPT_NOW_NBYTES or not actor.mailbox.holds(key):
                return NOTHING  # (the socket may hold frames behind a kept one of ours)
            if dst is not None and not self.send_now(dst, sbuf):
                return NOTHING
            fut = actor.post(key, peer, rbuf, self._check, self.loop)  # done at once: copied, or checked and failed
            exc = fut.exception()  # (a mismatch: the group is failed, as the normal path's receive would)
            if exc is not None:
                raise exc
            return DONE
        conn = actor.connection(peer)
        if dst is None or self.send_now(dst, sbuf):
            head = wire.encode_head(self._packed or self._pack(), rbuf.nbytes)
            return DONE if conn.recv_now(head, rbuf, rt.inline_wait_s, rt.spin_s) else SENT
        return NOTHING

    def send_now(self, dst: int, buf) -> bool:
        """Sends ``buf`` to group rank ``dst`` if that can be done at once (a frame up to
        SEND_NOW_NBYTES, the connection idle: ``Connection.send_now``); False: nothing was sent."""
        error = self.group.error
        if error is not None:
            raise error
        mv = buf if type(buf) is memoryview and buf.format == "B" else memoryview(buf).cast("B")
        if self._actor.connection(self._peers[dst]).send_now(self._packed or self._pack(), mv):
            self.bytes_sent += mv.nbytes
            return True
        return False

    def _pack(self) -> bytes:
        """The header of every frame of this call, packed once, when first needed (a shared-memory
        call never needs it); a peer in the same call packs the same bytes."""
        self._packed = wire.pack_header({"k": "c", "t": self._tag, "f": self.fingerprint})
        return self._packed

    def _check(self, header: dict, nbytes: int, peer: int):
        """The actor's check of a frame for one of our receives (``peer``: the global rank
        that sent it): None if it is of this call, else the mismatch (the group is failed)."""
        theirs = header["f"]
        if theirs == self.fingerprint:
            return None
        exc = CollectiveMismatchError(
            f"collective mismatch in group {self.gid} at call #{self.seq}: "
            f"rank {self._peers[self.rank]} called {self.fingerprint!r} but rank {peer} called {theirs!r}")
        self.group.abort(exc)
        return exc

    def fail_outstanding(self, exc: BaseException) -> None:
        """Fails every receive still pending with ``exc`` (the group failed)."""
        for fut in self._outstanding:
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # marked retrieved: the awaiting algorithm still raises it

    def cancel_outstanding(self) -> list[int]:
        """Withdraws every receive of the call still posted (a failed one too: a frame that
        comes later must not land in the caller's array after the call has raised); returns
        the group ranks they waited on. Receives that failed unawaited are marked retrieved."""
        missing = sorted(self.waiting_on)
        actor = self._actor
        for fut, (key, _) in self._outstanding.items():
            actor.unpost(key, fut)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()
        return missing


class ProcessGroup:
    """A set of ranks that run collectives together."""

    def __init__(self, runtime, ranks: list[int], gid: int):
        self.runtime = runtime  # the RankRuntime that holds it (runtime/rankruntime.py)
        self.ranks = list(ranks)  # group rank -> global rank
        self.gid = gid
        me = runtime.actor.rank
        self.rank = self.ranks.index(me) if me in self.ranks else -1
        self.size = len(self.ranks)
        self.error: BaseException | None = None
        self._shm_enabled: bool | None = None  # None: follow the runtime
        self._topology: HostTopology | None = None  # worked out when first asked (topology)
        self._seq = 0
        self.calls: dict[int, Call] = {}  # seq -> calls in flight
        self._finished: dict[int, str] = {}  # seq -> fingerprint of recently finished calls

    @property
    def shm_enabled(self) -> bool:
        """Whether this group may use the same-host shared-memory path: the group's own
        setting if one was made, else its runtime's (``Communicator(shm=False)`` turns
        it off for every group; ``RINGWEAVE_SHM=0`` turns the path off everywhere)."""
        return self.runtime.shm_enabled if self._shm_enabled is None else self._shm_enabled

    @shm_enabled.setter
    def shm_enabled(self, value: bool) -> None:
        self._shm_enabled = bool(value)

    @property
    def topology(self) -> HostTopology:
        """How the group's ranks sit on hosts (``runtime.topology``), from the node ids its runtime
        was given at init (``RankRuntime.nodes``): the same on every member. Worked out once."""
        topology = self._topology
        if topology is None:
            nodes = self.runtime.nodes
            topology = self._topology = HostTopology.of([nodes[r] for r in self.ranks])
        return topology

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def __repr__(self) -> str:
        return f"ProcessGroup(gid={self.gid}, rank={self.rank}, size={self.size}, ranks={self.ranks})"

    def new_group(self, ranks) -> "ProcessGroup":
        """See :meth:`RankRuntime.new_group` (sub-groups are always made from the world)."""
        return self.runtime.new_group(ranks)

    def group_rank(self, global_rank: int) -> int:
        """The group rank of world rank ``global_rank`` (what ``src``, ``dst`` and ``root``
        of the collectives take), like ``torch.distributed.get_group_rank``.

        Raises:
            ValueError: ``global_rank`` is not a member of this group.
        """
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not a member of group {self.gid} {self.ranks}") from None

    def global_rank(self, group_rank: int) -> int:
        """The world rank of group rank ``group_rank`` (``torch.distributed.get_global_rank``).

        Raises:
            ValueError: ``group_rank`` is outside 0..size-1.
        """
        if not 0 <= group_rank < self.size:
            raise ValueError(f"group rank {group_rank} is outside 0..{self.size - 1} (group {self.gid} {self.ranks})")
        return self.ranks[group_rank]

    def open_call(self, fingerprint: str, timeout_s: float | None = None) -> Call:
        """Starts a collective call: takes the next sequence number.

        Raises:
            CollectiveError (or the group's stored error): the group has failed.
            ValueError: this rank is not a member, or ``timeout_s`` is not positive and finite.
            TypeError: ``timeout_s`` is not a number.
        """
        if timeout_s is not None:
            timeout_s = check_timeout(timeout_s)
        if self.rank < 0:
            raise ValueError(f"rank {self.runtime.actor.rank} is not a member of group {self.gid} {self.ranks}")
        if self.error is not None:
            raise self.error
        thread = issuing_thread.get()
        if thread is not None:
            fingerprint = f"{fingerprint} thread={thread}"
        self._seq += 1
        call = Call(self, self._seq, fingerprint, timeout_s if timeout_s is not None else self.runtime.timeout_s)
        self.calls[call.seq] = call
        return call

    async def run(self, call: Call, coro_fn, *args) -> None:
        """Runs ``coro_fn(call, *args)`` under the call's timeout and failure rules."""
        rt = self.runtime
        tracer = rt.tracer
        tracing = tracer.enabled
        start_us = tracer.now_us() if tracing else 0.0
        outcome = "error"
        watchdog = rt.watchdog
        actor = rt.actor
        rt.in_flight += 1
        try:
            if actor.has_unexpected():
                self._check_early(call)
            watchdog.watch(call)
            try:
                await coro_fn(call, *args)
            except asyncio.CancelledError:
                if not watchdog.expired(call):
                    raise
                raise TimeoutError from None  # the call's deadline, not the caller's cancellation
            finally:
                watchdog.unwatch(call)
            if actor.has_unexpected():
                self._check_leftovers(call)
            outcome = "ok"
        except TimeoutError:
            missing = call.cancel_outstanding()
            names = [self.ranks[m] for m in missing]
            waiting = f" waiting on {ranks_in_words(names)}" if names else ""
            said = (f"rank {self.runtime.actor.rank}: {call.fingerprint!r} (group {self.gid}, call #{call.seq}) "
                    f"timed out after {call.timeout_s:.1f} s{waiting}")
            exc = CollectiveTimeoutError(said, missing=names)
            first = self.error is None
            # The group's error from here on (a peer lost while the others are asked below is not),
            # its message completed once they answered; then the others are told.
            self.abort(exc, tell_peers=False)
            absent, why = await self._not_arrived(call)
            exc.absent = absent
            exc.args = (said + (f"; {ranks_in_words(absent)} had not reached this call "
                                f"({', '.join(f'{r}: {why[r]}' for r in absent)})" if absent else
                                "; every rank had reached it"),)
            if first:  # the others fail too: a late rank must not take this call's frames as a success
                self.runtime.tell_abort(self, exc)
            raise exc from None
        except BaseException as exc:
            call.cancel_outstanding()
            if isinstance(exc, PeerLostError):  # e.g. a peer said goodbye mid-call: members waiting
                self.abort(exc)                 # on us rather than on it would otherwise time out
            raise
        finally:
            rt.in_flight -= 1
            self.calls.pop(call.seq, None)
            self._finished[call.seq] = call.fingerprint
            if len(self._finished) > 256:  # drop the first finished (O(1); min() scanned all 256 per call)
                del self._finished[next(iter(self._finished))]
            if tracing:
                tracer.complete(call.fingerprint.split(" ", 1)[0], start_us, tracer.now_us(), self.gid,
                                {"op": call.fingerprint, "seq": call.seq, "group": self.gid,
                                 "bytes_sent": call.bytes_sent, "algorithm": call.algorithm,
                                 "outcome": outcome})
        # A call that never waited on anything unfinished (a small shared-memory call, frames read
        # straight off the socket) never handed the loop back: back to back, such calls would
        # starve every other task of the loop. One clock read says whether it is time for a turn;
        # where ranks share cores, less often (turns.SHARED_TURN_S).
        if LoopTurns.for_loop(call.loop).due(rt.call_turn_s):
            await asyncio.sleep(0)

    async def _not_arrived(self, call: Call) -> tuple[list[int], dict[int, str]]:
        """Asks every other member, when ``call`` timed out, whether it reached it.

        The ranks a call waits on are its algorithm's neighbours (in a ring, the
        one to the left), and a shared-memory call waits on nobody in particular,
        so they need not be the rank that never came. A member that answers
        ``ringweave.status`` with a lower sequence number for this group, or does
        not answer within the budget (stopped, stuck without the GIL), had not
        arrived; one that is gone is left to PeerLostError. Bounded by
        :func:`_answer_budget_s` (``min(1 s, timeout / 4)``), sending the question
        included: to a peer stopped in the middle of a transfer the question queues
        behind a payload that never drains, and the diagnosis goes on without its answer.

        Returns:
            (global ranks that had not arrived, rank -> why), e.g. ``([2], {2: "not answering"})``.
        """
        why = {}
        peers = [r for r in self.ranks if r != self.runtime.actor.rank]
        for peer, st in await self._ask(call, peers, "ringweave.status"):
            if isinstance(st, PeerTimeoutError):  # the question queued behind bytes it does not read
                why[peer] = f"not answering in {_answer_budget_s(call):.2g} s: it stopped reading (stalled or stopped)"
            elif isinstance(st, TimeoutError):
                why[peer] = f"not answering in {_answer_budget_s(call):.2g} s"
            elif isinstance(st, dict):  # (another error: gone or refused, not a matter of arriving)
                seq = dict(st.get("seqs", ())).get(self.gid)
                if isinstance(seq, int) and seq < call.seq:
                    why[peer] = f"at call #{seq}"
        return sorted(why), why

    async def _ask(self, call: Call, peers: list[int], name: str, *args) -> list[tuple[int, object]]:
        """Calls handler ``name`` on every one of ``peers`` at once, each within
        :func:`_answer_budget_s`; returns (peer, answer) pairs, the answer being the exception
        where the question failed (TimeoutError: no answer in time; another: gone or refused)."""
        actor = self.runtime.actor
        budget_s = _answer_budget_s(call)

        async def one(peer: int) -> tuple[int, object]:
            try:
                return peer, await actor.call(peer, name, *args, timeout_s=budget_s)
            except (TimeoutError, RingweaveError, OSError) as exc:
                return peer, exc

        return list(await asyncio.gather(*(one(p) for p in peers)))

    def check_stalled(self, call: Call) -> None:
        """Asks, in the background, the ranks ``call`` waits on (every other member when it
        waits on none in particular, as a shared-memory call does) which call they are in at
        this call's sequence number; one in a different call fails the group with a
        CollectiveMismatchError naming both calls and both ranks, which every member then
        raises. The Watchdog calls this for a call in flight ``RINGWEAVE_MISMATCH_CHECK_S``
        (default 1 s), then after twice as long each time. The WARN_AT_CHECK-th check (at 31 s
        by default) also logs a warning naming the ranks waited on and those that have not
        reached the call (and where they are), long before the deadline (300 s) says so.

        Why: a mismatch shows in the frames only when a rank receives a frame of the other
        call. Ranks that disagree on a gather's or a reduce's root may all wait for frames
        nobody sends (the rank that thinks it is the root sends nothing), and without this
        they waited for the whole timeout."""
        if self.error is None:
            self.runtime.actor._spawn(self._ask_about(call), f"mismatch check g{self.gid} #{call.seq}")

    async def _ask_about(self, call: Call) -> None:
        actor = self.runtime.actor
        lost = actor.lost_peers()
        asked = [self.ranks[r] for r in call.waiting_on] or [r for r in self.ranks if r != actor.rank]
        answers = await self._ask(call, [r for r in asked if r not in lost], "ringweave.call_of", self.gid, call.seq)
        if self.error is not None or self.calls.get(call.seq) is not call:
            return  # failed or finished meanwhile
        for peer, theirs in answers:  # (a failed question teaches nothing; a lost peer fails the call anyway)
            if isinstance(theirs, str) and theirs != call.fingerprint:
                self.abort(self._mismatch_error(call.seq, call.fingerprint, peer, theirs))
                return
        if call.checks == WARN_AT_CHECK:  # long enough to say who is missing, before the deadline
            absent, why = await self._not_arrived(call)
            if self.error is None and self.calls.get(call.seq) is call:
                waited = time.monotonic() - call.started
                waited_on = sorted(self.ranks[r] for r in call.waiting_on)
                reasons = ", ".join(f"{r}: {why[r]}" for r in absent)
                missing = f"; not reached by {ranks_in_words(absent)} ({reasons})" if absent else \
                    "; every rank has reached it"
                on = f" on {ranks_in_words(waited_on)}" if waited_on else ""
                log.warning("rank %d: %r (group %d, call #%d) has waited %.0f s%s%s", actor.rank,
                            call.fingerprint, self.gid, call.seq, waited, on, missing)

    def call_of(self, seq: int) -> str | None:
        """The fingerprint of this rank's call #``seq`` in this group: in flight or finished
        (the last 256), None when it has not got there yet (or forgot it)."""
        rec = self.calls.get(seq)
        return rec.fingerprint if rec is not None else self._finished.get(seq)

    def _check_leftovers(self, call: Call) -> None:
        """A call that finished with frames of its own still unclaimed disagreed with
        their sender (e.g. both ranks thought they were the root of a broadcast and
        neither received): a mismatch, not something to ignore."""
        actor = self.runtime.actor
        for peer in self.ranks:
            for header in actor.unexpected_headers(("c", peer, call._tag)):
                exc = self._stray_error(call.seq, call.fingerprint, peer, header["f"])
                self.abort(exc)
                raise exc

    def on_stray(self, peer: int, header: dict) -> None:
        """A frame of call #seq was kept (no receive posted for it): a mismatch when that
        call finished here (see _check_leftovers), or is in flight here as another call.
        (E.g. ranks that disagree about a broadcast's root: a rank may wait on a parent
        that never sends while its real parent's frame sits unclaimed; without this it
        waited for the whole timeout.)"""
        seq = header["t"][1]
        if self.error is not None or not self.is_member or seq > self._seq:
            return  # failed already, not ours, or early: checked when the call starts (_check_early)
        rec = self.calls.get(seq)
        if rec is None:
            self.abort(self._stray_error(seq, self._finished.get(seq, "?"), peer, header["f"]))
        elif rec.fingerprint != header["f"]:
            self.abort(self._mismatch_error(seq, rec.fingerprint, peer, header["f"]))

    def _check_early(self, call: Call) -> None:
        """Frames of ``call`` that arrived before it started here must be of the same call."""
        actor = self.runtime.actor
        for peer in self.ranks:
            for header in actor.unexpected_headers(("c", peer, call._tag)):
                if header["f"] != call.fingerprint:
                    exc = self._mismatch_error(call.seq, call.fingerprint, peer, header["f"])
                    self.abort(exc)
                    raise exc

    def _mismatch_error(self, seq: int, mine: str, peer: int, theirs: str) -> CollectiveMismatchError:
        return CollectiveMismatchError(
            f"collective mismatch in group {self.gid} at call #{seq}: rank {self.runtime.actor.rank} called "
            f"{mine!r} but rank {peer} called {theirs!r}")

    def _stray_error(self, seq: int, mine: str, peer: int, theirs: str) -> CollectiveMismatchError:
        how = "called" if mine != theirs else "(same call, but a message nobody received)"
        return CollectiveMismatchError(
            f"collective mismatch in group {self.gid} at call #{seq}: rank {self.runtime.actor.rank} called "
            f"{mine!r} but rank {peer} {how} {theirs!r}; its message was never received")

    def abort(self, exc: BaseException, tell_peers: bool = True) -> None:
        """Fails the group: every pending and later call raises ``exc``."""
        if self.error is not None:
            return
        self.error = exc
        for call in list(self.calls.values()):
            call.fail_outstanding(exc)
        if tell_peers and isinstance(exc, (CollectiveMismatchError, PeerLostError, CollectiveTimeoutError)):
            self.runtime.tell_abort(self, exc)

    def statistics(self) -> dict:
        return {"gid": self.gid, "seq": self._seq, "in_flight": len(self.calls),
                "error": repr(self.error) if self.error else None}


def _answer_budget_s(call: Call) -> float:
    """How long a question to the other ranks about ``call`` waits for their answers."""
    return min(1.0, call.timeout_s / 4) if call.timeout_s is not None else 1.0
