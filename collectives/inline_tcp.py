"""The small TCP all_reduce inline: from the public call (api.py) straight to the sockets, the
exchange rounds of recursive doubling run on the caller's thread (``rounds_now``), without the
coroutines, the watchdog and the kernel steps of the normal path (calls.py -> group.run ->
all_reduce_recursive_doubling.run, whose lines stay the readable reference). Taken when:

* nothing else is in flight on the runtime and it is the process's only one (``exchange_now``'s
  own conditions: a frame of the call kept before it began is taken from where it is kept), no
  group error, no tracing;
* the table chose ``recursive_doubling`` for this call (``registry.choose``, as open_call asks
  it), the group's size a power of two (no fold), this rank a member;
* a NumPy array within :data:`SMALL_NBYTES`, one the normal path takes (``ops.check_array``).

A taken call is the call the normal path would make: the group's next sequence number, a Call
record with the same fingerprint (the issuing thread's name in it too), the same frames and
the same reductions in the same order (the same bits), the same record of finished calls and
the loop's turn when one is due. Each round waits at most the runtime's ``inline_wait_s``; a
round that cannot finish at once (a late or lost peer, a frame of another call, a full socket)
hands the rest of the call to group.run (``rounds`` from that round), which runs it under the
call's deadline and reports what went wrong as the normal path does.

Not here: the algorithm (algorithms/tcp/all_reduce_recursive_doubling.py), the reads straight off
the socket (runtime/group.py ``Call.exchange_now``, runtime/transport.py ``recv_now``).
"""

from __future__ import annotations

import asyncio

import numpy as np

from collectives import ops, registry
from collectives.algorithms.tcp import all_reduce_recursive_doubling as rd
from collectives.kernels.cpu import divide_into
from runtime.errors import PeerLostError
from runtime import group as group_module
from runtime.group import Call, issuing_thread
from runtime.init import current as current_runtime
from runtime.turns import LoopTurns

DONE = True  # what a call that completed returns (the caller's array holds the result)
SMALL_NBYTES = 64 * 1024  # the largest array taken: a frame read whole (transport._NOW_WHOLE_NBYTES)
_OPS = frozenset(ops.OPS)
_FINGERPRINTS: dict[tuple, str] = {}


def all_reduce(x: np.ndarray, op: str, group, timeout: float | None, algorithm: str | None):
    """``calls.all_reduce`` inline, when it can be (the module docstring); ``timeout`` is checked.

    Returns:
        None: not taken, nothing done (the normal path runs the call); DONE: ``x`` holds the
        result; else an awaitable that finishes the call (and raises as the normal path would).
    """
    if group is None:
        group = current_runtime().world
    rt = group.runtime
    size = group.size
    if (rt.in_flight or group_module._live_runtimes != 1 or group.error is not None or group.rank < 0
            or size < 2 or size & (size - 1) or x.nbytes > SMALL_NBYTES or type(op) is not str or op not in _OPS
            or rt.tracer.enabled or not (algorithm is None or type(algorithm) is str)):
        return None
    try:
        ops.check_array("x", x)
        algo, _ = registry.choose("all_reduce", x.nbytes, size, algorithm, group)
    except (TypeError, ValueError):
        return None  # the normal path raises it
    if algo != "recursive_doubling":
        return None
    thread = issuing_thread.get()
    key = (x.dtype, x.size, op, thread)
    fingerprint = _FINGERPRINTS.get(key)
    if fingerprint is None:  # open_call's, for the same call
        fingerprint = ops.fingerprint("all_reduce", algo=algo, op=op, dtype=x.dtype, count=x.size)
        if thread is not None:
            fingerprint = f"{fingerprint} thread={thread}"
        if len(_FINGERPRINTS) > 256:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[key] = fingerprint
    seq = group._seq + 1  # ProcessGroup.open_call's number and record
    group._seq = seq
    call = Call(group, seq, fingerprint, timeout if timeout is not None else rt.timeout_s)
    call.algorithm = algo
    group.calls[seq] = call
    flat = x.reshape(-1)
    scratch = np.empty_like(flat)
    kop = ops.kernel_op(op)
    steps = rd.plan(size, group.rank)[2]
    rt.in_flight += 1
    try:
        k, sent = rd.rounds_now(call, flat, scratch, steps, kop)
    except BaseException as exc:  # (send_now raises the group's error)
        _end(group, call)
        if isinstance(exc, PeerLostError):
            group.abort(exc)
        raise
    if k < len(steps):
        rt.in_flight -= 1  # group.run counts it again
        return _rest(call, flat, scratch, steps, k, sent, op, kop)
    _end(group, call)
    if rt.actor.has_unexpected():  # a frame of this call nobody received: group.run's check
        group._check_leftovers(call)
    if op == "avg":
        divide_into(flat, size)
    if LoopTurns.for_loop(asyncio.get_running_loop()).due(rt.call_turn_s):  # as group.run gives it
        return asyncio.sleep(0)
    return DONE


def _end(group, call: Call) -> None:
    """group.run's bookkeeping when a call ends: no longer in flight, among the finished."""
    group.runtime.in_flight -= 1
    group.calls.pop(call.seq, None)
    finished = group._finished
    finished[call.seq] = call.fingerprint
    if len(finished) > 256:
        del finished[next(iter(finished))]


async def _rest(call: Call, flat: np.ndarray, scratch: np.ndarray, steps, k: int, sent: bool, op: str,
                kop: str) -> None:
    """The rounds from ``k`` on (its send out when ``sent``), under group.run's rules."""
    group = call.group
    await group.run(call, rd.rounds, flat, scratch, steps, kop, k, sent)
    await ops.finish_avg(flat, op, group.size)
