"""Shared memory between the ranks of one machine: segments, their names and clean-up, and the
wait/wake primitive (a sequence word per rank, a futex doorbell per rank). Bytes only: the
arrays and the algorithms that use this are in collectives/algorithms/shared_memory/ (their
machinery: collectives/slots/).

Segments
    A **domain** is the set of members of one group that share a machine (the whole group when
    every rank is on one node, or one node's part of it for the hierarchical all_reduce). Each
    member of a domain owns two files under /dev/shm, named after the job, a random token of
    that very file, the group id, the domain and the member's global rank::

        ringweave-<job>-<token>-g<gid>d<domain>-r<rank>-ctl        control: 4 KiB header + 2 small slots
        ringweave-<job>-<token>-g<gid>d<domain>-r<rank>-v<k>       data: one slot, capacity 2**k bytes

    Names are unguessable, because /dev/shm is listed by everyone: another user who could tell
    the next name could create it first and make the job fail. Each file's token is 64 random
    bits drawn by its owner when it creates the file (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode
    0600); a name that is taken all the same is tried again with a fresh token
    (:meth:`Segment.create_fresh`). The other members learn the token from the all-to-all that
    follows, over the authenticated TCP connections of the call, and map only a file that
    belongs to this user. Seeing one name tells nothing of the next (a domain-wide token, seen
    on the first file, once let another user create the later data slots before their owners).

    Every member maps every other member's files (MAP_SHARED). A name is **unlinked as soon as
    every member has mapped it** (a TCP all-to-all of the call that made it says so): from then on
    the memory lives exactly as long as the mappings, so a job whose ranks are all SIGKILLed leaves
    nothing in /dev/shm. What can outlive a crash is the short window between creating a file and
    that all-to-all; for it, (1) a rank unlinks its own names when the call fails, (2) survivors
    unlink a lost peer's names (:meth:`Domain.forget_peer`, from the actor's lost-peer listener),
    (3) the launcher removes ``ringweave-<job>-*`` at the end of each attempt
    (:func:`remove_job_segments`), and (4) an ``atexit`` hook unlinks what this process still owns.
    Clean-up unlinks only files of this user.

    The data slot grows by re-creating: when a call needs more than the capacity, every member
    (they all see the same sizes, so they all decide the same) waits until the peers are done
    reading its old slot, creates ``v<k+1>``, and the all-to-all above runs again. Capacities are
    powers of two (at most 2x the largest message; at most ~40 growths ever).

Synchronisation
    Each control header holds, for its owner: a **sequence word** (written by the owner only, a
    plain aligned 32-bit store) holding ``(call seq << 3 | phase) mod 2**32``; a **doorbell**
    (a 32-bit futex word the owner sleeps on, rung by the peers); and a **want** word (64 bits,
    one store) saying what the owner is asleep on: "every other member has reached value t" or
    "member p has". "Peer p has reached phase f of call s" is ``seq_word[p] - (s << 3 | f)``
    read as a signed 32-bit difference being >= 0, which survives wrap-around while the ranks
    are less than 2**28 calls apart.

    Posting: store the sequence word; a full fence (``lock cmpxchg``, see :func:`fence`); for
    each peer, read its want word and, if that condition is now true (and its doorbell has not
    been rung since the peer looked at it), ring: bump the doorbell and ``FUTEX_WAKE`` it.
    Nobody asleep: no system call. Everyone asleep on "all arrived": the last poster rings each
    of them once, so a waiter wakes once per wait, not once per peer.

    Waiting (for all others, or for one member):

    1. read the sequence words; done if reached;
    2. spin briefly: ``os.sched_yield()`` and re-read, ``RINGWEAVE_SHM_SPIN`` times (on an
       oversubscribed machine the yield hands the core to a rank that has work);
    3. read the doorbell (``rung``), publish the want word (with ``rung``), fence, re-read the
       words; if still not reached, ``FUTEX_WAIT(doorbell, rung, SLICE_S)`` in the calling
       thread with the GIL released. The two fences make the classic store/load race safe: a
       poster and a waiter each store, fence, then load what the other stored, so at least one
       of them sees the other (the waiter sees the post, or the poster sees the want and rings);
       a ring between our doorbell read and the sleep makes ``FUTEX_WAIT`` return at once.
       After a slice that ends without a ring the wait yields to the event loop once (a lost
       peer's EOF, the call's asyncio deadline), and every round checks the group's error, the
       peers' processes (``kill(pid, 0)``) and their fingerprints.

    So a dead peer is seen within about one slice (its TCP connections close and its pid stops
    existing), and a wait ends at most one slice after its deadline.

    The thread blocks, so the event loop's other tasks wait for up to one slice (5 ms) at a time
    while a shared-memory collective waits for a slow peer (like a blocking MPI call): a thread
    hand-off per wait cost more than the whole small all_reduce here. Work that must overlap a
    collective should run in another thread (or use ``RINGWEAVE_SHM=0``). When a peer lives
    in this very process (``runtime.testing`` runs ranks as tasks of one event loop), blocking
    would block that peer, so those waits are cooperative: ``await asyncio.sleep(0)`` between
    reads, then 0.5 ms sleeps.

    Why this and not others (bench/results/shm.md#waiting-and-waking): sleeping on each peer's
    word in turn, every post a FUTEX_WAKE, cost more CPU than publishing wants and ringing only
    satisfied ones; spinning longer before sleeping changed the wall time by less than the noise
    and cost more CPU (``RINGWEAVE_SHM_SPIN``). An eventfd doorbell would need fd passing between
    processes; a TCP doorbell costs a frame and a loop iteration per post.

    A small all_reduce is CPU-bound, not wait-bound: a bare-bones version of the same protocol
    (mmap, words, sched_yield spin; no framework) is cheap beside ours, and spinning on a time
    budget changed nothing measurable (bench/results/shm.md#a-small-call-is-cpu-bound; the small
    calls post no EXIT, see :meth:`Domain.end`). The hot path therefore avoids work rather than
    waits: ``try_begin`` / ``arrived`` answer without a coroutine when nothing has to wait, and the
    sequence arithmetic is written out inline.

Fingerprints
    Shared-memory collectives send no TCP message, so a mismatch would not be seen by the
    transport. Each member writes its call's sequence number and fingerprint into one of two
    slots of its header (alternating per shared-memory call of the domain) before its first post
    of the call; a waiter compares the slot of every peer it waits on and raises
    :class:`CollectiveMismatchError` naming both calls. A slot is rewritten two calls later,
    only after every member has posted EXIT of the call that used it.

Memory order
    x86-64 (TSO) and glibc are assumed: data stores before the sequence store are seen before
    it, a reader that sees the sequence value sees the data, and :func:`fence` is a locked
    instruction. Other architectures would need fences around the data too.

Not here: NumPy, reductions and the algorithms (collectives/algorithms/shared_memory, collectives/slots), process groups (group.py).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import struct
import time
import weakref
import zlib

from runtime import env
from runtime.errors import CollectiveError, CollectiveMismatchError, PeerLostError, RingweaveError

log = logging.getLogger("ringweave.shm")

SHM_DIR = "/dev/shm"
PREFIX = "ringweave-"

HEADER_NBYTES = 4096
SMALL_NBYTES = 64 * 1024  # one small slot; the control file holds two after the header
CONTROL_NBYTES = HEADER_NBYTES + 2 * SMALL_NBYTES
MIN_DATA_LOG2 = 16  # smallest data slot: 64 KiB
TOKEN_NBYTES = 8  # random bytes in each file's name (16 hex digits)
CREATE_TRIES = 8  # names tried (each with a fresh token) before a taken name fails the call

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
LEFT_WAIT_S = 2.0  # Domain._attach: a member whose name is gone tells its error within its answer budget (1 s)
SLICE_S = 0.002  # one futex sleep: the event loop's other tasks get a turn at least this often (runtime/turns.py)
                 # while a wait blocks its thread; also the bound on noticing a lost peer / deadline


# -- names --------------------------------------------------------------------------------------


def job_prefix(job: str) -> str:
    """The file-name prefix of every segment of ``job`` (``/`` and other odd characters -> ``_``).

    >>> job_prefix("10.0.0.1:29500")
    'ringweave-10.0.0.1_29500-'
    """
    return PREFIX + re.sub(r"[^A-Za-z0-9._]", "_", job)[:80] + "-"


_OWNER = re.compile(r"-r(\d+)-[^-]+$")  # ...-r<global rank>-ctl | -v<k>
_REST = re.compile(r"[^-]+-g\d+d\d+-r\d+-[^-]+")  # after the job's prefix: <token>-g<gid>d<domain>-r<rank>-<what>


def _ours(path: str) -> bool:
    """Whether ``path`` is a file of this user (not a link): what clean-up may unlink."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not os.path.islink(path)


def job_segments(job: str, ranks=None, directory: str = SHM_DIR) -> list[str]:
    """Paths of the segments of ``job`` that still have a name and belong to this user; only
    those owned by the global ``ranks`` when given (a launcher cleans up after its own node's
    ranks only)."""
    prefix = job_prefix(job)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    keep = None if ranks is None else {int(r) for r in ranks}
    out = []
    for n in names:
        if not n.startswith(prefix) or not _REST.fullmatch(n, len(prefix)):  # not job "<job>-x"'s
            continue
        if keep is not None:
            m = _OWNER.search(n)
            if m is None or int(m.group(1)) not in keep:
                continue
        path = os.path.join(directory, n)
        if _ours(path):
            out.append(path)
    return sorted(out)


def remove_job_segments(job: str, ranks=None, directory: str = SHM_DIR) -> list[str]:
    """Unlinks the segments of ``job`` (of its global ``ranks`` only, when given); returns them.
    The launcher calls this after each attempt. Processes that still map a segment keep their
    memory; only the name goes.
    """
    removed = []
    for path in job_segments(job, ranks, directory):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)
    return removed


def shm_usable(directory: str = SHM_DIR) -> bool:
    """True when ``RINGWEAVE_SHM`` is not ``"0"`` and ``directory`` is a writable directory."""
    if not env.SHM.get():
        return False
    ok = _usable_dirs.get(directory)
    if ok is None:  # checked once per directory and process
        ok = _usable_dirs[directory] = os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)
    return ok


_usable_dirs: dict[str, bool] = {}


# -- futex --------------------------------------------------------------------------------------

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


# -- segments -----------------------------------------------------------------------------------


class Segment:
    """One /dev/shm file mapped MAP_SHARED read-write (``create`` or ``attach``)."""

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap, owner: bool):
        self.path = path
        self.nbytes = nbytes
        self.mm = mm
        self.owner = owner
        self.linked = owner  # the owner's name is still in /dev/shm
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mm)) if nbytes else 0
        if owner:
            _owned_paths.add(path)

    @classmethod
    def create(cls, path: str, nbytes: int) -> "Segment":
        """Creates ``path`` (it must not exist) of ``nbytes`` zero bytes and maps it.

        Raises:
            FileExistsError: a file (or link) of that name exists.
            OSError: /dev/shm is full or not writable.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        return cls(path, nbytes, mm, owner=True)

    @classmethod
    def create_fresh(cls, path_of, nbytes: int) -> tuple["Segment", str]:
        """Creates a segment at ``path_of(token)`` with a fresh random token; a name that is
        taken (someone else's file, a leftover) is tried again with another token, up to
        CREATE_TRIES times. Returns the segment and its token.

        Raises:
            RingweaveError: every name tried was taken (names them).
            OSError: /dev/shm is full or not writable.
        """
        taken = []
        for _ in range(CREATE_TRIES):
            token = _token()
            path = path_of(token)
            try:
                return cls.create(path, nbytes), token
            except FileExistsError:
                taken.append(path)
                log.warning("shared-memory name %s is taken (another user's file, or a leftover); "
                            "trying a fresh name", path)
        raise RingweaveError(f"{len(taken)} fresh shared-memory names were all taken, e.g. {taken[-1]}: "
                             f"is someone creating files in {SHM_DIR} as fast as they are named?")

    @classmethod
    def attach(cls, path: str, nbytes: int) -> "Segment":
        """Maps an existing segment of this user (pages pre-faulted, so the first collective is
        not slow).

        Raises:
            FileNotFoundError: no such segment. RingweaveError: it is smaller than ``nbytes``,
            or another user's.
        """
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise RingweaveError(f"shared-memory segment {path} belongs to uid {st.st_uid}, not to this "
                                     f"user: refusing to map it")
            size = st.st_size
            if size < nbytes:
                raise RingweaveError(f"shared-memory segment {path} has {size} bytes; expected {nbytes}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, nbytes, mm, owner=False)

    def unlink(self) -> None:
        """Removes the name (the memory stays while mapped). Idempotent."""
        if self.owner and self.linked:
            self.linked = False
            _owned_paths.discard(self.path)
            _unlink(self.path)

    def close(self) -> None:
        """Unmaps, unless arrays still view the memory (then the GC unmaps it later)."""
        try:
            self.mm.close()
        except BufferError:
            pass


def _token() -> str:
    """A fresh random token for a file name (TOKEN_NBYTES bytes, hex)."""
    return secrets.token_hex(TOKEN_NBYTES)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # e.g. EPERM: another user's file in the sticky /dev/shm
        log.warning("could not remove %s: %s", path, exc)


_owned_paths: set[str] = set()


@atexit.register
def _unlink_owned() -> None:
    for path in list(_owned_paths):
        _unlink(path)
    _owned_paths.clear()


# -- a domain: the members of one group on one machine ----------------------------------------


class Domain:
    """This rank's view of the shared memory of one domain: its own segments and its peers'.

    Members are indexed by **domain rank** ``0..size-1``; ``members[i]`` is their group rank.
    Calls run one at a time (:attr:`lock`); every call goes:

        [``setup(call)``] -> ``enter(call)`` -> [``claim_data(call, nbytes)``] ->
        (``post`` | ``wait_all``)* -> ``post(EXIT)``

    Used by collectives/slots and the shared-memory algorithms only; the contract of each method is written with it.
    """

    def __init__(self, group, members: list[int], name: str):
        self.group = group
        self.members = list(members)  # domain rank -> group rank
        self.size = len(self.members)
        self.rank = self.members.index(group.rank)
        self.name = name  # <gid>d<index>, part of the file names
        self._busy = False  # a call holds the domain (calls run one at a time, in the order they began)
        self._lock_waiters: collections.deque[asyncio.Future] = collections.deque()
        self.ready = False
        self.ctl: list[Segment | None] = [None] * self.size  # control segments by domain rank
        self.data: list[Segment | None] = [None] * self.size  # data segments by domain rank
        self.data_log2 = 0  # capacity of the data slots is 1 << data_log2 (0: none yet)
        self.last_data_seq: int | None = None  # the last call that wrote the data slots
        self.ncalls = 0  # shared-memory calls started on this domain (the same on every member)
        self.parity = 0  # which fingerprint / small slot the current call uses
        self._recent: list[int] = []  # sequence numbers of the last two calls
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
        self.views: dict = {}  # the layer above keeps its array views of the slots here
        self.compiled = None  # and the state of its compiled path (collectives/slots/fastpath.py); None: not made
        self._prefix = ""  # ringweave-<job>-, once set up
        self._tokens: list[dict[str, str]] = [{} for _ in self.members]  # by domain rank: what -> token
        self._closed = False
        self.statistics_ = {"posts": 0, "waits": 0, "spins": 0, "sleeps": 0, "rings": 0, "grows": 0}

    # -- names
    def _path(self, domain_rank: int, what: str, token: str | None = None) -> str:
        """The file of member ``domain_rank``'s segment ``what`` ("ctl", "v<k>"), under its token."""
        grank = self.group.ranks[self.members[domain_rank]]
        token = token if token is not None else self._tokens[domain_rank][what]
        return os.path.join(SHM_DIR, f"{self._prefix}{token}-g{self.name}-r{grank}-{what}")

    async def _create_own(self, call, what: str, nbytes: int) -> "Segment":
        """Creates this member's segment ``what`` under a fresh name and learns every other
        member's name for theirs (the all-to-all of their tokens)."""
        own, token = Segment.create_fresh(lambda t: self._path(self.rank, what, t), nbytes)
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
        own = await self._create_own(call, "ctl", CONTROL_NBYTES)  # every control segment exists
        self.ctl[self.rank] = own
        struct.pack_into("<I", own.mm, OFF_PID, os.getpid())
        for p in range(self.size):
            if p != self.rank:
                self.ctl[p] = await self._attach(call, p, "ctl", CONTROL_NBYTES)
        self._words = [ctypes.c_uint32.from_buffer(s.mm, OFF_SEQ) for s in self.ctl]
        self._bells = [ctypes.c_uint32.from_buffer(s.mm, OFF_BELL) for s in self.ctl]
        self._wants = [ctypes.c_uint64.from_buffer(s.mm, OFF_WANT) for s in self.ctl]
        self._pids = [struct.unpack_from("<I", s.mm, OFF_PID)[0] for s in self.ctl]
        self._cooperative = any(pid == os.getpid() for p, pid in enumerate(self._pids) if p != self.rank)
        self._others = [p for p in range(self.size) if p != self.rank]
        self._fp_headers = [[ctypes.c_uint64.from_buffer(s.mm, OFF_FP + k * FP_NBYTES) for k in (0, 1)]
                            for s in self.ctl]
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

    @property
    def cooperative(self) -> bool:
        """True when a peer is a task of this very process (its waits never block the thread)."""
        return self._cooperative

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
        self.parity = parity = self.ncalls % 2
        self.ncalls += 1
        fingerprint = call.fingerprint
        crc = self._fp_crc.get(fingerprint)
        if crc is None:
            if len(self._fp_crc) > 256:
                self._fp_crc.clear()
            crc = self._fp_crc[fingerprint] = zlib.crc32(fingerprint.encode()[:FP_MAX])
        if self._fp_text[parity] != fingerprint:  # a loop's calls repeat: the text is there already
            fp = fingerprint.encode()[:FP_MAX]
            struct.pack_into(f"<I{len(fp)}s", self.ctl[self.rank].mm, OFF_FP + parity * FP_NBYTES + 8, len(fp), fp)
            self._fp_text[parity] = fingerprint
        # the header (seq, crc32) in ONE aligned 8-byte store, after the text: struct.pack_into
        # zeroes then writes byte by byte, and a peer could read this call's number with stale text
        self._fp_header = (call.seq & 0xFFFFFFFF) | (crc << 32)
        self._fp_headers[self.rank][parity].value = self._fp_header

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

    def post(self, call, phase: int) -> None:
        """Announces that this member has reached ``phase`` of ``call``, and rings the doorbell
        of every peer asleep on a condition that is now true (and only those)."""
        self._words[self.rank].value = encode(call.seq, phase)
        self.statistics_["posts"] += 1
        fence()  # our word is visible before we read the peers' targets (see "Waking")
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
                self.statistics_["sleeps"] += 1
                if not futex_wait(address, rung, SLICE_S):  # a slice passed without a ring
                    await asyncio.sleep(0)  # let the loop see a lost peer, a cancellation, a deadline
        finally:
            me.value = 0

    @property
    def fp_header(self) -> int:
        """This member's fingerprint header of the current call: ``seq | crc32 << 32`` (see enter)."""
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
        header = self._fp_headers[p][self.parity].value  # one 8-byte load (see enter)
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

    # -- clean-up
    def forget_peer(self, group_rank: int) -> None:
        """A peer was lost: unlink whatever of its names may remain (it cannot any more), its
        files only: ``<prefix><any token>-g<domain>-r<its rank>-...`` of this user."""
        if not self._prefix:
            return
        grank = self.group.ranks[group_rank]
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return
        rest = re.compile(rf"[0-9a-f]+-g{self.name}-r{grank}-[^-]+")  # after the prefix: token, domain, rank
        for n in names:
            if n.startswith(self._prefix) and rest.fullmatch(n, len(self._prefix)):
                path = os.path.join(SHM_DIR, n)
                if _ours(path):
                    _unlink(path)

    def close(self) -> None:
        """Unlinks this member's names and unmaps everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._words, self._bells, self._wants, self._fp_headers = [], [], [], []
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
                    members=self.members)


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
