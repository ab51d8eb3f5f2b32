"""One rank's runtime: :class:`RankRuntime` holds its actor (the connections to every peer), its
store (its generation's namespace), its process groups, and the :class:`Watchdog` over the
deadlines of its calls in flight.

``runtime.init`` makes one from what a rendezvous yields (runtime/rendezvous.py), and
``runtime.testing`` makes several in one event loop. A RankRuntime routes what the actor hears
to the groups (a lost peer, a member's abort, a stray frame), answers ``ringweave.status`` and
``ringweave.call_of`` for tools and the mismatch checks, and closes everything it holds, the
rendezvous it was given included.

Not here: the groups and their calls (group.py), the sockets (actor.py), joining (init.py).
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import sys
import time

from runtime import env, turns
from runtime.actor import Actor
from runtime.group import Call, ProcessGroup, count_runtime
from runtime.trace import Tracer
from runtime.errors import (ClosedError, CollectiveError, CollectiveMismatchError, CollectiveTimeoutError,
                            PeerAbortedError, PeerLostError, RingweaveError)

log = logging.getLogger("ringweave.group")


class Watchdog:
    """The deadlines of a runtime's calls in flight: one timer, armed for the earliest of them,
    cancels the task of every call past its deadline (``expired`` then tells group.run that the
    cancellation was the deadline's), and starts the mismatch check of every call in flight for
    ``check_s`` (ProcessGroup.check_stalled; again after 2, 4, .. 64 x check_s more).
    ``asyncio.timeout`` per call did the deadlines with a timer of its own, a cost per call
    (bench/results/runtime.md#one-timer-for-the-deadlines): this one timer fires about once
    per ``check_s`` (1 s) while calls are in flight, and looks only at those. A wait that blocks
    the thread (runtime/sharedmem/waits.py) hands the loop back after each 2 ms slice in which
    nothing woke it, so the timer gets to run."""

    def __init__(self, check_s: float = 0.0):
        self._calls: dict[Call, None] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._at = float("inf")  # when the armed timer fires
        self._loop: asyncio.AbstractEventLoop | None = None
        self.check_s = check_s  # a call this long in flight gets a mismatch check (0: never)

    def watch(self, call: Call) -> None:
        # The loop through the task: asyncio.get_running_loop() and current_task() each make a
        # getpid system call (CPython's fork check; bench/results/runtime.md#the-loop-through-the-task).
        call.task = task = asyncio.current_task()
        call.loop = loop = task.get_loop() if task is not None else asyncio.get_running_loop()
        if call.timeout_s is None and not self.check_s:
            call.deadline = float("inf")
            return
        if loop is not self._loop:  # first call, or the runtime moved to another loop
            self.close()
            self._loop = loop
        now = loop.time()
        call.deadline = now + call.timeout_s if call.timeout_s is not None else float("inf")
        if self.check_s:
            call.check_at = now + self.check_s
        self._calls[call] = None
        at = min(call.deadline, call.check_at)
        if at < self._at:
            self._arm(at)

    def unwatch(self, call: Call) -> None:
        self._calls.pop(call, None)  # the timer stays armed: it re-arms for the rest when it fires

    def expired(self, call: Call) -> bool:
        """Whether the watchdog cancelled ``call`` (and the task has no other cancellation)."""
        if not call.expired:
            return False
        return call.task.uncancel() == 0

    def _arm(self, at: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._at = at
        self._handle = self._loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._handle, self._at = None, float("inf")
        now = self._loop.time()
        later = float("inf")
        for call in list(self._calls):
            if call.deadline <= now:
                del self._calls[call]
                call.expired = True
                call.task.cancel()
                continue
            if call.check_at <= now:  # in flight for a while: is every rank in the same call?
                call.checks += 1
                call.check_at = now + self.check_s * (2 ** min(call.checks, 6))  # 1, 2, 4 .. 64 x check_s
                call.group.check_stalled(call)
            later = min(later, call.deadline, call.check_at)
        if later != float("inf"):
            self._arm(later)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle, self._at = None, float("inf")


class RankRuntime:
    """One rank's runtime: actor, store, groups (see the module docstring)."""

    def __init__(self, actor: Actor, store=None, *, timeout_s: float | None = None,
                 local_rank: int = 0, local_world_size: int = 1, trace_dir: str | None = None,
                 nodes: list[str] | None = None, generation: int = 0, rendezvous=None):
        """``timeout_s``: the default deadline of every call; None: ``RINGWEAVE_TIMEOUT_S`` as it is
        now (``runtime.env.timeout_s``). ``nodes``: the node id of every world rank, as published
        at init (the same list on every rank); None: all on one node (ranks that are tasks of one
        process, runtime.testing). ``generation``: the rendezvous generation ``store`` belongs to.
        ``rendezvous``: one to shut down with this runtime (``runtime.init`` passes the one it chose
        from the environment; a caller's own is left to the caller, for its next generation)."""
        if timeout_s is None:
            timeout_s = env.timeout_s()
        self.actor = actor
        actor.default_timeout_s = timeout_s  # one deadline for collectives and point-to-point alike
        self.tracer = Tracer(actor.rank, trace_dir or env.TRACE.get())
        self.store = store
        self.generation = generation
        self.rendezvous = rendezvous
        self.timeout_s = timeout_s
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.shm_enabled = True  # every rank must agree (the algorithm is in each call's fingerprint)
        self.watchdog = Watchdog(env.mismatch_check_s())  # deadlines and mismatch checks of the calls in flight
        self.inline_wait_s = env.inline_wait_s()  # Call.sendrecv's wait off the event loop (0: never)
        self.spin_s = env.spin_s()  # of that wait, the part spent re-reading the socket before poll()
        count_runtime(+1)  # Call.sendrecv waits off the loop only while this is the process's one runtime
        self.in_flight = 0  # collective calls running now, on every group (ProcessGroup.run)
        self.call_turn_s = turns.call_turn_s(local_world_size)  # ProcessGroup.run's loop turns
        self.groups: dict[int, ProcessGroup] = {}
        self._nodes = list(nodes) if nodes is not None else ["local"] * actor.world_size
        self.world = self._add_group(list(range(actor.world_size)))
        actor.add_lost_listener(self._on_peer_lost)
        actor.add_abort_listener(self._on_abort)
        actor.stray_listener = self._on_stray
        actor.register("ringweave.status", self.status, any_thread=True)
        actor.register("ringweave.call_of", self._call_of)
        self._closed = False

    @property
    def rank(self) -> int:
        return self.actor.rank

    @property
    def world_size(self) -> int:
        return self.actor.world_size

    @property
    def nodes(self) -> list[str]:
        """The node id of every world rank (``runtime.init.node_id``, published with the addresses
        at init): the source of every group's ``topology``. Do not change the list in place."""
        return self._nodes

    @nodes.setter
    def nodes(self, node_ids) -> None:
        """Replaces the node ids (tests pretend to span hosts this way); every group works its
        topology out again. Every rank must be given the same ids."""
        node_ids = list(node_ids)
        if len(node_ids) != self.world_size:
            raise ValueError(f"nodes: {len(node_ids)} node ids for a world of {self.world_size} ranks")
        self._nodes = node_ids
        for group in self.groups.values():
            group._topology = None

    def _add_group(self, ranks: list[int]) -> ProcessGroup:
        gid = len(self.groups)
        group = ProcessGroup(self, ranks, gid)
        self.groups[gid] = group
        return group

    def new_group(self, ranks) -> ProcessGroup:
        """A sub-group of the given global ranks, in that order. Every rank of the
        world must call it, in the same order (non-members get ``rank == -1``).

        Raises:
            TypeError: ``ranks`` is not a sequence of ints (a float, a bool, a str among them).
            ValueError: no rank, a rank out of range, or one given twice.
        """
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"new_group: ranks must be a sequence of int ranks, got {type(ranks).__name__} {ranks!r}")
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, numbers.Integral)]
        if bad:
            raise TypeError(f"new_group: ranks must be ints, got {bad[0]!r} ({type(bad[0]).__name__}) in {ranks!r}")
        ranks = [int(r) for r in ranks]
        if not ranks:
            raise ValueError("new_group: ranks is empty; a group needs at least one rank")
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.world_size for r in ranks):
            raise ValueError(f"new_group: ranks {ranks} must be distinct and within 0..{self.world_size - 1}")
        return self._add_group(ranks)

    def _on_peer_lost(self, peer: int, exc: BaseException) -> None:
        for group in self.groups.values():
            if peer in group.ranks and group.is_member:
                # an abort names the rank and its exception already; it stays that type, for callers to catch
                error = exc if isinstance(exc, PeerAbortedError) else PeerLostError(
                    f"rank {peer} was lost (group {group.gid}): {exc}", peer)
                group.abort(error, tell_peers=False)

    def _on_stray(self, peer: int, header: dict) -> None:
        group = self.groups.get(header["t"][0])
        if group is not None:
            group.on_stray(peer, header)

    def _on_abort(self, header: dict) -> None:
        group = self.groups.get(header["g"])
        if group is not None:
            kind = header["x"]
            if kind == "timeout":  # another member's call timed out: this rank's copy of the call fails too
                group.abort(CollectiveTimeoutError(f"group {group.gid} failed: {header['m']}"), tell_peers=False)
                return
            cls = {"mismatch": CollectiveMismatchError, "lost": PeerLostError}.get(kind, CollectiveError)
            group.abort(cls(header["m"]), tell_peers=False)

    def tell_abort(self, group: ProcessGroup, exc: BaseException) -> None:
        kind = ("mismatch" if isinstance(exc, CollectiveMismatchError) else
                "lost" if isinstance(exc, PeerLostError) else
                "timeout" if isinstance(exc, CollectiveTimeoutError) else "error")
        for r in group.ranks:
            if r != self.rank and r not in self.actor.lost_peers():
                self.actor._spawn(self._send_abort(r, group.gid, str(exc), kind), f"abort g{group.gid}")

    async def _send_abort(self, dst: int, gid: int, message: str, kind: str) -> None:
        try:  # a peer that stopped reading is not waited for past the runtime's timeout
            async with asyncio.timeout(self.timeout_s):
                await self.actor.send_frame(dst, {"k": "a", "g": gid, "m": message, "x": kind})
        except (PeerLostError, ClosedError, OSError, TimeoutError):
            pass

    def _call_of(self, gid: int, seq: int) -> str | None:
        """``ringweave.call_of``: this rank's call #seq in group gid (ProcessGroup.check_stalled)."""
        group = self.groups.get(gid)
        return group.call_of(seq) if group is not None and group.is_member else None

    def status(self) -> dict:
        """What this rank is doing now: its calls in flight and how long each has waited.

        Runs on the listener's thread when a tool asks (tools.status), while this loop goes on:
        it only reads, and takes each dict it walks with one ``list()`` (atomic under the GIL)."""
        now = time.monotonic()
        calls = []
        groups = list(self.groups.values())
        for g in groups:
            for rec in list(g.calls.values()):
                calls.append({"group": g.gid, "seq": rec.seq, "op": rec.fingerprint,
                              "waited_s": round(now - rec.started, 3),
                              "waiting_on": sorted(g.ranks[r] for r in rec.waiting_on)})
        return {"rank": self.rank, "calls": calls,
                "seqs": [[g.gid, g._seq] for g in groups],  # calls taken per group
                "lost": sorted(self.actor.lost_peers()),
                "failed_groups": {g.gid: repr(g.error) for g in groups if g.error}}

    async def close(self, reason: BaseException | None = None) -> None:
        """Closes the actor (saying goodbye to every peer; with ``reason``, the exception this
        rank leaves because of, which each peer raises as PeerAbortedError), the store, the
        shared-memory mappings, then shuts down the rendezvous it was given (the store's client
        and, on the rank that hosts it, the server once the others have left). Idempotent."""
        if self._closed:
            return
        self._closed = True
        count_runtime(-1)
        self.watchdog.close()
        try:
            self.tracer.write()
        except (OSError, RingweaveError) as exc:  # PrivateDirError: the directory is no longer ours alone
            log.warning("rank %d: could not write its trace: %s", self.rank, exc)
        if "runtime.sharedmem.domains" in sys.modules:  # release this runtime's shared-memory mappings
            sys.modules["runtime.sharedmem.domains"].close_runtime(self)
        try:
            await self.actor.close(reason)
            if self.store is not None:
                await self.store.close()
        finally:
            if self.rendezvous is not None:  # the store's client and server go, whatever the actor's close did
                await self.rendezvous.shutdown()
