"""A shared-memory domain: the members of one group that share a host, the segments each of them
owns and every other maps, how they agree on those segments, the order of their calls, and when
the segments go. Bytes only: the arrays and algorithms over them are collectives/slots/ and
collectives/algorithms/shared_memory/.

Each member owns a control segment (a 4 KiB header for the words of runtime/sharedmem/waits.py,
then two small slots of :data:`SMALL_NBYTES`) and, once a call needs one, a data slot of a power
of two bytes, grown by re-creating it. A segment's life, run by every member at the same call:

1. the owner creates it under a fresh name (runtime/sharedmem/segments.py);
2. the members swap their names' tokens over the call's authenticated TCP messages (an all-to-all)
   and each maps every other member's segment (the tokens derive from a seed each member drew and
   sent the others at set-up: segments.member_tokens);
3. a second all-to-all says everyone has mapped everything, and each owner unlinks its name: from
   then on the memory lives exactly as long as the mappings;
4. a later growth replaces the data slot (after the peers finished reading the old one), and
   :meth:`Domain.close` (a failed call, the runtime's close) unmaps all.

Between 1 and 3 a name can outlive a crash; it is unlinked by its owner when the call fails, by
the survivors when a peer is lost (:meth:`Domain.forget_peer`: the names of its seed only), by the launcher after the attempt
and by an ``atexit`` hook. A name gone before a member mapped it means its owner left the call: the
group's error, or a CollectiveError naming it after :data:`LEFT_WAIT_S`.

Calls hold a domain one at a time, in the order they began (see :class:`Domain`); :func:`domain`
makes a group's domains on first use, :func:`close_runtime` ends them.

Not here: creating and mapping a file (segments.py), posting and waiting (waits.py), process groups.
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import os
import secrets
import struct
import time
import weakref

from runtime import env
from runtime.errors import CollectiveError
from runtime.sharedmem.segments import Segment, job_prefix, member_tokens, remove_member_segments, segment_path
from runtime.sharedmem.waits import EXIT, OFF_PID, Phases

HEADER_NBYTES = 4096  # the control header: the words of runtime/sharedmem/waits.py (OFF_*)
SMALL_NBYTES = 64 * 1024  # one small slot; the control file holds two after the header
CONTROL_NBYTES = HEADER_NBYTES + 2 * SMALL_NBYTES
MIN_DATA_LOG2 = 16  # smallest data slot: 64 KiB
SEED_NBYTES = 32  # a member's secret seed, whence its names' tokens (segments.member_tokens)
LEFT_WAIT_S = 2.0  # Domain._attach: a member whose name is gone tells its error within its answer budget (1 s)


# -- a domain: the members of one group on one machine ----------------------------------------


class Domain(Phases):
    """This rank's view of the shared memory of one domain: its own segments and its peers'.

    Members are indexed by **domain rank** ``0..size-1``; ``members[i]`` is their group rank.
    Calls run one at a time (``begin`` / ``try_begin`` take the domain, ``end`` releases it);
    every call goes:

        [``setup(call)``] -> ``enter(call)`` -> [``claim_data(call, nbytes)``] ->
        (``post`` | ``wait_all``)* -> ``post(EXIT)``

    Posting and waiting are :class:`~runtime.sharedmem.waits.Phases`'. Used by collectives/slots
    and the shared-memory algorithms only; the contract of each method is written with it.
    """

    def __init__(self, group, members: list[int], name: str):
        super().__init__(group, members)  # group, members, size, rank, ctl, parity, the words
        self.name = name  # <gid>d<index>, part of the file names
        self._busy = False  # a call holds the domain (calls run one at a time, in the order they began)
        self._lock_waiters: collections.deque[asyncio.Future] = collections.deque()
        self.ready = False
        self.data: list[Segment | None] = [None] * self.size  # data segments by domain rank
        self.data_log2 = 0  # capacity of the data slots is 1 << data_log2 (0: none yet)
        self.last_data_seq: int | None = None  # the last call that wrote the data slots
        self.ncalls = 0  # shared-memory calls started on this domain (the same on every member)
        self._recent: list[int] = []  # sequence numbers of the last two calls
        self.views: dict = {}  # the layer above keeps its array views of the slots here
        self.compiled = None  # and the state of its compiled path (collectives/slots/fastpath.py); None: not made
        self._prefix = ""  # ringweave-<job>-, once set up
        self._tokens: list[dict[str, str]] = [{} for _ in self.members]  # by domain rank: what -> token
        self._seeds: list[bytes | None] = [None] * len(self.members)  # by domain rank: whence its tokens
        self._closed = False
        self.statistics_["grows"] = 0

    # -- names
    def _path(self, domain_rank: int, what: str, token: str | None = None) -> str:
        """The file of member ``domain_rank``'s segment ``what`` ("ctl", "v<k>"), under its token."""
        grank = self.group.ranks[self.members[domain_rank]]
        token = token if token is not None else self._tokens[domain_rank][what]
        return segment_path(self._prefix, token, self.name, grank, what)

    async def _create_own(self, call, what: str, nbytes: int) -> "Segment":
        """Creates this member's segment ``what`` under a fresh name and learns every other
        member's name for theirs (the all-to-all of their tokens)."""
        own, token = Segment.create_fresh(lambda t: self._path(self.rank, what, t), nbytes,
                                          member_tokens(self._seeds[self.rank], what))
        self._tokens[self.rank][what] = token
        try:
            tokens = await self._all_to_all(call, token.encode())
        except BaseException:
            own.unlink()
            own.close()
            raise
        for p, theirs in enumerate(tokens):
            if p != self.rank:
                self._tokens[p][what] = theirs.decode("ascii", "replace")
        return own

    # -- set-up (first call) and growth, both over the call's TCP messages
    async def setup(self, call) -> None:
        """Creates this member's control segment and maps everyone's. Runs inside the first call
        on the domain; all members run it at the same call (they see the same sequence of calls).

        Raises:
            PeerLostError, CollectiveMismatchError, CollectiveTimeoutError: from the messages.
            OSError: /dev/shm could not be written.
        """
        job = env.JOB.given() or getattr(self.group.runtime.actor, "_job", None) or "ringweave"
        self._prefix = job_prefix(job)
        seed = self._seeds[self.rank] = secrets.token_bytes(SEED_NBYTES)
        for p, theirs in enumerate(await self._all_to_all(call, seed)):  # before anyone makes a name
            self._seeds[p] = theirs
        own = await self._create_own(call, "ctl", CONTROL_NBYTES)  # every control segment exists
        self.ctl[self.rank] = own
        struct.pack_into("<I", own.mm, OFF_PID, os.getpid())
        for p in range(self.size):
            if p != self.rank:
                self.ctl[p] = await self._attach(call, p, "ctl", CONTROL_NBYTES)
        self.watch(self.ctl)
        await self._all_to_all(call)  # everyone has mapped everyone's: the names can go
        own.unlink()
        self.ready = True
        _track(self)

    async def ensure_capacity(self, call, nbytes: int) -> None:
        """Makes every member's data slot hold at least ``nbytes``; every member calls this with the
        same ``nbytes`` in the same call. Growing waits (bounded) for the peers to finish reading
        the old slot, then re-creates it and exchanges TCP messages; otherwise returns at once."""
        nbytes = max(1, nbytes)  # a zero-length call still gets (empty views of) a slot
        if nbytes <= (1 << self.data_log2 if self.data_log2 else 0):
            return
        log2 = max(MIN_DATA_LOG2, (nbytes - 1).bit_length())
        if self.last_data_seq is not None:  # the peers are done reading the old slot
            await self.wait_all(call, EXIT, seq=self.last_data_seq, check_fp=False)
        old = self.data[self.rank]
        if old is not None:
            old.close()
        own = await self._create_own(call, f"v{log2}", 1 << log2)  # every new slot exists
        self.data[self.rank] = own
        for p in range(self.size):
            if p != self.rank:
                if self.data[p] is not None:
                    self.data[p].close()
                self.data[p] = await self._attach(call, p, f"v{log2}", 1 << log2)
        await self._all_to_all(call)  # every new slot is mapped by everyone
        own.unlink()
        self.data_log2 = log2
        self.statistics_["grows"] += 1

    async def _attach(self, call, p: int, what: str, nbytes: int) -> Segment:
        """Maps member ``p``'s segment ``what``. A name that is gone means ``p`` left the call
        after making it (a member unlinks its names when its call fails, e.g. times out, and then
        tells the group): raises the group's error once it is known (the member's own, e.g. its
        CollectiveTimeoutError), within :data:`LEFT_WAIT_S`, else a CollectiveError naming it.

        Raises:
            the group's error, CollectiveError: as above. RingweaveError: a segment too small.
        """
        path = self._path(p, what)
        try:
            return Segment.attach(path, nbytes)
        except FileNotFoundError:
            pass
        group = self.group
        deadline = time.monotonic() + LEFT_WAIT_S
        while group.error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if group.error is None:
            grank = group.ranks[self.members[p]]
            group.abort(CollectiveError(
                f"{call.fingerprint!r} (group {group.gid}, call #{call.seq}): rank {grank}'s shared-memory segment "
                f"{path} was gone when this rank came to map it, and no error came from rank {grank} within "
                f"{LEFT_WAIT_S:g} s (its call failed without saying so, or something else removed the file)"))
        raise group.error

    async def _all_to_all(self, call, mine: bytes = b"") -> list[bytes]:
        """``mine`` from every member to every other (over TCP; every member sends as many
        bytes): a barrier that also carries names. Returns what each member sent, by domain rank."""
        got = [bytearray(len(mine)) if p != self.rank else bytearray(mine) for p in range(self.size)]
        arrived = [call.irecv(self.members[p], got[p]) for p in range(self.size) if p != self.rank]
        for p in range(self.size):
            if p != self.rank:
                await call.send(self.members[p], mine)
        for fut in arrived:
            await fut
        return [bytes(g) for g in got]

    # -- buffers
    def data_buffer(self, domain_rank: int) -> mmap.mmap:
        """The data slot (capacity ``1 << data_log2`` bytes) of member ``domain_rank``."""
        return self.data[domain_rank].mm

    # -- a call's start and end (collectives/slots/common.DomainCall, or inline on a hot path)
    def try_begin(self, call) -> bool:
        """Starts ``call`` now if nothing has to wait: the domain is set up and free, and every
        peer has finished the call two back. Then this call holds the domain; else nothing
        changed and :meth:`begin` must be awaited. (The common case of a loop's small calls,
        without a coroutine.)"""
        if self._busy or self._lock_waiters or not self.ready:
            return False
        if len(self._recent) == 2 and not self.reached_all(self._recent[0], EXIT):
            return False
        self._busy = True
        self._enter(call)
        return True

    async def begin(self, call) -> None:
        """Takes the domain (after the calls that began before), sets it up on first use and
        enters ``call``. On failure the domain is closed and released."""
        await self._lock()
        try:
            if not self.ready:
                await self.setup(call)
            await self.enter(call)
        except BaseException:
            self.close()
            self._unlock()
            raise

    def end(self, call, ok: bool, post_exit: bool = True) -> None:
        """Ends ``call``: posts EXIT when it succeeded, else closes the domain (the group has
        failed anyway); releases the domain to the next call.

        ``post_exit=False`` is for calls in which every member waits for every other member's
        phase 1 and writes nothing but its small slot (the small all_reduce, the barrier): then
        a member's phase 1 of its next call says all that EXIT would. The call two after this one
        reuses this call's small slot and fingerprint slot, and a member only gets there after
        the call in between, which took every peer's phase 1 of it, posted after they finished
        this one; the next data call waits on an earlier data call's EXIT. Saves a post per call."""
        try:
            if ok:
                if post_exit:
                    self.post(call, EXIT)
            else:
                self.close()
        finally:
            self._unlock()

    async def _lock(self) -> None:
        if not self._busy and not self._lock_waiters:
            self._busy = True
            return
        fut = asyncio.get_running_loop().create_future()
        self._lock_waiters.append(fut)
        try:
            await fut  # _unlock hands the domain over: _busy stays True
        except BaseException:
            if fut.done() and not fut.cancelled():  # handed over as we were cancelled: pass it on
                self._unlock()
            else:
                try:
                    self._lock_waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def _unlock(self) -> None:
        while self._lock_waiters:
            fut = self._lock_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._busy = False

    # -- calls
    async def enter(self, call) -> None:
        """Starts a call: waits until every peer has finished the shared-memory call two back on
        this domain (it used the same fingerprint and small slots), then publishes this call's
        fingerprint (before any post of the call)."""
        if len(self._recent) == 2 and not self.reached_all(self._recent[0], EXIT):
            await self.wait_all(call, EXIT, seq=self._recent[0], check_fp=False)
        self._enter(call)

    def _enter(self, call) -> None:
        if len(self._recent) == 2:
            self._recent.pop(0)
        self._recent.append(call.seq)
        self.parity = self.ncalls % 2
        self.ncalls += 1
        self.publish_fingerprint(call)

    def small_buffer(self, domain_rank: int) -> memoryview:
        """The small slot (:data:`SMALL_NBYTES`) of ``domain_rank`` for the current call (two
        alternate, so a call may write its slot while a slow peer still reads the last one)."""
        start = HEADER_NBYTES + self.parity * SMALL_NBYTES
        return memoryview(self.ctl[domain_rank].mm)[start:start + SMALL_NBYTES]

    async def claim_data(self, call, nbytes: int) -> None:
        """Before this call writes its data slot: makes it hold ``nbytes`` (growing if needed, see
        :meth:`ensure_capacity`) and waits until every peer has finished reading what the last
        call that wrote it left there (that call's EXIT)."""
        await self.ensure_capacity(call, nbytes)
        if self.last_data_seq is not None and not self.reached_all(self.last_data_seq, EXIT):
            await self.wait_all(call, EXIT, seq=self.last_data_seq, check_fp=False)
        self.last_data_seq = call.seq

    # -- clean-up
    def forget_peer(self, group_rank: int) -> None:
        """A peer was lost: unlink whatever of its names may remain (it cannot any more), its
        files only: ``<prefix><token of its seed>-g<domain>-r<its rank>-...`` of this user. A peer
        lost before its seed arrived had made no name in this domain."""
        seed = self._seeds[self.members.index(group_rank)] if group_rank in self.members else None
        if not self._prefix or seed is None:
            return
        remove_member_segments(self._prefix, self.name, self.group.ranks[group_rank], seed)

    def close(self) -> None:
        """Unlinks this member's names and unmaps everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.unwatch()
        self.views.clear()
        self.compiled = None
        for seg in self.ctl + self.data:
            if seg is not None:
                seg.unlink()
                seg.close()
        self.ctl = [None] * self.size
        self.data = [None] * self.size
        self.ready = False

    def statistics(self) -> dict:
        return dict(self.statistics_, capacity=(1 << self.data_log2) if self.data_log2 else 0,
                    members=self.members, inline=getattr(self.compiled, "inline_calls", 0))


# -- the domains of each group ------------------------------------------------------------------

_domains: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> {name: Domain}
_listening: "weakref.WeakSet" = weakref.WeakSet()  # runtimes whose lost-peer listener is installed


def domain(group, members: list[int] | None, index: int = 0) -> Domain:
    """The domain of ``group`` made of group ranks ``members`` (this rank among them; None: the
    whole group), made on first use; ``index`` tells apart the domains of one group (one per node)."""
    fast = getattr(group, "_shm_domains", None)  # index -> Domain: one lookup per call
    d = fast.get(index) if fast is not None else None
    if d is not None and not d._closed:
        return d
    per_group = _domains.setdefault(group, {})
    name = f"{group.gid}d{index}"
    d = per_group.get(name)
    if d is None or d._closed:
        d = per_group[name] = Domain(group, list(range(group.size)) if members is None else members, name)
    if fast is None:
        fast = group._shm_domains = {}
    fast[index] = d
    return d


def existing(group, index: int = 0) -> Domain | None:
    """The domain :func:`domain` made for ``group`` under ``index``, if one was made (never makes one)."""
    fast = getattr(group, "_shm_domains", None)
    return fast.get(index) if fast is not None else None


def _track(d: Domain) -> None:
    rt = d.group.runtime
    if rt in _listening:
        return
    _listening.add(rt)
    rt_ref = weakref.ref(rt)

    def on_lost(peer: int, exc: BaseException) -> None:
        rt_now = rt_ref()
        if rt_now is None:
            return
        for group in list(rt_now.groups.values()):
            for dom in _domains.get(group, {}).values():
                if peer in group.ranks and group.ranks.index(peer) in dom.members:
                    dom.forget_peer(group.ranks.index(peer))

    rt.actor.add_lost_listener(on_lost)


def close_runtime(rt) -> None:
    """Unlinks and unmaps every segment of ``rt``'s groups (call when the runtime closes)."""
    for group in list(getattr(rt, "groups", {}).values()):
        for dom in _domains.pop(group, {}).values():
            dom.close()


def statistics(group) -> dict:
    """Per-domain counters of ``group``: posts, waits, spins that sufficed, futex sleeps, grows."""
    return {name: d.statistics() for name, d in _domains.get(group, {}).items()}
