"""Requests: one rank calls a handler that another rank registered by name, and gets its answer.

:class:`Requests` holds the handlers (plain or async functions, msgpack-able arguments and
results) and the calls in flight. ``call(dst, name, *args)`` sends a question (``q`` frame,
``{i: id, n: name}``, the arguments as its payload) and awaits the answer (``r`` frame,
``{i: id, e?: error}``, the result as its payload); the other side runs the handler as a task of
its actor and answers, an error as ``e``. Tools (``python -m tools.status``) call the
``ringweave.*`` handlers over their own connections: :meth:`Requests.serve_tool`, on the
listener's thread.

Deadlines: ``call``'s ``timeout_s`` covers both sending the question and awaiting the answer
(PeerTimeoutError when the question was not taken, TimeoutError when no answer came); the answer
is sent under ``reply_timeout_s`` (the runtime's timeout) and dropped past it.

Its owner routes the frames to it (:meth:`Requests.on_request`, :meth:`Requests.on_reply`) and
fails the calls waiting on a peer that is gone (:meth:`Requests.fail_to`) or on a closed actor
(:meth:`Requests.fail_all`).

Life of a call (grammar)::

    call -> question sent -> (answer | error answer | peer gone | close | deadline) -> end

Not here: the connections (peers.py), point-to-point messages (mailbox.py).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import msgpack

from runtime.errors import ClosedError, PeerLostError, PeerTimeoutError, RemoteCallError


class Requests:
    """The handlers of one rank, and its calls to other ranks' handlers."""

    def __init__(self, rank: int, send_frame: Callable[..., Awaitable[None]],
                 spawn: Callable[[Awaitable, str], Any], *, reply_timeout_s: float | None):
        """
        Args:
            send_frame: ``await send_frame(dst, header, payload)``, one frame to rank ``dst``
                (runtime/peers.py; raises PeerLostError, ClosedError).
            spawn: ``spawn(coro, name)`` starts a task its owner cancels and awaits at close.
            reply_timeout_s: how long an answer may take to go out (None: no deadline).
        """
        self.rank = rank
        self.reply_timeout_s = reply_timeout_s
        self._send_frame = send_frame
        self._spawn = spawn
        self._handlers: dict[str, Callable[..., Any]] = {}
        self._any_thread: set[str] = set()  # handlers that tools may run on the listener's thread
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}  # call id -> (dst, its answer)
        self._next_call = 0

    def register(self, name: str, fn: Callable[..., Any], *, any_thread: bool = False) -> None:
        """Registers ``fn`` (plain or async) as the handler of ``call(.., name, ...)``.

        Args:
            any_thread: ``fn`` is plain, quick and safe to run on another thread (it only
                reads, and copies what it iterates); tools calling a ``ringweave.*`` handler so
                marked are answered from the listener's thread, even while this loop is busy.
        """
        self._handlers[name] = fn
        if any_thread:
            self._any_thread.add(name)
        else:
            self._any_thread.discard(name)

    # -- calling ---------------------------------------------------------------------
    async def call(self, dst: int, name: str, *args, timeout_s: float | None = 30.0) -> Any:
        """Calls handler ``name`` on rank ``dst`` with msgpack-able ``args``; returns its result.

        One deadline, ``timeout_s``, covers sending the question and waiting for the answer: the
        question queues behind whatever the connection is still sending (a 64 MiB payload to a
        peer that stopped reading never drains), and a call must end in time all the same.

        Raises:
            RemoteCallError: the handler raised (message carries its error).
            PeerLostError: ``dst`` went away.
            PeerTimeoutError: the connection did not take the question in ``timeout_s`` (``dst``
                stopped reading: stalled or stopped). TimeoutError: it did, no answer came in time.
        """
        self._next_call += 1
        call_id = self._next_call
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (dst, fut)
        cm = asyncio.timeout(timeout_s)
        sent = False
        try:
            async with cm:
                await self._send_frame(dst, {"k": "q", "i": call_id, "n": name},
                                       msgpack.packb(list(args), use_bin_type=True))
                sent = True
                return await fut
        except TimeoutError:
            if sent or not cm.expired():
                raise
            raise PeerTimeoutError(f"rank {self.rank}: the connection to rank {dst} did not take the question "
                                   f"{name!r} in {timeout_s:g} s: rank {dst} stopped reading (stalled or stopped)",
                                   dst) from None
        finally:
            self._calls.pop(call_id, None)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # failed while the question was still queued (a lost peer): seen, not logged

    def on_reply(self, peer: int, header: dict, data: bytearray) -> None:
        """An answer (``r`` frame) from ``peer``: completes its call, if that still waits."""
        entry = self._calls.pop(header["i"], None)
        if entry is not None and not entry[1].done():
            if "e" in header:
                entry[1].set_exception(RemoteCallError(f"rank {peer}: {header['e']}"))
            else:
                entry[1].set_result(msgpack.unpackb(data, raw=False, strict_map_key=False))

    def fail_to(self, peer: int, exc: BaseException) -> None:
        """Fails every call waiting on ``peer`` with ``exc`` (it is gone)."""
        for i, (dst, fut) in list(self._calls.items()):
            if dst == peer and not fut.done():
                fut.set_exception(exc)
                del self._calls[i]

    def fail_all(self, exc: BaseException) -> None:
        """Fails every call still waiting with ``exc`` (the actor closed)."""
        for _, fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        self._calls.clear()

    def pending_calls(self) -> int:
        return len(self._calls)

    # -- serving -----------------------------------------------------------------------
    def on_request(self, peer: int, header: dict, data: bytearray) -> None:
        """A question (``q`` frame) from ``peer``: its handler runs as a task, which answers."""
        self._spawn(self._serve_call(peer, header["i"], header["n"], data), f"call {header['n']}")

    async def _serve_call(self, peer: int, call_id: int, name: str, data: bytearray) -> None:
        try:
            fn = self._handlers.get(name)
            if fn is None:
                raise KeyError(f"no handler named {name!r} on rank {self.rank}")
            result = fn(*msgpack.unpackb(data, raw=False, strict_map_key=False))
            if asyncio.iscoroutine(result):
                result = await result
            reply, payload = {"k": "r", "i": call_id}, msgpack.packb(result, use_bin_type=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reply, payload = {"k": "r", "i": call_id, "e": f"{type(exc).__name__}: {exc}"}, None
        try:  # a peer that stopped reading gets no answer (its call has its own deadline)
            async with asyncio.timeout(self.reply_timeout_s):
                await self._send_frame(peer, reply, payload)
        except (PeerLostError, ClosedError, TimeoutError):
            pass

    async def serve_tool(self, name: str, args: list, *, loop: asyncio.AbstractEventLoop) -> Any:
        """Runs a tool's request, on the listener's thread: ``ringweave.*`` handlers only; those
        registered ``any_thread`` run right here (so a busy loop does not keep tools waiting),
        the others on ``loop``, the actor's.

        Raises:
            PermissionError: ``name`` is not a ``ringweave.*`` handler. KeyError: none is registered.
        """
        if not name.startswith("ringweave."):
            raise PermissionError(f"tools may not call {name!r}")
        fn = self._handlers.get(name)
        if fn is None:
            raise KeyError(f"no handler named {name!r} on rank {self.rank}")
        if name in self._any_thread:
            return fn(*args)

        async def on_loop():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(on_loop(), loop))
