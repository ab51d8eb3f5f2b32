"""Posting and waiting over shared memory: the words of each member's control header, how a rank
says it reached a phase of a call, how another waits for that, what wakes a wait and what ends it.

The words, each in its owner's header: the **sequence word** (written by the owner only:
``(call seq << 3 | phase) mod 2**32``, compared in wrapping order, :func:`reached`), the
**doorbell** (a futex word the owner sleeps on, rung by the peers), the **want** (what the owner
is asleep on: every other member at a value, or one member at it), its pid and two fingerprint
slots (the call it is in).

A post (:meth:`Phases.post`) stores the sequence word, fences (:func:`fence`) and rings each peer
whose published want it has just made true, and only those: nobody asleep, no system call.

A wait (:meth:`Phases.wait_all`) reads the words; spins ``RINGWEAVE_SHM_SPIN`` times with
``sched_yield``; then publishes its want, fences, reads again and sleeps on its own doorbell
(``FUTEX_WAIT``, GIL released) for at most :data:`SLICE_S`, blocking its thread and event loop,
and never past the loop's next turn (``runtime.turns.left``: the turn comes first).
What wakes it: a ring, or the slice's end. What ends it with an error, checked between slices: the
group's error, a peer whose process is gone (PeerLostError), a peer in another call
(CollectiveMismatchError), and the call's deadline (the loop gets a turn after each slice that
ended without a ring: the cancellation lands within a slice). A wait whose peers are tasks of this
process never blocks: it yields to the loop between reads. x86-64 memory order (TSO) is assumed.

Not here: the segments (runtime/sharedmem/segments.py), the domain that maps them and orders its
calls (runtime/sharedmem/domains.py), the compiled twin of this protocol (collectives/slots/fastpath.py).
In depth: docs/design.md, "The shared-memory protocol"; why so: bench/results/shm.md#the-waits-choices.
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
import zlib

from runtime import env, turns
from runtime.errors import CollectiveMismatchError, PeerLostError

# The control header: where each word lives in its owner's control segment.
OFF_SEQ = 0  # u32 sequence word, written by the owner only
OFF_PID = 4  # u32 owner pid
OFF_FP = 64  # two fingerprint slots of FP_NBYTES: u32 seq, u32 crc32, u32 length, bytes
OFF_BELL = 2048  # u32 doorbell (the futex word the owner sleeps on), rung by the peers
OFF_WANT = 2056  # u64 what the owner waits for: kind << 62 | peer << 32 | target (0: nothing)
WANT_ALL, WANT_ONE = 1, 2  # every other member has reached target / member `peer` has
SEEN_MASK = 0x3FFF  # want bits 48..61: the doorbell value the waiter saw before sleeping
FP_NBYTES = 512
FP_MAX = FP_NBYTES - 12

PHASE_BITS = 3
EXIT = 7  # the last phase of every call: "I have finished reading the peers' slots"
SLICE_S = 0.002  # one futex sleep: the event loop's other tasks get a turn at least this often (runtime/turns.py)
                 # while a wait blocks its thread; also the bound on noticing a lost peer / deadline
MIN_SLICE_S = 0.0002  # a sleep shorter than this waits for the loop's turn first (runtime/turns.py left)


# -- futex and fence ----------------------------------------------------------------------------

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word is in a MAP_SHARED file
_libc = ctypes.CDLL(None, use_errno=True)  # CDLL: calls release the GIL
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_uint32]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_fence_lock = ctypes.c_int(0)
_libc.pthread_spin_init(ctypes.byref(_fence_lock), 0)
_fence_fn = _libc.pthread_spin_trylock
_fence_arg = ctypes.byref(_fence_lock)


def fence() -> None:
    """A full memory barrier: glibc's pthread_spin_trylock is one ``lock cmpxchg`` on x86-64,
    executed whether or not the (never released) lock is free (bench/results/runtime.md#the-memory-fence)."""
    _fence_fn(_fence_arg)


def futex_wait(address: int, expected: int, timeout_s: float) -> bool:
    """Sleeps while the u32 at ``address`` equals ``expected``, at most ``timeout_s``.

    Returns False on timeout, True otherwise (woken, value differed, or a signal). Blocks the
    calling thread with the GIL released.
    """
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    rc = _syscall(_SYS_FUTEX, address, _FUTEX_WAIT, expected, ctypes.byref(ts), None, 0)
    return not (rc == -1 and ctypes.get_errno() == errno.ETIMEDOUT)


def futex_wake(address: int, count: int = 0x7FFFFFFF) -> int:
    """Wakes up to ``count`` waiters on the u32 at ``address``; returns how many woke."""
    return _syscall(_SYS_FUTEX, address, _FUTEX_WAKE, count, None, None, 0)


def reached(word: int, target: int) -> bool:
    """``word`` is at or past ``target`` in wrapping 32-bit sequence order."""
    return ((word - target) & 0xFFFFFFFF) < 0x80000000


def encode(seq: int, phase: int) -> int:
    """The sequence-word value of ``phase`` (1..7) of call ``seq``."""
    return ((seq << PHASE_BITS) | phase) & 0xFFFFFFFF


def fingerprint_text(fingerprint: str) -> bytes:
    """What a fingerprint slot holds after its header: the text's length (u32), then the text
    (cut at :data:`FP_MAX` bytes)."""
    fp = fingerprint.encode()[:FP_MAX]
    return struct.pack("<I", len(fp)) + fp


# -- this rank's side of the protocol -----------------------------------------------------------


class Phases:
    """This rank's view of the words of every member of a domain: posting its own, waiting on
    the others', comparing fingerprints. Members are indexed by domain rank; ``members[i]`` is
    their group rank. :meth:`watch` is given the mapped control segments (by domain rank) before
    any post or wait; ``parity`` says which fingerprint slot the current call uses.

    The domain (runtime/sharedmem/domains.py) is one; compiled code that runs the same protocol
    reads :attr:`control_addresses` and :attr:`fp_header`.
    """

    def __init__(self, group, members: list[int]):
        self.group = group
        self.members = list(members)  # domain rank -> group rank
        self.size = len(self.members)
        self.rank = self.members.index(group.rank)
        self.ctl: list = [None] * self.size  # control segments by domain rank
        self.parity = 0  # which fingerprint / small slot the current call uses
        self._words: list[ctypes.c_uint32] = []  # sequence words by domain rank
        self._bells: list[ctypes.c_uint32] = []  # doorbells by domain rank
        self._wants: list[ctypes.c_uint64] = []  # published wait targets by domain rank
        self._pids: list[int] = []
        self._cooperative = False  # a peer is a task of this very process: never block the thread
        self._others: list[int] = []  # domain ranks but ours
        self._fp_headers: list = []  # by domain rank, slot: the u64 (seq | crc32 << 32) of a fingerprint
        self._fp_header = 0  # ours, for the current call
        self._fp_text: list[str | None] = [None, None]  # the fingerprint text in each of our slots
        self._fp_crc: dict[str, int] = {}  # fingerprint -> crc32 of its (cut) text
        self.statistics_ = {"posts": 0, "waits": 0, "spins": 0, "sleeps": 0, "rings": 0}

    def watch(self, ctl: list) -> None:
        """Takes the words of the control segments ``ctl`` (every member's, mapped, by domain
        rank; each owner has written its pid at :data:`OFF_PID`)."""
        self.ctl = ctl
        self._words = [ctypes.c_uint32.from_buffer(s.mm, OFF_SEQ) for s in ctl]
        self._bells = [ctypes.c_uint32.from_buffer(s.mm, OFF_BELL) for s in ctl]
        self._wants = [ctypes.c_uint64.from_buffer(s.mm, OFF_WANT) for s in ctl]
        self._pids = [struct.unpack_from("<I", s.mm, OFF_PID)[0] for s in ctl]
        self._cooperative = any(pid == os.getpid() for p, pid in enumerate(self._pids) if p != self.rank)
        self._others = [p for p in range(self.size) if p != self.rank]
        self._fp_headers = [[ctypes.c_uint64.from_buffer(s.mm, OFF_FP + k * FP_NBYTES) for k in (0, 1)]
                            for s in ctl]

    def unwatch(self) -> None:
        """Lets go of the words (before the segments are unmapped)."""
        self._words, self._bells, self._wants, self._fp_headers = [], [], [], []

    @property
    def cooperative(self) -> bool:
        """True when a peer is a task of this very process (its waits never block the thread)."""
        return self._cooperative

    def publish_fingerprint(self, call) -> None:
        """Writes ``call``'s sequence number and fingerprint into this member's slot ``parity``,
        before its first post of the call (the slot was last used two calls back)."""
        parity = self.parity
        fingerprint = call.fingerprint
        crc = self.fingerprint_crc(fingerprint)
        if self._fp_text[parity] != fingerprint:  # a loop's calls repeat: the text is there already
            self.write_fingerprint_text(parity, fingerprint)
        # the header (seq, crc32) in ONE aligned 8-byte store, after the text: struct.pack_into
        # zeroes then writes byte by byte, and a peer could read this call's number with stale text
        self._fp_header = (call.seq & 0xFFFFFFFF) | (crc << 32)
        self._fp_headers[self.rank][parity].value = self._fp_header

    def fingerprint_crc(self, fingerprint: str) -> int:
        """The CRC-32 of ``fingerprint``'s text as a slot holds it (cut at :data:`FP_MAX` bytes)."""
        crc = self._fp_crc.get(fingerprint)
        if crc is None:
            if len(self._fp_crc) > 256:
                self._fp_crc.clear()
            crc = self._fp_crc[fingerprint] = zlib.crc32(fingerprint.encode()[:FP_MAX])
        return crc

    def write_fingerprint_text(self, parity: int, fingerprint: str) -> None:
        """Writes ``fingerprint``'s text into this member's slot ``parity`` (its header, written
        after, says which call the text is of). Only once every peer has left the call two back."""
        text = fingerprint_text(fingerprint)
        off = OFF_FP + parity * FP_NBYTES + 8
        self.ctl[self.rank].mm[off:off + len(text)] = text
        self._fp_text[parity] = fingerprint

    # -- posting
    def post(self, call, phase: int) -> None:
        """Announces that this member has reached ``phase`` of ``call``, and rings the doorbell
        of every peer asleep on a condition that is now true (and only those)."""
        self._words[self.rank].value = encode(call.seq, phase)
        self.statistics_["posts"] += 1
        fence()  # our word is visible before we read the peers' wants (the module docstring)
        wants, bells = self._wants, self._bells
        for q in self._others:
            want = wants[q].value
            if want and (want >> 48) & SEEN_MASK == bells[q].value & SEEN_MASK and self._satisfied(q, want):
                self._ring(q)

    def _satisfied(self, q: int, want: int) -> bool:
        """Is the condition peer ``q`` published (``want``) true now?"""
        target = want & 0xFFFFFFFF
        words = self._words
        if want >> 62 == WANT_ONE:
            return reached(words[(want >> 32) & 0xFFFF].value, target)
        return all(reached(words[p].value, target) for p in range(self.size) if p != q)

    def _ring(self, q: int) -> None:
        bell = self._bells[q]
        bell.value = (bell.value + 1) & 0xFFFFFFFF
        futex_wake(self.ctl[q].address + OFF_BELL)
        self.statistics_["rings"] += 1

    # -- looking without waiting
    def arrived(self, call, phase: int) -> bool:
        """Whether every other member has posted ``phase`` of ``call`` (no waiting); if so,
        their fingerprints are compared with ours as :meth:`wait_all` does.

        Raises:
            CollectiveMismatchError: a peer that arrived is in a different call.
        """
        if not self._reached(self._others, encode(call.seq, phase)):
            return False
        self._compare_fingerprints(call, self._others)
        return True

    def reached_all(self, seq: int, phase: int) -> bool:
        """Whether every other member has posted ``phase`` of call ``seq`` (no waiting)."""
        return self._reached(self._others, encode(seq, phase))

    def _reached(self, watched: list[int], target: int) -> bool:
        words = self._words
        for p in watched:  # reached(), written out: this runs several times per call
            if (words[p].value - target) & 0xFFFFFFFF >= 0x80000000:
                return False
        return True

    def _compare_fingerprints(self, call, watched: list[int]) -> None:
        # A peer that posted this call keeps its fingerprint in this parity's slot until we have
        # left the call (the slot is rewritten two calls later, which a peer reaches only after
        # our next call took its phase 1): one 8-byte load compares it.
        headers, mine, parity = self._fp_headers, self._fp_header, self.parity
        for p in watched:
            if headers[p][parity].value != mine:
                self._check_fingerprint(call, p)

    # -- waiting
    async def wait_all(self, call, phase: int, *, peers=None, seq: int | None = None,
                       check_fp: bool = True) -> None:
        """Waits until every other member (``peers=None``) or the one member ``peers=[p]`` has
        posted ``phase`` of call ``seq`` (default this call). With ``check_fp``, the fingerprints
        of the peers waited on are compared with ours.

        Raises:
            the group's error (PeerLostError, a mismatch from elsewhere) as soon as it is set;
            PeerLostError: a peer's process is gone;
            CollectiveMismatchError: a peer is in a different call;
            asyncio.CancelledError: the call's deadline (group.run turns it into a timeout).
        """
        target = encode(call.seq if seq is None else seq, phase)
        watched = self._others if peers is None else peers
        if not self._reached(watched, target):  # not there yet: sleep
            if peers is None:
                want = (WANT_ALL << 62) | target
            else:
                (one,) = peers
                want = (WANT_ONE << 62) | (one << 32) | target
            await self._sleep_until(call, watched, target, want, check_fp)
        if check_fp:
            self._compare_fingerprints(call, watched)

    async def _sleep_until(self, call, watched: list[int], target: int, want: int, check_fp: bool) -> None:
        def done() -> bool:
            return self._reached(watched, target)

        self.statistics_["waits"] += 1
        if self._cooperative:  # the peers are tasks of this event loop: yield, never block
            idle = 0
            while not done():
                self._check(call, watched, check_fp)
                idle += 1
                await asyncio.sleep(0 if idle < 200 else 0.0005)
            return
        for _ in range(env.SHM_SPIN.get()):  # a short spin that gives the core away (bench/results/shm.md#waiting-and-waking)
            os.sched_yield()
            if done():
                self.statistics_["spins"] += 1
                return
        me = self._wants[self.rank]
        bell = self._bells[self.rank]
        address = self.ctl[self.rank].address + OFF_BELL
        try:
            while True:
                rung = bell.value
                me.value = want | ((rung & SEEN_MASK) << 48)  # publish, then look once more
                fence()
                if done():
                    return
                self._check(call, watched, check_fp)
                # a slice, cut short where the loop's turn would otherwise come late (the copies
                # before this wait may have used part of it)
                slice_s = min(SLICE_S, turns.left())
                if slice_s < MIN_SLICE_S:
                    await asyncio.sleep(0)  # the loop's turn first; then publish and look again
                    continue
                self.statistics_["sleeps"] += 1
                if not futex_wait(address, rung, slice_s):  # a slice passed without a ring
                    await asyncio.sleep(0)  # let the loop see a lost peer, a cancellation, a deadline
        finally:
            me.value = 0

    # -- what ends a wait early
    @property
    def fp_header(self) -> int:
        """This member's fingerprint header of the current call: ``seq | crc32 << 32`` (see
        :meth:`publish_fingerprint`)."""
        return self._fp_header

    @property
    def control_addresses(self) -> list[int]:
        """The address of every member's control segment in this process, by domain rank (for
        compiled code that runs the protocol on the words at the offsets above)."""
        return [seg.address for seg in self.ctl]

    def check_peers(self, call) -> None:
        """What a wait checks between slices (``_check``): the group's error, every peer's
        process, their fingerprints so far. Raises as :meth:`wait_all`."""
        self._check(call, self._others, True)

    def check_fingerprint(self, call, p: int) -> None:
        """Raises CollectiveMismatchError when member ``p`` published another call than ours."""
        self._check_fingerprint(call, p)

    def _check(self, call, watched: list[int], check_fp: bool) -> None:
        """Between sleeps: the group's error, the peers' processes, their fingerprints so far."""
        for p in watched:
            self._check_alive(call, p)
            if check_fp:
                self._check_fingerprint(call, p, early=True)

    def _check_alive(self, call, p: int) -> None:
        group = self.group
        if group.error is not None:
            raise group.error
        pid = self._pids[p]
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                grank = group.ranks[self.members[p]]
                exc = PeerLostError(f"rank {grank} (pid {pid}) is gone: its process no longer exists "
                                    f"(group {group.gid}, shared memory)", grank)
                group.abort(exc, tell_peers=False)
                raise exc from None
            except PermissionError:
                pass

    def _check_fingerprint(self, call, p: int, early: bool = False) -> None:
        """Raises CollectiveMismatchError if peer ``p`` published a different call (or, unless
        ``early``, has not published this call)."""
        header = self._fp_headers[p][self.parity].value  # one 8-byte load (see publish_fingerprint)
        if header == self._fp_header:
            return
        if header & 0xFFFFFFFF != call.seq & 0xFFFFFFFF:
            if early:
                return  # not there yet (or two calls ahead: caught when it posts)
            theirs = "a call with another sequence number"
        else:
            off = OFF_FP + self.parity * FP_NBYTES + 8
            length = struct.unpack_from("<I", self.ctl[p].mm, off)[0]
            theirs = bytes(self.ctl[p].mm[off + 4:off + 4 + min(length, FP_MAX)]).decode(errors="replace")
        group = self.group
        exc = CollectiveMismatchError(
            f"collective mismatch in group {group.gid} at call #{call.seq}: rank {group.ranks[group.rank]} "
            f"called {call.fingerprint!r} but rank {group.ranks[self.members[p]]} called {theirs!r}")
        group.abort(exc)
        raise exc
