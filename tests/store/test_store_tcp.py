"""What only the TCP store does: authentication, hostile and broken clients,
late servers, dying servers and clients, limits. The shared contract is in
test_store_conformance.py."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import msgpack
import pytest

from runtime import auth, net, wire
from runtime.errors import AuthenticationError, ClosedError, ConnectError, StoreError, StoreTimeoutError
from runtime.store_server import StoreServer
from runtime.store_tcp import TCPStore

pytestmark = pytest.mark.timeout(30)

SECRET = b"tcp-test-secret"


@pytest.fixture
async def server():
    srv = await StoreServer("127.0.0.1", 0, secret=SECRET, handshake_timeout_s=0.3).start()
    try:
        yield srv
    finally:
        await srv.close()


async def client(srv: StoreServer, **kw) -> TCPStore:
    kw.setdefault("secret", SECRET)
    kw.setdefault("timeout_s", 5.0)
    return await TCPStore.connect(srv.host, srv.port, **kw)


async def raw_authenticated(srv: StoreServer) -> socket.socket:
    """A socket past the handshake, for writing frames by hand."""
    sock = await net.connect(srv.host, srv.port, 5.0, "store")
    await auth.connect(sock, SECRET, "ringweave", {"test": "raw"}, "store")
    return sock


async def read_until_closed(sock: socket.socket, timeout_s: float = 3.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                chunk = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
    return bytes(got)


def error_frame(data: bytes) -> dict:
    from runtime.store_protocol import RESPONSE_SCHEMA
    header, _ = wire.decode(data, RESPONSE_SCHEMA)
    return header


async def eventually(predicate, timeout_s: float = 2.0) -> None:
    """Polls a server-side condition that follows a client's action asynchronously (tests only)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def assert_serving(srv: StoreServer) -> None:
    async with await client(srv) as store:
        await store.set("alive", b"yes")
        assert await store.get("alive") == b"yes"


# -- authentication ------------------------------------------------------------


async def test_wrong_secret_is_refused_and_others_keep_working(server):
    good = await client(server)
    try:
        await good.set("k", b"v")
        with pytest.raises(AuthenticationError):
            await client(server, secret=b"wrong", connect_timeout_s=2.0)
        with pytest.raises(AuthenticationError):
            await client(server, secret=None, connect_timeout_s=2.0)
        with pytest.raises(AuthenticationError, match="job"):
            await client(server, job="another-job", connect_timeout_s=2.0)
        assert await good.get("k") == b"v"
        await assert_serving(server)
        assert server.statistics().rejected >= 1
    finally:
        await good.close()


async def test_no_secret_only_on_loopback():
    async with StoreServer("127.0.0.1", 0, secret=None) as srv:
        async with await TCPStore.connect(srv.host, srv.port, secret=None, timeout_s=5.0) as store:
            assert await store.add("n") == 1
    with pytest.raises(AuthenticationError, match="RINGWEAVE_SECRET"):
        await StoreServer("0.0.0.0", 0, secret=None).start()


# -- hostile and broken clients --------------------------------------------------


async def test_silent_client_is_dropped_after_the_handshake_deadline(server):
    sock = await net.connect(server.host, server.port, 5.0, "store")
    try:
        start = time.monotonic()
        await assert_serving(server)  # others are served while it sits there
        data = await read_until_closed(sock, timeout_s=3.0)  # the hello, then the close
        assert time.monotonic() - start < 0.3 * 1.5 + 0.5
        assert data  # it did get the hello
    finally:
        sock.close()
    assert server.statistics().handshaking == 0


async def test_garbage_before_the_handshake(server):
    sock = await net.connect(server.host, server.port, 5.0, "store")
    try:
        await asyncio.get_running_loop().sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
        await read_until_closed(sock)
    finally:
        sock.close()
    await assert_serving(server)


@pytest.mark.parametrize("what", ["garbage", "bad_version", "huge_header", "oversized_payload",
                                  "payload_on_num", "value_past_limit", "not_msgpack", "unknown_kind",
                                  "wrong_field_type", "missing_field", "keys_not_str"])
async def test_malformed_frames_are_rejected(server, what):
    def prefix(hlen: int, plen: int, version: int = wire.VERSION) -> bytes:
        return wire.PREFIX.pack(wire.MAGIC, version, hlen, plen)

    frames = {
        "garbage": b"\xde\xad\xbe\xef" * 8,
        "bad_version": prefix(4, 0, version=99) + b"abcd",
        "huge_header": prefix(wire.MAX_HEADER_NBYTES + 1, 0),
        "oversized_payload": wire.encode_head({"k": "set", "i": 1, "key": "k"}, 2**62),
        "payload_on_num": wire.encode_head({"k": "num", "i": 1}, 10) + b"x" * 10,
        "value_past_limit": wire.encode_head({"k": "set", "i": 1, "key": "k"}, server.max_value_nbytes + 1),
        "not_msgpack": prefix(3, 0) + b"\xc1\xc1\xc1",
        "unknown_kind": wire.encode_head({"k": "drop_tables", "i": 1}),
        "wrong_field_type": wire.encode_head({"k": "get", "i": 1, "key": 42, "t": 1.0}),
        "missing_field": wire.encode_head({"k": "add", "i": 1, "key": "n"}),
        "keys_not_str": None,  # a request error, not a frame error: answered, connection kept
    }
    good = await client(server)
    sock = await raw_authenticated(server)
    loop = asyncio.get_running_loop()
    try:
        await good.set("before", b"kept")
        if what == "keys_not_str":
            await loop.sock_sendall(sock, wire.encode_head({"k": "check", "i": 5, "keys": [1, 2]}))
            head = await loop.sock_recv(sock, 4096)
            reply = error_frame(head)
            assert reply["k"] == "err" and reply["i"] == 5 and reply["type"] == "bad_request"
            await loop.sock_sendall(sock, wire.encode_head({"k": "num", "i": 6}))
            reply = error_frame(await loop.sock_recv(sock, 4096))
            assert reply["k"] == "ok" and reply["i"] == 6
        else:
            await loop.sock_sendall(sock, frames[what])
            data = await read_until_closed(sock)
            if data:  # the server says why before it hangs up
                reply = error_frame(data)
                assert reply["k"] == "err" and reply["i"] == 0 and reply["type"] == "bad_frame"
                if what in ("oversized_payload", "value_past_limit"):
                    assert "limit" in reply["msg"]
        assert await good.get("before") == b"kept"  # nothing stored was lost
        await assert_serving(server)
    finally:
        sock.close()
        await good.close()


async def read_reply(sock: socket.socket) -> tuple[dict, float]:
    """The next reply frame the server sends on a raw socket, and when it came (time.monotonic())."""
    from runtime.store_protocol import RESPONSE_SCHEMA
    prefix = await auth.recv_exact(sock, wire.PREFIX_NBYTES, "store", "a reply")
    hlen, plen = wire.parse_prefix(prefix, 1024)
    header = wire.parse_header(await auth.recv_exact(sock, hlen, "store", "a reply"), RESPONSE_SCHEMA)
    if plen:
        await auth.recv_exact(sock, plen, "store", "a reply")
    return header, time.monotonic()


async def test_the_server_answers_a_wait_past_its_deadline_naming_only_the_missing_keys(server):
    """The server's own timeout reply, without a client that could make it up: one deadline for all
    the keys of a wait, the keys still missing then (not those present), how long it waited."""
    t = 0.3
    async with await client(server) as good:
        await good.set("present", b"")
        sock = await raw_authenticated(server)
        loop = asyncio.get_running_loop()
        try:
            start = time.monotonic()
            await loop.sock_sendall(sock, b"".join(
                wire.encode({"k": "wait", "i": 7, "keys": ["present", "m1", "m2"], "t": t})
                + wire.encode({"k": "get", "i": 8, "key": "g", "t": t})))
            async with asyncio.timeout(5.0):
                replies = [await read_reply(sock), await read_reply(sock)]
            by_id = {h["i"]: (h, at - start) for h, at in replies}
            for i, missing, call in ((7, ["m1", "m2"], "wait(3 keys)"), (8, ["g"], "get('g')")):
                reply, took = by_id[i]
                assert (reply["k"], reply["type"], list(reply["keys"])) == ("err", "timeout", missing)
                assert t * 0.95 <= reply["waited"] <= took, (reply["waited"], took)
                assert t * 0.95 <= took <= t + 2.0, took
                assert call in reply["msg"] and "present" not in reply["msg"]
            await loop.sock_sendall(sock, b"".join(wire.encode({"k": "wait", "i": 9, "keys": ["m3"], "t": 0})))
            reply, _ = await read_reply(sock)  # t = 0: look once, answer at once
            assert (reply["i"], reply["type"], list(reply["keys"])) == (9, "timeout", ["m3"])
            assert server.statistics().waiting == 0
        finally:
            sock.close()


async def test_truncated_frame_then_disconnect(server):
    sock = await raw_authenticated(server)
    loop = asyncio.get_running_loop()
    frame = b"".join(wire.encode({"k": "set", "i": 1, "key": "half"}, b"x" * 1000))
    await loop.sock_sendall(sock, frame[:500])
    sock.close()
    await asyncio.sleep(0.1)
    await assert_serving(server)
    async with await client(server) as store:
        assert not await store.check(["half"])  # a half-sent set stores nothing
    await eventually(lambda: server.statistics().clients == 0)


async def test_oversized_prefix_allocates_nothing(server):
    """A prefix announcing 4 GiB must be refused from its 16 bytes alone."""
    import tracemalloc
    sock = await raw_authenticated(server)
    tracemalloc.start()
    try:
        await asyncio.get_running_loop().sock_sendall(
            sock, wire.encode_head({"k": "set", "i": 1, "key": "k"}, 4 * 1024**3))
        await read_until_closed(sock)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        sock.close()
    assert peak < 16 * 1024**2, peak


async def test_value_past_the_server_limit_names_it():
    async with StoreServer("127.0.0.1", 0, secret=SECRET, max_value_nbytes=1024) as srv:
        # a client that believes in a larger limit: the server hangs up, saying why
        store = await client(srv, max_value_nbytes=1 << 20)
        try:
            with pytest.raises(StoreError, match="limit is 1024"):
                await store.set("big", b"x" * 2048)
        finally:
            await store.close()
        # a client that knows the limit refuses before sending and stays usable
        store = await client(srv, max_value_nbytes=1024)
        try:
            with pytest.raises(StoreError, match="limit is 1024"):
                await store.set("big", b"x" * 2048)
            await store.set("small", b"x" * 1024)
            assert len(await store.get("small")) == 1024
        finally:
            await store.close()


async def test_waits_per_client_are_bounded():
    async with StoreServer("127.0.0.1", 0, secret=SECRET, max_waits_per_client=2) as srv:
        async with await client(srv) as store:
            tasks = [asyncio.get_running_loop().create_task(store.get(f"w{i}", timeout_s=5.0)) for i in range(2)]
            await asyncio.sleep(0.1)
            with pytest.raises(StoreError, match="max_waits_per_client=2"):
                await store.get("w2", timeout_s=5.0)
            await store.set("w0", b"0")
            await store.set("w1", b"1")
            assert [await t for t in tasks] == [b"0", b"1"]


async def test_max_clients():
    async with StoreServer("127.0.0.1", 0, secret=SECRET, max_clients=2) as srv:
        a, b = await client(srv), await client(srv)
        with pytest.raises(ConnectError, match=f"127.0.0.1:{srv.port}"):
            await client(srv, connect_timeout_s=0.5)
        await a.close()
        await asyncio.sleep(0.05)
        c = await client(srv, connect_timeout_s=2.0)  # a slot is free again
        await c.set("k", b"v")
        assert await b.get("k") == b"v"
        await b.close()
        await c.close()


# -- clients and servers that come and go ---------------------------------------


async def test_key_set_before_a_client_dies_is_kept(server):
    dying = await client(server)
    await dying.set("legacy", b"from the dead")
    pending = asyncio.get_running_loop().create_task(dying.get("never", timeout_s=10.0))
    await asyncio.sleep(0.05)
    assert server.statistics().waiting == 1
    dying._writer.transport.abort()  # the process dies: no goodbye
    with pytest.raises(StoreError):
        await pending
    await eventually(lambda: server.statistics().waiting == 0)  # its wait went with it
    await eventually(lambda: server.statistics().clients == 0)
    async with await client(server) as store:
        assert await store.get("legacy") == b"from the dead"
    await dying.close()


async def test_cancelled_get_is_dropped_on_the_server(server):
    async with await client(server) as store:
        task = asyncio.get_running_loop().create_task(store.get("never", timeout_s=10.0))
        await asyncio.sleep(0.05)
        assert server.statistics().waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.num_keys()  # the cancel went out before this request; the server handled both
        assert server.statistics().waiting == 0


async def test_connect_retries_until_a_late_server_is_up():
    probe = net.listen("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()

    async def start_late() -> StoreServer:
        await asyncio.sleep(0.5)
        return await StoreServer("127.0.0.1", port, secret=SECRET).start()

    start = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        late = tg.create_task(start_late())
        store = await TCPStore.connect("127.0.0.1", port, secret=SECRET, timeout_s=5.0)
    srv = late.result()
    try:
        assert time.monotonic() - start >= 0.45
        await store.set("k", b"v")
        assert await store.get("k") == b"v"
    finally:
        await store.close()
        await srv.close()


async def test_connect_gives_up_naming_the_address():
    probe = net.listen("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    start = time.monotonic()
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        await TCPStore.connect("127.0.0.1", port, secret=SECRET, timeout_s=0.5)
    assert time.monotonic() - start < 0.5 * 1.5


async def test_server_close_fails_pending_and_later_calls_fast():
    srv = await StoreServer("127.0.0.1", 0, secret=SECRET).start()
    store = await client(srv)
    try:
        pending = asyncio.get_running_loop().create_task(store.get("never", timeout_s=30.0))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        await srv.close()
        with pytest.raises(StoreError, match=f"127.0.0.1:{srv.port}.*closing"):
            await pending
        assert time.monotonic() - start < 1.0
        with pytest.raises(StoreError, match=f"127.0.0.1:{srv.port}"):
            await store.set("k", b"v")
        assert not isinstance(StoreError, ClosedError)
    finally:
        await store.close()


async def test_silent_server_times_out_on_the_client():
    """A server that shakes hands and then never answers: the client's own timeout fires."""
    listener = net.listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()
    accepted: list[socket.socket] = []

    async def mute_server() -> None:
        sock, _ = await loop.sock_accept(listener)
        accepted.append(sock)
        await auth.accept(sock, SECRET, "ringweave", "mute")
        await asyncio.sleep(3600)

    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(mute_server())
        store = await TCPStore.connect("127.0.0.1", port, secret=SECRET, timeout_s=0.4)
        try:
            start = time.monotonic()
            with pytest.raises(StoreTimeoutError) as info:
                await store.get("k")
            assert time.monotonic() - start <= 0.4 * 1.5
            assert info.value.keys == ["k"]
            with pytest.raises(StoreTimeoutError, match="did not answer set"):
                await store.set("k", b"v")
        finally:
            await store.close()
            task.cancel()
    for s in accepted:
        s.close()
    listener.close()


async def test_many_clients_at_once(server):
    n = 100
    clients = await asyncio.gather(*(client(server) for _ in range(n)))
    try:
        counts = await asyncio.gather(*(c.add("arrived") for c in clients))
        assert sorted(counts) == list(range(1, n + 1))
        # a barrier: everyone waits for the last one's key
        async with asyncio.TaskGroup() as tg:
            waits = [tg.create_task(c.wait(["go"], timeout_s=5.0)) for c in clients]
            await clients[0].set("go", b"")
        assert all(w.done() for w in waits)
        assert server.statistics().clients == n
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def test_concurrent_requests_on_one_client_match_their_replies(server):
    async with await client(server) as store:
        async def roundtrip(i: int) -> None:
            value = struct.pack("<I", i) * (i % 7)
            await store.set(f"k{i}", value)
            assert await store.get(f"k{i}") == value
        async with asyncio.TaskGroup() as tg:
            for i in range(300):
                tg.create_task(roundtrip(i))
        assert store.statistics().in_flight == 0
        assert await store.num_keys() == 300


def test_request_header_kinds_are_schema_checked():
    from runtime.store_protocol import REQUEST_SCHEMA
    ok = wire.parse_header(msgpack.packb({"k": "wait", "i": 1, "keys": ["a"], "t": 1}), REQUEST_SCHEMA)
    assert ok["keys"] == ("a",)
    with pytest.raises(Exception):
        wire.parse_header(msgpack.packb({"k": "wait", "i": 1, "keys": "a", "t": 1}), REQUEST_SCHEMA)


async def test_fuzzed_frames_never_hurt_the_server(server):
    """Valid request frames with random bytes flipped, cut short or appended,
    each on its own authenticated connection: the server may answer or hang
    up, but it keeps serving and keeps what it stored."""
    import random
    rng = random.Random(1234)
    valid = [b"".join(wire.encode(h, p)) for h, p in [
        ({"k": "set", "i": 1, "key": "k"}, b"value"),
        ({"k": "get", "i": 2, "key": "k", "t": 0.01}, b""),
        ({"k": "add", "i": 3, "key": "n", "n": 2}, b""),
        ({"k": "cas", "i": 4, "key": "k", "ne": 5}, b"valuenew"),
        ({"k": "wait", "i": 5, "keys": ["k", "n"], "t": 0.01}, b""),
        ({"k": "check", "i": 6, "keys": ["k"]}, b""),
        ({"k": "del", "i": 7, "key": "gone"}, b""),
        ({"k": "num", "i": 8}, b""),
    ]]
    async with await client(server) as keeper:
        await keeper.set("sentinel", b"kept")
        loop = asyncio.get_running_loop()
        for case in range(150):
            data = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                how = rng.random() if data else 1.0
                if how < 0.6:
                    data[rng.randrange(len(data))] = rng.randrange(256)
                elif how < 0.8:
                    del data[rng.randrange(len(data)):]
                else:
                    data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
            sock = await raw_authenticated(server)
            try:
                if data:
                    await loop.sock_sendall(sock, bytes(data))
            finally:
                sock.close()
        assert await keeper.get("sentinel") == b"kept"
        await assert_serving(server)
        await eventually(lambda: server.statistics().clients == 1)


async def test_a_request_too_large_to_frame_is_refused_and_the_client_stays_usable(server):
    async with await client(server) as store:
        keys = [f"rank/{r}/a-rather-long-key-name" for r in range(5000)]  # a header past 64 KiB
        with pytest.raises(StoreError, match="cannot be sent"):
            await store.wait(keys, timeout_s=0.1)
        await store.set("k", b"v")
        assert await store.get("k") == b"v"


async def test_max_clients_counts_a_client_handed_over_but_not_yet_taken(monkeypatch):
    """A client whose handshake is done but whose hand-over to the store's loop has not run yet is
    held all the same: the next client past max_clients is refused (it was admitted in that gap)."""
    from runtime import acceptor

    take = acceptor.Acceptor._take

    def late_take(self, sock, who, where):  # the loop busy elsewhere: the hand-over runs 0.5 s late
        asyncio.get_running_loop().call_later(0.5, take, self, sock, who, where)

    monkeypatch.setattr(acceptor.Acceptor, "_take", late_take)
    async with StoreServer("127.0.0.1", 0, secret=SECRET, max_clients=1) as srv:
        a = await client(srv)
        with pytest.raises(ConnectError, match=f"127.0.0.1:{srv.port}"):
            await client(srv, connect_timeout_s=0.3)
        await a.close()
