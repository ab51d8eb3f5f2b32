"""The small shared-memory all_reduce and the barrier as one compiled, GIL-free call each.

The protocol is runtime/sharedmem/waits.py's, step for step (sequence words, wants, doorbells, fingerprint
slots), so a member here and one on the Python path interoperate. The readable reference is that
path (``all_reduce_shm._small`` with ``Domain.post`` / ``wait_all``, and ``barrier_shm``'s); tests/shm
compare the two. One call of :func:`_all_reduce` (Numba ``nopython``, ``nogil``), for up to 64 KiB:

1. **publish**: copy ``x`` into my small slot of this call's parity; store my sequence word
   ``encode(seq, 1)`` with release order; a full fence; ring the doorbell of every peer whose
   published want is now met (and whose doorbell nobody rang since it looked): an atomic add and
   ``FUTEX_WAKE``;
2. **wait** for every other member's word to reach ``encode(seq, 1)`` (acquire loads): ``spin``
   rounds of a CPU pause (or of ``sched_yield`` when ranks share cores, so a waiting rank hands
   its core to one with work), then publish my want, fence, look again, and sleep on my doorbell
   (``FUTEX_WAIT``) until the slice's budget (``budget_ns``) is spent; then it **returns**
   ``WAITING`` and the caller gives its event loop a turn (the group's error, a lost peer, the
   deadline, other tasks) and calls again, which resumes at step 2 (``state[0]`` remembers);
3. **check** every peer's fingerprint slot (one 8-byte load each; a different call: ``MISMATCH``
   with the peer in ``state[1]``, the caller raises the error naming both calls);
4. **reduce**: ``x = S_0 <op> S_1 <op> ... <op> S_{n-1}`` in rank order, as the reference does
   (the same ``apply`` of collectives/kernels/cpu.py, the same order: the same bits).

The barrier is steps 1-3 without data. ``_inline_*``, for inline.py, begin with the domain's entry.
Memory order is explicit (atomics.py), so this is correct on AArch64 as on x86-64; what the event
loop must see between slices stays in Python (:func:`all_reduce`, :func:`barrier`;
bench/results/shm.md#the-compiled-small-path).

Not here: the domain, its set-up and its call bookkeeping (runtime/sharedmem/domains.py), the large path
(all_reduce_shm.py), float16 / bfloat16 (the reference path reduces them).
"""

from __future__ import annotations

import asyncio

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

from collectives import tunefile
from collectives.kernels.cpu import OP_CODES, apply
from collectives.slots import atomics as at
from collectives.slots import common
from runtime import env
from runtime.sharedmem import domains, waits

DONE, WAITING, MISMATCH, NOT_ENTERED = 0, 1, 2, 3
SUPPORTED = at.SUPPORTED
NATIVE = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8))

_HEADER, _SMALL = domains.HEADER_NBYTES, domains.SMALL_NBYTES
_SEQ, _BELL, _WANT, _FP, _FP_NBYTES = waits.OFF_SEQ, waits.OFF_BELL, waits.OFF_WANT, waits.OFF_FP, waits.FP_NBYTES
_WANT_ALL = np.uint64(waits.WANT_ALL << 62)
_SEEN_MASK = waits.SEEN_MASK
_WAKE_ALL = 0x7FFFFFFF
_JIT = dict(nogil=True, cache=True)


@intrinsic
def _pointer_like(typingctx, address, like):
    """``address`` as a pointer to ``like``'s dtype (for ``numba.carray``)."""
    ptr = types.CPointer(like.dtype)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))
    return ptr(types.uintp, like), codegen


@intrinsic
def _byte_pointer(typingctx, address):
    """``address`` as a pointer to bytes (for ``numba.carray``)."""
    ptr = types.CPointer(types.uint8)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))
    return ptr(types.uintp), codegen


@njit(inline="always", cache=True)
def _reached(word, target):
    """``word`` at or past ``target`` in wrapping 32-bit sequence order (runtime.sharedmem.waits.reached)."""
    return ((np.int64(word) - np.int64(target)) & 0xFFFFFFFF) < 0x80000000


@njit(inline="always", cache=True)
def _all_reached(ctl, me, target):
    for p in range(ctl.size):
        if p != me and not _reached(at.load_acquire_u32(ctl[p] + _SEQ), target):
            return False
    return True


@njit(inline="always", cache=True)
def _satisfied(ctl, q, want):
    """Is the condition peer ``q`` published (``want``) true now? (Domain._satisfied)"""
    target = np.int64(want & np.uint64(0xFFFFFFFF))
    if (want >> np.uint64(62)) == np.uint64(waits.WANT_ONE):
        p = np.int64((want >> np.uint64(32)) & np.uint64(0xFFFF))
        return _reached(at.load_acquire_u32(ctl[p] + _SEQ), target)
    return _all_reached(ctl, q, target)


@njit(inline="always", cache=True)
def _post(ctl, me, value):
    """Domain.post: my word, a full fence, then ring every peer whose want is now met."""
    at.store_release_u32(ctl[me] + _SEQ, np.uint32(value))
    at.fence()  # our word is visible before we read the peers' wants (runtime/sharedmem/waits.py)
    for q in range(ctl.size):
        if q == me:
            continue
        want = at.load_acquire_u64(ctl[q] + _WANT)
        if want == 0:
            continue
        bell = ctl[q] + _BELL
        seen = np.int64((want >> np.uint64(48)) & np.uint64(_SEEN_MASK))
        if seen == (np.int64(at.load_acquire_u32(bell)) & _SEEN_MASK) and _satisfied(ctl, q, want):
            at.fetch_add_u32(bell, np.uint32(1))
            at.futex_wake(bell, _WAKE_ALL)


@njit(inline="always", cache=True)
def _wait(ctl, me, target, spin, yield_spin, budget_ns, ts):
    """True once every other member's word reached ``target``; False when ``budget_ns`` is spent
    first (0: do not sleep at all)."""
    if _all_reached(ctl, me, target):
        return True
    for _ in range(spin):
        if yield_spin:
            at.sched_yield()
        else:
            at.cpu_relax()
        if _all_reached(ctl, me, target):
            return True
    if budget_ns <= 0:
        return False
    bell = ctl[me] + _BELL
    want_word = ctl[me] + _WANT
    want = _WANT_ALL | np.uint64(target)
    deadline = at.monotonic_ns(ts) + budget_ns
    done = False
    while True:
        rung = at.load_acquire_u32(bell)
        at.store_release_u64(want_word, want | (np.uint64(np.int64(rung) & _SEEN_MASK) << np.uint64(48)))
        at.fence()  # the want is visible before we look again (the poster's fence mirrors this)
        if _all_reached(ctl, me, target):
            done = True
            break
        left = deadline - at.monotonic_ns(ts)
        if left <= 0:
            break
        at.futex_wait(bell, rung, left, ts)
    at.store_release_u64(want_word, np.uint64(0))
    return done


@njit(inline="always", cache=True)
def _mismatch(ctl, me, parity, fp_header):
    """The first peer whose fingerprint slot of this parity is not ours, or -1."""
    for p in range(ctl.size):
        if p != me and at.load_acquire_u64(ctl[p] + _FP + parity * _FP_NBYTES) != fp_header:
            return p
    return -1


@njit(inline="always", cache=True)
def _fold(ctl, parity, x, op):
    """Step 4: ``x = S_0 <op> S_1 <op> ... <op> S_{n-1}`` over the small slots ``parity``, in rank order."""
    n = x.size
    first = carray(_pointer_like(ctl[0] + _HEADER + parity * _SMALL, x), n)
    for i in range(n):
        x[i] = first[i]
    for q in range(1, ctl.size):
        s = carray(_pointer_like(ctl[q] + _HEADER + parity * _SMALL, x), n)
        for i in range(n):
            x[i] = apply(op, x[i], s[i])


@njit(**_JIT)
def _all_reduce(ctl, me, parity, target, fp_header, x, op, state, spin, yield_spin, budget_ns):
    """Steps 1-4 of the module docstring. ``state``: int64 [stage, peer, timespec (2)]."""
    ts = state.ctypes.data + 16
    n = x.size
    if state[0] == 0:  # 1. publish
        mine = carray(_pointer_like(ctl[me] + _HEADER + parity * _SMALL, x), n)
        for i in range(n):
            mine[i] = x[i]
        _post(ctl, me, target)
        state[0] = 1
    if not _wait(ctl, me, target, spin, yield_spin, budget_ns, ts):  # 2. everyone's input is there
        return WAITING
    p = _mismatch(ctl, me, parity, fp_header)  # 3. all in this very call
    if p >= 0:
        state[1] = p
        return MISMATCH
    _fold(ctl, parity, x, op)  # 4. rank order
    state[0] = 2
    return DONE


@njit(**_JIT)
def _barrier(ctl, me, parity, target, fp_header, state, spin, yield_spin, budget_ns):
    """Steps 1-3 of the module docstring."""
    ts = state.ctypes.data + 16
    if state[0] == 0:
        _post(ctl, me, target)
        state[0] = 1
    if not _wait(ctl, me, target, spin, yield_spin, budget_ns, ts):
        return WAITING
    p = _mismatch(ctl, me, parity, fp_header)
    if p >= 0:
        state[1] = p
        return MISMATCH
    state[0] = 2
    return DONE


# -- the inline calls (collectives/slots/inline.py): the domain's entry too, two arrays and ints --

# inline state, uint64: stage, peer, timespec scratch (2), me, members, spin, yield_spin, budget_ns,
# the fingerprint text to put in the slot first (its address and length; length 0: the slot holds
# it already), then (from _CTL) every member's control segment address
_STAGE, _PEER, _ME, _N, _SPIN, _YIELD, _BUDGET, _TEXT, _TEXT_N, _CTL = 0, 1, 4, 5, 6, 7, 8, 9, 10, 16


@njit(inline="always", cache=True)
def _enter(state, seq, crc, parity, two_back):
    """Domain.try_begin's check and the fingerprint (publish_fingerprint): the text when
    ``state[_TEXT_N]`` says so (waits.fingerprint_text's bytes), then the header: False, nothing
    written, while a peer has not left call ``two_back`` (-1: none) that used this call's slots."""
    ctl = state[_CTL:_CTL + np.int64(state[_N])]
    me = np.int64(state[_ME])
    if two_back >= 0 and not _all_reached(ctl, me, ((two_back << 3) | waits.EXIT) & 0xFFFFFFFF):
        return False
    n = np.int64(state[_TEXT_N])
    if n > 0:  # plain stores: the header's release store below publishes them
        src = carray(_byte_pointer(state[_TEXT]), n)
        dst = carray(_byte_pointer(ctl[me] + _FP + parity * _FP_NBYTES + 8), n)
        for i in range(n):
            dst[i] = src[i]
    header = np.uint64(seq & 0xFFFFFFFF) | (np.uint64(crc) << np.uint64(32))
    at.store_release_u64(ctl[me] + _FP + parity * _FP_NBYTES, header)
    return True


@njit(inline="always", cache=True)
def _arrive(state, seq, parity, fp_header):
    """Wait for every member's phase 1 of call ``seq`` and compare fingerprints: DONE, WAITING
    (``budget`` spent; call again) or MISMATCH (the peer in ``state[_PEER]``)."""
    ctl = state[_CTL:_CTL + np.int64(state[_N])]
    me = np.int64(state[_ME])
    target = ((seq << 3) | 1) & 0xFFFFFFFF
    ts = state.ctypes.data + 16
    if not _wait(ctl, me, target, np.int64(state[_SPIN]), state[_YIELD] != 0, np.int64(state[_BUDGET]), ts):
        return WAITING
    p = _mismatch(ctl, me, parity, fp_header)
    if p >= 0:
        state[_PEER] = p
        return MISMATCH
    return DONE


@njit(**_JIT)
def _inline_all_reduce(x, state, seq, crc, parity, two_back, op):
    """The all_reduce of an inline call: enter (NOT_ENTERED: nothing done), steps 1-4; called
    again after WAITING, it resumes at step 2 (``state[_STAGE]``)."""
    ctl = state[_CTL:_CTL + np.int64(state[_N])]
    me = np.int64(state[_ME])
    n = x.size
    if state[_STAGE] == 0:
        if not _enter(state, seq, crc, parity, two_back):
            return NOT_ENTERED
        mine = carray(_pointer_like(ctl[me] + _HEADER + parity * _SMALL, x), n)
        for i in range(n):
            mine[i] = x[i]
        _post(ctl, me, ((seq << 3) | 1) & 0xFFFFFFFF)
        state[_STAGE] = 1
    rc = _arrive(state, seq, parity, np.uint64(seq & 0xFFFFFFFF) | (np.uint64(crc) << np.uint64(32)))
    if rc != DONE:
        return rc
    _fold(ctl, parity, x, op)
    state[_STAGE] = 2
    return DONE


@njit(**_JIT)
def _inline_barrier(state, seq, crc, parity, two_back):
    """The barrier of an inline call: enter, post, wait, compare (as :func:`_inline_all_reduce`)."""
    if state[_STAGE] == 0:
        if not _enter(state, seq, crc, parity, two_back):
            return NOT_ENTERED
        _post(state[_CTL:_CTL + np.int64(state[_N])], np.int64(state[_ME]), ((seq << 3) | 1) & 0xFFFFFFFF)
        state[_STAGE] = 1
    rc = _arrive(state, seq, parity, np.uint64(seq & 0xFFFFFFFF) | (np.uint64(crc) << np.uint64(32)))
    if rc == DONE:
        state[_STAGE] = 2
    return rc


# One slice of waiting inside the compiled call: the event loop gets a turn at least this often
# while a peer is late (the loop's other tasks, the deadline, a lost peer's EOF).
SLICE_NS = 1_000_000
# Pause rounds before sleeping when every rank has a core of its own (x86 ``pause``: tens of ns).
SPIN_PAUSES = 2000


class _Compiled:
    """What the compiled calls need of a domain, made once per domain (``Domain.compiled``):
    the members' control segment addresses, a state array, how to wait, and whether this
    path serves the domain at all (``enabled``: RINGWEAVE_SHM_COMPILED)."""
    __slots__ = ("ctl", "state", "wait", "enabled", "inline", "inline_calls")

    def __init__(self, dom):
        self.ctl = np.array(dom.control_addresses, np.uint64)
        self.state = np.zeros(4, np.int64)  # stage, peer, timespec scratch (2)
        own = common.own_cores(dom.group, dom.size)
        if dom.cooperative:  # the peers are tasks of this event loop: never block, never spin
            self.wait = (0, False, 0)
        elif own:
            self.wait = (SPIN_PAUSES, False, SLICE_NS)
        else:  # ranks share cores: a yield hands the core to one with work (bench/results/shm.md#waiting-and-waking)
            self.wait = (env.SHM_SPIN.get(), True, SLICE_NS)
        # auto: only where it pays: as the tuner measured it (tunefile.compiled), else a core per
        # rank; always for tasks of one process (bench/results/shm.md#the-compiled-small-path)
        setting = env.SHM_COMPILED.get()
        self.enabled = setting == "1" or (setting == "auto" and (dom.cooperative or tunefile.compiled(dom.group, own)))
        self.inline = np.zeros(_CTL + dom.size, np.uint64)  # the inline calls' state (_STAGE ... _CTL)
        self.inline[_ME], self.inline[_N] = dom.rank, dom.size
        self.inline[_SPIN], self.inline[_YIELD], self.inline[_BUDGET] = self.wait
        self.inline[_CTL:] = self.ctl
        self.inline_calls = 0  # calls that completed inline, without a coroutine (Domain.statistics)


def _compiled(dom) -> _Compiled:
    c = dom.compiled
    if c is None:
        c = dom.compiled = _Compiled(dom)
    return c


def usable(x: np.ndarray) -> bool:
    """Whether :func:`all_reduce` can serve ``x`` (a native dtype, this machine supported)."""
    return SUPPORTED and x.dtype in NATIVE


def enabled(dom) -> bool:
    """Whether the compiled path serves ``dom``'s calls (RINGWEAVE_SHM_COMPILED; auto: when its
    ranks have cores of their own). Members may differ: the protocol is the same either way."""
    return SUPPORTED and _compiled(dom).enabled


async def all_reduce(comm, dom, x: np.ndarray, op: str) -> None:
    """Steps 1-4 for ``comm``'s call on ``dom`` (entered: ``Domain.try_begin`` / ``begin``).

    Raises:
        as Domain.wait_all: the group's error, PeerLostError, CollectiveMismatchError,
        asyncio.CancelledError (the call's deadline) between slices.
    """
    fast = _compiled(dom)
    state = fast.state
    state[0] = 0
    target = waits.encode(comm.seq, 1)
    args = (fast.ctl, dom.rank, dom.parity, target, np.uint64(dom.fp_header), x, OP_CODES[op], state) + fast.wait
    rc = _all_reduce(*args)
    while rc == WAITING:
        rc = _all_reduce(*await _between(comm, dom, args))
    if rc == MISMATCH:
        dom.check_fingerprint(comm, int(state[1]))


async def barrier(comm, dom) -> None:
    """The barrier's steps for ``comm``'s call on ``dom`` (entered); raises as :func:`all_reduce`."""
    fast = _compiled(dom)
    state = fast.state
    state[0] = 0
    args = (fast.ctl, dom.rank, dom.parity, waits.encode(comm.seq, 1), np.uint64(dom.fp_header), state) + fast.wait
    rc = _barrier(*args)
    while rc == WAITING:
        rc = _barrier(*await _between(comm, dom, args))
    if rc == MISMATCH:
        dom.check_fingerprint(comm, int(state[1]))


async def _between(comm, dom, args: tuple) -> tuple:
    """Between two slices: the checks of Domain.wait_all (the group's error, the peers' processes,
    their fingerprints so far), then one turn of the event loop."""
    dom.check_peers(comm)
    await asyncio.sleep(0)
    return args


def warm(dtypes) -> None:
    """Loads (or compiles) :func:`_all_reduce` for each of ``dtypes`` and :func:`_barrier` (and their
    inline twins), with the
    argument types a real call passes, by running them as the only member of a private control
    block (no peer to wait for: each returns DONE at once). For collectives/warmup.py."""
    if not SUPPORTED:
        return
    block = np.zeros(_HEADER + 2 * _SMALL, np.uint8)
    ctl = np.array([block.ctypes.data], np.uint64)
    state = np.zeros(4, np.int64)
    target, fp_header, wait = waits.encode(1, 1), np.uint64(0), (0, False, 0)
    for dtype in dtypes:
        state[0] = 0
        _all_reduce(ctl, 0, 0, target, fp_header, np.ones(2, dtype), OP_CODES["sum"], state, *wait)
    state[0] = 0
    _barrier(ctl, 0, 0, target, fp_header, state, *wait)
    inline = np.zeros(_CTL + 1, np.uint64)  # the inline calls' kernels, alike
    inline[_N], inline[_CTL] = 1, block.ctypes.data
    for dtype in dtypes:
        inline[_STAGE] = 0
        _inline_all_reduce(np.ones(2, dtype), inline, 1, 0, 0, -1, OP_CODES["sum"])
    inline[_STAGE] = 0
    _inline_barrier(inline, 1, 0, 0, -1)
