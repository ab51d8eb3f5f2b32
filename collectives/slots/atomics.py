"""Atomic loads and stores, fences, a CPU pause and system calls, for compiled (Numba ``nopython``)
code that shares memory with other processes: the words of runtime/sharedmem/waits.py's protocol.

Each is a Numba intrinsic written in LLVM IR through llvmlite, so the memory order is LLVM's own and
the code generator emits what the architecture needs: on x86-64 an acquire load and a release store
are plain moves (TSO) and a ``seq_cst`` fence is ``mfence``; on AArch64 they are ``ldar`` / ``stlr``
and ``dmb ish``. Addresses are plain integers (``uintp``): the words live in ``mmap`` segments
whose base address the caller knows (``runtime.sharedmem.segments.Segment.address``).

System calls are inline assembly (``syscall`` on x86-64, ``svc #0`` on AArch64), not ctypes
function pointers: a compiled function that calls through a ctypes pointer cannot be kept in
Numba's on-disk cache (its address differs per process), and every rank would compile it again at
start. Only Linux on those two architectures is supported; :data:`SUPPORTED` says whether this
machine is one (elsewhere the callers keep to the Python path).

    futex_wait(address, expected, timeout_ns, timespec_address) -> 0 | -errno
    futex_wake(address, count) -> woken | -errno
    sched_yield()
    monotonic_ns(timespec_address) -> nanoseconds of CLOCK_MONOTONIC

The futex operations are the shared ones (no ``FUTEX_PRIVATE_FLAG``): the words are in MAP_SHARED
files mapped by several processes. ``timespec_address`` points at two int64 of scratch (a
``struct timespec``) owned by the caller.

Not here: the protocol (runtime/sharedmem/waits.py says it; collectives/slots/fastpath.py runs it compiled).
"""

from __future__ import annotations

import platform
import sys

import llvmlite.binding as llvm
import llvmlite.ir as ir
from numba import njit, types
from numba.extending import intrinsic

from collectives.kernels import jitcache  # noqa: F401  (before any @njit that uses these: the cache folder)

llvm.initialize_native_asmparser()  # Numba sets up the printer only; inline assembly needs the parser
_ARCH = platform.machine().lower()
X86_64 = _ARCH in ("x86_64", "amd64")
AARCH64 = _ARCH in ("aarch64", "arm64")
SUPPORTED = sys.platform.startswith("linux") and (X86_64 or AARCH64)

# system call numbers: (x86-64, aarch64)
_NR = {"futex": (202, 98), "sched_yield": (24, 124), "clock_gettime": (228, 113)}
FUTEX_WAIT, FUTEX_WAKE = 0, 1
CLOCK_MONOTONIC = 1
ETIMEDOUT, EAGAIN, EINTR = 110, 11, 4


def _nr(name: str) -> int:
    return _NR[name][1 if AARCH64 else 0]


_I32, _I64 = ir.IntType(32), ir.IntType(64)


def _ptr(builder, address, width: int):
    return builder.inttoptr(address, ir.IntType(width).as_pointer())


# -- loads, stores, read-modify-write, fences ------------------------------------------------------

@intrinsic
def load_acquire_u32(typingctx, address):
    """The u32 at ``address``, loaded with acquire order."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_ptr(builder, args[0], 32), "acquire", 4)
    return types.uint32(types.uintp), codegen


@intrinsic
def load_acquire_u64(typingctx, address):
    """The u64 at ``address`` (8-byte aligned), loaded with acquire order."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_ptr(builder, args[0], 64), "acquire", 8)
    return types.uint64(types.uintp), codegen


@intrinsic
def store_release_u32(typingctx, address, value):
    """``*address = value`` (u32) with release order: every store before it is seen first."""
    def codegen(context, builder, sig, args):
        v = builder.trunc(args[1], _I32) if args[1].type.width > 32 else builder.zext(args[1], _I32) \
            if args[1].type.width < 32 else args[1]
        builder.store_atomic(v, _ptr(builder, args[0], 32), "release", 4)
        return context.get_dummy_value()
    return types.void(types.uintp, types.uint32), codegen


@intrinsic
def store_release_u64(typingctx, address, value):
    """``*address = value`` (u64, 8-byte aligned) with release order."""
    def codegen(context, builder, sig, args):
        builder.store_atomic(args[1], _ptr(builder, args[0], 64), "release", 8)
        return context.get_dummy_value()
    return types.void(types.uintp, types.uint64), codegen


@intrinsic
def fetch_add_u32(typingctx, address, value):
    """``*address += value`` (u32, wrapping) as one sequentially consistent read-modify-write;
    returns the old value."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _ptr(builder, args[0], 32), args[1], "seq_cst")
    return types.uint32(types.uintp, types.uint32), codegen


@intrinsic
def fence(typingctx):
    """A full (``seq_cst``) fence: the stores before it are visible before the loads after it."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def cpu_relax(typingctx):
    """The spin-wait hint (x86 ``pause``, AArch64 ``yield``): a polite busy-wait step."""
    def codegen(context, builder, sig, args):
        asm = "pause" if X86_64 else "yield"
        builder.asm(ir.FunctionType(ir.VoidType(), []), asm, "~{memory}", [], side_effect=True)
        return context.get_dummy_value()
    return types.void(), codegen


# -- system calls ----------------------------------------------------------------------------------

@intrinsic
def _syscall4(typingctx, nr, a0, a1, a2, a3):
    """A raw system call with four integer arguments; returns the kernel's value (-errno on error)."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I64, [_I64] * 5)
        if X86_64:
            asm, cons = "syscall", "={rax},{rax},{rdi},{rsi},{rdx},{r10},~{rcx},~{r11},~{memory}"
        else:
            asm, cons = "svc #0", "={x0},{x8},{x0},{x1},{x2},{x3},~{memory}"
        return builder.asm(fnty, asm, cons, list(args), side_effect=True)
    return sig, codegen


_NR_FUTEX, _NR_YIELD, _NR_CLOCK = _nr("futex"), _nr("sched_yield"), _nr("clock_gettime")


@intrinsic
def _store_i64(typingctx, address, value):
    def codegen(context, builder, sig, args):
        builder.store(args[1], _ptr(builder, args[0], 64))
        return context.get_dummy_value()
    return types.void(types.uintp, types.int64), codegen


@intrinsic
def _load_i64(typingctx, address):
    def codegen(context, builder, sig, args):
        return builder.load(_ptr(builder, args[0], 64))
    return types.int64(types.uintp), codegen


_inline = njit(inline="always", cache=True)


@_inline
def futex_wait(address, expected, timeout_ns, timespec_address):
    """Sleeps while the u32 at ``address`` equals ``expected``, at most ``timeout_ns``. Returns 0
    (woken), -EAGAIN (the value differed), -ETIMEDOUT or -EINTR."""
    _store_i64(timespec_address, timeout_ns // 1_000_000_000)
    _store_i64(timespec_address + 8, timeout_ns % 1_000_000_000)
    return _syscall4(_NR_FUTEX, address, FUTEX_WAIT, expected, timespec_address)


@_inline
def futex_wake(address, count):
    """Wakes up to ``count`` sleepers on the u32 at ``address``; returns how many woke."""
    return _syscall4(_NR_FUTEX, address, FUTEX_WAKE, count, 0)


@_inline
def sched_yield():
    """Hands the core to another runnable thread, if any (then returns at once)."""
    _syscall4(_NR_YIELD, 0, 0, 0, 0)


@_inline
def monotonic_ns(timespec_address):
    """CLOCK_MONOTONIC in nanoseconds (a real system call, not the vDSO: call it sparingly)."""
    _syscall4(_NR_CLOCK, CLOCK_MONOTONIC, timespec_address, 0, 0)
    return _load_i64(timespec_address) * 1_000_000_000 + _load_i64(timespec_address + 8)
