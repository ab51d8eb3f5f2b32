"""The requests' contract on its own (runtime/requests.py), over a recording ``send_frame``: the
question a call sends, how its answer, an error answer, a peer gone or close ends it and what
is left in flight after each, its one deadline over sending and waiting, and how a question
is served (the answer frame, an error as ``e``, a reply deadline). Whole actors run the same
calls over both transports in tests/conformance/check_connection.py."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest

from runtime.errors import ClosedError, PeerLostError, PeerTimeoutError, RemoteCallError
from runtime.requests import Requests

pytestmark = pytest.mark.timeout(30)


class Frames:
    """``send_frame`` that records each frame; a frame to a rank in ``stalled`` is never taken."""

    def __init__(self):
        self.sent: list[tuple[int, dict, bytes | None]] = []
        self.stalled: set[int] = set()

    async def __call__(self, dst: int, header: dict, payload=None) -> None:
        if dst in self.stalled:
            await asyncio.sleep(60)
        self.sent.append((dst, header, None if payload is None else bytes(payload)))


def make(reply_timeout_s: float | None = 5.0):
    frames, tasks = Frames(), []

    def spawn(coro, name):
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.append(task)
        return task

    return Requests(0, frames, spawn, reply_timeout_s=reply_timeout_s), frames, tasks


async def asked(frames: Frames, n: int) -> None:
    """Until ``n`` frames have been sent (a call's question goes out on the call's task)."""
    while len(frames.sent) < n:
        await asyncio.sleep(0)


async def test_a_call_sends_its_question_and_returns_the_answer():
    requests, frames, _ = make()
    call = asyncio.ensure_future(requests.call(1, "add", 2, 3))
    await asked(frames, 1)
    assert frames.sent == [(1, {"k": "q", "i": 1, "n": "add"}, msgpack.packb([2, 3]))]
    assert requests.pending_calls() == 1
    requests.on_reply(1, {"k": "r", "i": 1}, bytearray(msgpack.packb(5)))
    assert await call == 5
    assert requests.pending_calls() == 0


async def test_an_error_answer_raises_remote_call_error_naming_the_rank():
    requests, frames, _ = make()
    call = asyncio.ensure_future(requests.call(2, "boom"))
    await asked(frames, 1)
    requests.on_reply(2, {"k": "r", "i": 1, "e": "ZeroDivisionError: division by zero"}, bytearray())
    with pytest.raises(RemoteCallError, match=r"^rank 2: ZeroDivisionError: division by zero$"):
        await call
    assert requests.pending_calls() == 0


async def test_answers_go_to_their_own_call_and_stray_answers_are_ignored():
    requests, frames, _ = make()
    first = asyncio.ensure_future(requests.call(1, "f"))
    second = asyncio.ensure_future(requests.call(1, "f"))
    await asked(frames, 2)
    assert [h["i"] for _, h, _ in frames.sent] == [1, 2]
    requests.on_reply(1, {"k": "r", "i": 2}, bytearray(msgpack.packb("two")))
    requests.on_reply(1, {"k": "r", "i": 99}, bytearray(msgpack.packb("nobody asked")))
    requests.on_reply(1, {"k": "r", "i": 2}, bytearray(msgpack.packb("again")))
    assert await second == "two" and not first.done()
    requests.on_reply(1, {"k": "r", "i": 1}, bytearray(msgpack.packb("one")))
    assert await first == "one"


async def test_a_peer_gone_fails_only_the_calls_to_it_and_close_fails_the_rest():
    requests, frames, _ = make()
    to_1 = asyncio.ensure_future(requests.call(1, "f"))
    to_2 = asyncio.ensure_future(requests.call(2, "f"))
    await asked(frames, 2)
    lost = PeerLostError("rank 1 lost", 1)
    requests.fail_to(1, lost)
    with pytest.raises(PeerLostError) as info:
        await to_1
    assert info.value is lost
    assert not to_2.done() and requests.pending_calls() == 1
    requests.fail_all(ClosedError("rank 0 closed its actor"))
    with pytest.raises(ClosedError, match="rank 0 closed its actor"):
        await to_2
    assert requests.pending_calls() == 0


async def test_one_deadline_covers_sending_the_question_and_awaiting_the_answer():
    requests, frames, _ = make()
    frames.stalled.add(1)  # rank 1 stopped reading: the question is never taken
    with pytest.raises(PeerTimeoutError, match=r"^rank 0: the connection to rank 1 did not take the question 'f' "
                                               r"in 0\.1 s: rank 1 stopped reading \(stalled or stopped\)$") as info:
        await requests.call(1, "f", timeout_s=0.1)
    assert info.value.rank == 1
    with pytest.raises(TimeoutError) as info:  # taken, never answered: a plain TimeoutError
        await requests.call(2, "f", timeout_s=0.1)
    assert not isinstance(info.value, PeerTimeoutError)
    assert requests.pending_calls() == 0


async def test_a_question_is_answered_with_the_handlers_result_or_its_error():
    requests, frames, tasks = make()
    requests.register("add", lambda x, y: x + y)

    async def later(x):
        await asyncio.sleep(0)
        return [x]

    requests.register("later", later)
    requests.register("boom", lambda: 1 / 0)
    for call_id, name, args in [(7, "add", [2, 3]), (8, "later", ["x"]), (9, "boom", []), (10, "nope", [])]:
        requests.on_request(2, {"k": "q", "i": call_id, "n": name}, bytearray(msgpack.packb(args)))
    await asyncio.gather(*tasks)
    assert frames.sent == [
        (2, {"k": "r", "i": 7}, msgpack.packb(5)),
        (2, {"k": "r", "i": 9, "e": "ZeroDivisionError: division by zero"}, None),
        (2, {"k": "r", "i": 10, "e": "KeyError: \"no handler named 'nope' on rank 0\""}, None),
        (2, {"k": "r", "i": 8}, msgpack.packb(["x"])),  # it waited a turn
    ]


async def test_an_answer_the_peer_does_not_take_is_dropped_at_the_reply_deadline():
    requests, frames, tasks = make(reply_timeout_s=0.1)
    requests.register("f", lambda: 1)
    frames.stalled.add(1)
    requests.on_request(1, {"k": "q", "i": 1, "n": "f"}, bytearray(msgpack.packb([])))
    await asyncio.wait_for(asyncio.gather(*tasks), 5)  # ends without raising
    assert frames.sent == []


async def test_tools_get_ringweave_handlers_only_and_any_thread_ones_off_the_loop():
    requests, _, _ = make()
    loop = asyncio.get_running_loop()
    ran_on = {}

    def where(name):
        ran_on[name] = threading.get_ident()
        return name

    requests.register("ringweave.quick", lambda: where("quick"), any_thread=True)
    requests.register("ringweave.on_loop", lambda: where("on_loop"))
    requests.register("private", lambda: "no")

    def tool_thread():  # the listener's thread runs the tool's requests on a loop of its own
        async def ask_all():
            got = [await requests.serve_tool("ringweave.quick", [], loop=loop),
                   await requests.serve_tool("ringweave.on_loop", [], loop=loop)]
            for name, error in [("private", PermissionError), ("ringweave.missing", KeyError)]:
                with pytest.raises(error):
                    await requests.serve_tool(name, [], loop=loop)
            return got, threading.get_ident()
        return asyncio.run(ask_all())

    got, tool_thread_id = await asyncio.to_thread(tool_thread)
    assert got == ["quick", "on_loop"]
    assert ran_on == {"quick": tool_thread_id, "on_loop": threading.get_ident()}
