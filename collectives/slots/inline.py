"""The small shared-memory all_reduce and barrier inline: from the public call (api.py) straight to
the compiled protocol (fastpath.py ``_inline_*``), without the layers between, for the calls of a
loop, which repeat. The normal path (calls.py -> group.run -> all_reduce_shm / barrier_shm, whose
Python lines stay the readable reference) runs every call this one does not take:

* the group's shared-memory domain is set up and free, with its compiled path on
  (``fastpath.enabled``), and the table chose "shm" for this (collective, dtype, count, op,
  algorithm) under the same facts: the settings the table reads (``RINGWEAVE_ALGO_<COLLECTIVE>``,
  ``_TUNE``, ``_TUNE_FILE``, ``_SHM``: read at every call), shared memory allowed for the group,
  its hosts;
* a NumPy array of a native dtype, C-contiguous, writeable, within the small slot;
* no tracing, no frame held unexpected, no group error, and the issuing thread's name, if any,
  known (the Communicator's calls, :func:`blocking`).

A taken call is the call the normal path would make: the group's next sequence number, the same
fingerprint, the domain's bookkeeping (``Domain._enter``), the same protocol and bits, the same
record of finished calls. It makes no Call record and no coroutine when every peer arrives within
the compiled call's bounded wait (a spin, then a futex sleep of at most ``fastpath.SLICE_NS``);
else the rest of the call is returned as an awaitable that group.run runs under the call's
deadline and checks (a lost or stopped peer, a mismatch, the loop's turns), as the normal path
would. Back to back, the loop still gets its turn (``LoopTurns.due``, as group.run gives it).

Not here: the protocol (fastpath.py, runtime/sharedmem/waits.py), the domain (domains.py).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from collectives import ops, registry
from collectives.kernels.cpu import OP_CODES, divide_into
from collectives.slots import fastpath
from runtime import env
from runtime.group import Call, issuing_thread
from runtime.init import current as current_runtime
from runtime.sharedmem import domains, waits
from runtime.turns import LoopTurns

DONE = True  # what a call that completed returns (the caller's array holds the result)
_SMALL = domains.SMALL_NBYTES
_inline_all_reduce, _inline_barrier = fastpath._inline_all_reduce, fastpath._inline_barrier
_WAITING, _MISMATCH, _NOT_ENTERED = fastpath.WAITING, fastpath.MISMATCH, fastpath.NOT_ENTERED
_TEXT, _TEXT_N = fastpath._TEXT, fastpath._TEXT_N


class _Plan:
    """One kind of call (collective, dtype, count, op, algorithm, thread) that the table gives
    shared memory: its fingerprint, that text's CRC-32 and its bytes as a slot holds them (their
    address and length, for the compiled entry), its op code and the normal path's run."""
    __slots__ = ("fingerprint", "crc", "text", "text_at", "text_n", "op", "avg", "run")

    def __init__(self, fingerprint: str, crc: int, op: int, avg: bool, run):
        self.fingerprint, self.crc, self.op, self.avg, self.run = fingerprint, crc, op, avg, run
        self.text = np.frombuffer(waits.fingerprint_text(fingerprint), np.uint8).copy()
        self.text_at, self.text_n = self.text.ctypes.data, self.text.size


class _Group:
    """What every inline call of one group reads: its domain and compiled state, the facts the
    plans hold under, the plans, the loop's turns."""
    __slots__ = ("group", "rt", "actor", "tracer", "dom", "on", "fast", "state", "facts", "topology", "plans",
                 "turns", "read_algorithms", "read_tuning")

    def __init__(self, group, dom, on: bool):
        self.group, self.rt, self.dom, self.on, self.turns = group, group.runtime, dom, on, None
        self.actor, self.tracer = self.rt.actor, self.rt.tracer
        self.fast = dom.compiled  # (None where the compiled path is not supported: then not on)
        self.state = None if self.fast is None else self.fast.inline
        self.topology = group.topology
        self.plans: dict = {}
        # the raw text of the settings registry.choose reads (SHM_COMPILED: the domain's, kept with it)
        self.read_algorithms = env.raw_reader(env.ALGO["all_reduce"], env.ALGO["barrier"], env.SHM)
        self.read_tuning = env.raw_reader(env.TUNE, env.TUNE_FILE, env.SHM_COMPILED)
        self.facts = self.now()

    def now(self) -> tuple:
        """The facts the table's choice rests on besides the call (registry.choose)."""
        return self.read_algorithms(), self.read_tuning(), self.group.shm_enabled


def _group(group) -> _Group | None:
    """The group's inline state, made once its shared-memory domain is set up."""
    dom = domains.existing(group)
    if dom is None or not dom.ready:
        return None
    g = group._shm_inline = _Group(group, dom, fastpath.enabled(dom))
    return g


def _plan(g: _Group, group, key: tuple, collective: str, x, op: str, algorithm, thread) -> _Plan | None:
    """The plan of ``key``'s calls when this one may run inline now (the module docstring), else None."""
    facts = g.now()
    if g.facts != facts or g.topology is not group.topology:  # a setting changed: the table is asked again
        g.plans.clear()
        g.facts, g.topology = facts, group.topology
    plan = g.plans.get(key, _UNSEEN)
    if plan is _UNSEEN:
        plan = _new_plan(g, key, collective, x, op, algorithm, thread)
    dom = g.dom
    if (plan is None or dom._busy or dom._lock_waiters or not dom.ready or group.error is not None
            or g.tracer.out_dir is not None or g.actor.has_unexpected()
            or (thread is None and issuing_thread.get() is not None)):
        if not dom.ready:
            del group._shm_inline  # closed: the next domain gets a state of its own
        return None
    return plan


def _new_plan(g: _Group, key: tuple, collective: str, x, op: str, algorithm, thread) -> _Plan | None:
    """The table's choice (registry.choose, as open_call asks it) must be "shm" and the array one the
    compiled path takes; kept (None too) until the facts change."""
    group = g.group
    try:
        algo, run = registry.choose(collective, 0 if x is None else x.nbytes, group.size, algorithm, group)
    except ValueError:
        return None  # the normal path raises it
    plan = None
    if algo == "shm" and (x is None or fastpath.usable(x)):
        fp = ops.fingerprint(collective, algo=algo) if x is None else \
            ops.fingerprint(collective, algo=algo, op=op, dtype=x.dtype, count=x.size)
        if thread is not None:
            fp = f"{fp} thread={thread}"
        plan = _Plan(fp, g.dom.fingerprint_crc(fp), OP_CODES[ops.kernel_op(op)] if x is not None else 0,
                     op == "avg", run)
    if len(g.plans) > 256:
        g.plans.clear()
    g.plans[key] = plan
    return plan


def all_reduce(x: np.ndarray, op: str, group, timeout: float | None, algorithm: str | None, thread=None):
    """``calls.all_reduce`` inline, when it can be (the module docstring); ``timeout`` is checked.

    Returns:
        None: not taken, nothing done (the normal path runs the call); DONE: ``x`` holds the
        result; else an awaitable that finishes the call (and raises as the normal path would).
    """
    if group is None:
        group = current_runtime().world
    g = getattr(group, "_shm_inline", None) or _group(group)
    if g is None or not g.on:
        return _off(group, g)
    if x.nbytes > _SMALL or type(op) is not str or op not in _OPS or not (algorithm is None or type(algorithm) is str):
        return None
    flags = x.flags
    if not (flags.c_contiguous and flags.writeable):
        return None
    plan = _plan(g, group, (x.dtype, x.size, op, algorithm, thread), "all_reduce", x, op, algorithm, thread)
    if plan is None:
        return None
    dom = g.dom
    flat = x if x.ndim == 1 else x.reshape(-1)
    state = g.state
    state[0] = 0
    seq = group._seq + 1  # ProcessGroup.open_call's number, taken without its Call record
    group._seq = seq
    parity = dom.ncalls & 1
    recent = dom._recent
    two_back = recent[0] if len(recent) == 2 else -1  # the call whose slots this one reuses
    text = dom._fp_text[parity] is not plan.fingerprint and _text(dom, parity, plan, state)
    rc = _inline_all_reduce(flat, state, seq, plan.crc, parity, two_back, plan.op)
    if text:
        _text_out(dom, parity, plan, state, rc)
    if rc:  # WAITING, MISMATCH: the call holds the domain until its rest ends it; NOT_ENTERED
        if rc == _NOT_ENTERED:
            return _normal(group, seq, plan, timeout, flat, op)
        _entered(dom, seq, parity, plan.crc)
        dom._busy = True
        return _rest(g, seq, plan, timeout, rc, (flat, state, seq, plan.crc, parity, -1, plan.op), flat, op)
    if plan.avg:
        divide_into(flat, group.size)
    return _done(g, group, dom, seq, parity, plan, thread)


def barrier(group, timeout: float | None, algorithm: str | None, thread=None):
    """``calls.barrier`` inline, when it can be; returns as :func:`all_reduce`."""
    if group is None:
        group = current_runtime().world
    g = getattr(group, "_shm_inline", None) or _group(group)
    if g is None or not g.on:
        return _off(group, g)
    if not (algorithm is None or type(algorithm) is str):
        return None
    plan = _plan(g, group, ("barrier", algorithm, thread), "barrier", None, "", algorithm, thread)
    if plan is None:
        return None
    dom = g.dom
    state = g.state
    state[0] = 0
    seq = group._seq + 1
    group._seq = seq
    parity = dom.ncalls & 1
    recent = dom._recent
    two_back = recent[0] if len(recent) == 2 else -1
    text = dom._fp_text[parity] is not plan.fingerprint and _text(dom, parity, plan, state)
    rc = _inline_barrier(state, seq, plan.crc, parity, two_back)
    if text:
        _text_out(dom, parity, plan, state, rc)
    if rc:
        if rc == _NOT_ENTERED:
            return _normal(group, seq, plan, timeout)
        _entered(dom, seq, parity, plan.crc)
        dom._busy = True
        return _rest(g, seq, plan, timeout, rc, (state, seq, plan.crc, parity, -1))
    return _done(g, group, dom, seq, parity, plan, thread)


def _off(group, g: _Group | None) -> None:
    """Not taken: no domain yet, or the compiled path off on it (its state is dropped with the
    domain, so the next one is looked at anew)."""
    if g is not None and not g.dom.ready:
        del group._shm_inline


def _text(dom, parity: int, plan: _Plan, state: np.ndarray) -> bool:
    """Whether slot ``parity`` needs the plan's fingerprint text (calls of two kinds alternate: often);
    if so the compiled entry writes it, once every peer has left the call two back, which used
    that slot, and before the header (``fastpath._enter``)."""
    if dom._fp_text[parity] == plan.fingerprint:
        dom._fp_text[parity] = plan.fingerprint  # the same text: the next call's test is ``is``
        return False
    state[_TEXT], state[_TEXT_N] = plan.text_at, plan.text_n
    return True


def _text_out(dom, parity: int, plan: _Plan, state: np.ndarray, rc: int) -> None:
    """After a compiled entry given the text: unless it did not enter (nothing written), the slot
    holds the plan's text now; the next calls give none."""
    state[_TEXT_N] = 0
    if rc != _NOT_ENTERED:
        dom._fp_text[parity] = plan.fingerprint
_UNSEEN = object()
_OPS = frozenset(ops.OPS)


def _entered(dom, seq: int, parity: int, crc: int) -> None:
    """Domain._enter's bookkeeping for a call the compiled code entered (its header is out)."""
    recent = dom._recent
    if len(recent) == 2:
        del recent[0]
    recent.append(seq)
    dom.parity = parity
    dom.ncalls += 1
    dom._fp_header = (seq & 0xFFFFFFFF) | (crc << 32)


def _done(g: _Group, group, dom, seq: int, parity: int, plan: _Plan, thread) -> object:
    """A call that completed inline: the domain's bookkeeping of its entry, its record among the
    finished calls (ProcessGroup.run's), the loop's turn when one is due (as group.run gives it)."""
    _entered(dom, seq, parity, plan.crc)
    finished = group._finished
    finished[seq] = plan.fingerprint
    if len(finished) > 256:
        del finished[next(iter(finished))]
    g.fast.inline_calls += 1
    if thread is None:  # on the loop: its turn, as group.run gives it after a call
        turns = g.turns
        if turns is None:
            turns = g.turns = LoopTurns.for_loop(asyncio.get_running_loop())
        if turns.due(g.rt.call_turn_s):
            return asyncio.sleep(0)
    return DONE


def _call(group, seq: int, plan: _Plan, timeout: float | None) -> Call:
    """The Call record of a call whose number is taken (ProcessGroup.open_call's, after the fact)."""
    call = Call(group, seq, plan.fingerprint, timeout if timeout is not None else group.runtime.timeout_s)
    group.calls[seq] = call
    call.algorithm = "shm"
    return call


async def _normal(group, seq: int, plan: _Plan, timeout: float | None, *args) -> None:
    """A call not entered inline (a peer still in the call two back): the normal path runs it."""
    call = _call(group, seq, plan, timeout)
    if args:
        flat, op = args
        await group.run(call, plan.run, flat, ops.kernel_op(op))
        await ops.finish_avg(flat, op, group.size)
    else:
        await group.run(call, plan.run)


async def _rest(g: _Group, seq: int, plan: _Plan, timeout: float | None, rc: int, args: tuple,
                flat: np.ndarray | None = None, op: str = "") -> None:
    """The rest of a call entered inline whose peers were late: group.run, slice after slice."""
    group = g.group
    call = _call(group, seq, plan, timeout)
    kernel = _inline_barrier if flat is None else _inline_all_reduce
    await group.run(call, _go_on, g, kernel, args, rc)
    if flat is not None:
        await ops.finish_avg(flat, op, group.size)


async def _go_on(call: Call, g: _Group, kernel, args: tuple, rc: int) -> None:
    dom = g.dom
    g.turns = LoopTurns.for_loop(call.loop)  # the loop the runtime runs on now
    ok = False
    try:
        while rc == _WAITING:  # the checks of a slice, a turn of the loop, the next slice
            dom.check_peers(call)
            await asyncio.sleep(0)
            rc = kernel(*args)
        if rc == _MISMATCH:
            dom.check_fingerprint(call, int(g.state[fastpath._PEER]))
        ok = True
    finally:
        dom.end(call, ok, post_exit=False)  # phase 1 of our next call says it (Domain.end)


def thread_name() -> str:
    """The issuing thread's name as the Communicator's calls carry it (blocking.py ``_coro``)."""
    return threading.current_thread().name[:64]
