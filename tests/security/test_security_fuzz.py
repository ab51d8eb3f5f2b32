"""Fuzzing the frame decoder and the store protocol: no crash, no unbounded allocation.

Three fuzzers, each fast enough for CI and each printing what it ran:

* ``runtime.wire.decode`` under a seeded mutation loop (FRAMES inputs): valid
  frames of every schema on the network (rank-to-rank, tool, store requests and
  replies, handshake) with bytes flipped, cut, inserted, spliced, prefixes
  rewritten with hostile lengths and headers replaced with hostile msgpack
  (deep nesting, containers announcing 2**32 elements). Each input must decode
  or raise BadFrameError; tracemalloc's peak and the RSS growth are bounded.
* the store server's request parsing (``StoreServer._serve_requests``, the loop
  every authenticated connection runs) under the same kind of loop
  (STORE_INPUTS inputs of 1-4 mutated requests on their own connection): it
  must return (having answered or dropped the client) within 2 s, never raise,
  and every byte it writes back must be well-formed reply frames.
* hypothesis (500 examples; the two loops above are the 10,000-input fuzzers):
  structure-aware headers (any msgpack map, plausible field names)
  must decode or be refused with BadFrameError.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from runtime import auth, wire
from runtime.actor import SCHEMA as RANK_SCHEMA
from runtime.actor import TOOL_SCHEMA
from runtime.errors import BadFrameError
from runtime.store_protocol import REQUEST_SCHEMA, RESPONSE_SCHEMA
from runtime.store_server import StoreServer, _Conn

FRAMES = 12_000
STORE_INPUTS = 10_000
PEAK_BOUND = 8 * 1024**2        # tracemalloc peak of the whole decode loop
RSS_GROWTH_BOUND = 32 * 1024**2  # max RSS growth of this process over a fuzzer
SEED = 20240607

SEEDS = [  # (schema, header, payload): one valid frame of every kind on the network
    (RANK_SCHEMA, {"k": "d", "t": 7, "m": {"a": 1}}, b"\x01\x02\x03\x04"),
    (RANK_SCHEMA, {"k": "o", "t": "tag"}, msgpack.packb([1, "x"])),
    (RANK_SCHEMA, {"k": "c", "t": (0, 12), "f": "all_reduce op=sum dtype=float32 count=4"}, b"\0" * 16),
    (RANK_SCHEMA, {"k": "q", "i": 3, "n": "ringweave.status"}, msgpack.packb([])),
    (RANK_SCHEMA, {"k": "r", "i": 3, "e": "KeyError: x"}, b""),
    (RANK_SCHEMA, {"k": "a", "g": 0, "m": "mismatch", "x": "mismatch"}, b""),
    (RANK_SCHEMA, {"k": "b"}, b""),
    (TOOL_SCHEMA, {"k": "q", "i": 1, "n": "ringweave.status"}, msgpack.packb([])),
    (REQUEST_SCHEMA, {"k": "set", "i": 1, "key": "addr/0"}, b"value"),
    (REQUEST_SCHEMA, {"k": "get", "i": 2, "key": "addr/0", "t": 0.5}, b""),
    (REQUEST_SCHEMA, {"k": "add", "i": 3, "key": "n", "n": 2}, b""),
    (REQUEST_SCHEMA, {"k": "cas", "i": 4, "key": "k", "ne": 5}, b"valuenew"),
    (REQUEST_SCHEMA, {"k": "wait", "i": 5, "keys": ("a", "b"), "t": 0.01}, b""),
    (REQUEST_SCHEMA, {"k": "check", "i": 6, "keys": ("a",)}, b""),
    (REQUEST_SCHEMA, {"k": "del", "i": 7, "key": "gone"}, b""),
    (REQUEST_SCHEMA, {"k": "num", "i": 8}, b""),
    (REQUEST_SCHEMA, {"k": "cancel", "i": 2}, b""),
    (RESPONSE_SCHEMA, {"k": "ok", "i": 1, "v": 3}, b"v"),
    (RESPONSE_SCHEMA, {"k": "err", "i": 0, "type": "bad_frame", "msg": "x", "keys": ("a",), "waited": 1.5}, b""),
    (auth.SCHEMA, {"k": "hello", "n": b"\0" * 16, "job": "j", "auth": True}, b""),
    (auth.SCHEMA, {"k": "auth", "n": b"\1" * 16, "who": {"rank": 1}, "mac": b"\2" * 32}, b""),
]

HOSTILE_HEADERS = [
    b"\x91" * 60_000,                       # 60,000 nested arrays
    b"\x81\xa1k" * 20_000,                   # nested maps
    b"\xdd\xff\xff\xff\xff",                 # array32 announcing 2**32 - 1 elements
    b"\xdf\xff\xff\xff\xff",                 # map32 announcing 2**32 - 1 pairs
    b"\xdb\xff\xff\xff\xff",                 # str32 announcing 4 GiB
    b"\xc6\xff\xff\xff\xff",                 # bin32 announcing 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",             # ext32 announcing 4 GiB
    b"\x81\xa1k\xa1d\xa1t\xcb" + struct.pack(">d", float("nan")),
    b"\x82\xa1k\xa1c\xa1t\xdd\x7f\xff\xff\xff",
    b"\x81\x01\x02",                         # an int key
    b"\xc1",                                 # the never-used byte
]


def encode(header, payload=b"") -> bytes:
    return b"".join(bytes(b) for b in wire.encode(header, payload))


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four random edits of ``data``."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        how = rng.random()
        if how < 0.30 and buf:                                  # flip a byte
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif how < 0.40 and buf:                                # flip a bit
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif how < 0.50:                                        # cut
            del buf[rng.randrange(len(buf) + 1):]
        elif how < 0.60:                                        # insert random bytes
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.randbytes(rng.randint(1, 64))
        elif how < 0.75 and len(buf) >= wire.PREFIX_NBYTES:     # hostile lengths in the prefix
            hlen = rng.choice([0, 1, len(buf) - 16, wire.MAX_HEADER_NBYTES, wire.MAX_HEADER_NBYTES + 1,
                               2**32 - 1, rng.randrange(2**32)])
            plen = rng.choice([0, 1, 2**31, 2**40, 2**63, 2**64 - 1, rng.randrange(2**64)])
            struct.pack_into("<IQ", buf, 4, hlen % 2**32, plen)
        elif how < 0.85:                                        # a hostile header
            head = rng.choice(HOSTILE_HEADERS)
            buf = bytearray(wire.PREFIX.pack(wire.MAGIC, wire.VERSION, len(head), 0) + head)
        else:                                                   # splice two frames
            other = encode(*rng.choice(SEEDS)[1:])
            cut = rng.randrange(len(other) + 1)
            buf = buf[:rng.randrange(len(buf) + 1)] + other[cut:]
    return bytes(buf)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.timeout(120)
def test_decoder_survives_mutated_frames():
    rng = random.Random(SEED)
    seeds = [(schema, encode(h, p)) for schema, h, p in SEEDS]
    outcomes = {"decoded": 0, "BadFrameError": 0}
    rss0 = rss()
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        for i in range(FRAMES):
            schema, frame = rng.choice(seeds)
            data = mutate(rng, frame)
            try:
                header, payload = wire.decode(data, schema, max_payload_nbytes=1 << 20)
            except BadFrameError:
                outcomes["BadFrameError"] += 1
            except Exception as exc:  # anything else is a finding: say which input
                raise AssertionError(f"input #{i} {data[:200]!r}: {type(exc).__name__}: {exc}") from exc
            else:
                assert type(header) is dict and header["k"] in schema and isinstance(payload, memoryview)
                outcomes["decoded"] += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    took, growth = time.monotonic() - t0, rss() - rss0
    print(f"\n== wire.decode: {FRAMES} mutated frames in {took:.1f} s: {outcomes}; "
          f"tracemalloc peak {peak / 2**20:.2f} MiB (bound {PEAK_BOUND / 2**20:.0f}), "
          f"RSS growth {growth / 2**20:.1f} MiB (bound {RSS_GROWTH_BOUND / 2**20:.0f})")
    assert sum(outcomes.values()) == FRAMES >= 10_000
    assert outcomes["decoded"] > 100 and outcomes["BadFrameError"] > 5000, outcomes  # both paths exercised
    assert peak < PEAK_BOUND and growth < RSS_GROWTH_BOUND


class _Transport:
    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass


class _Writer:
    """Keeps what the server writes (the replies), so that they can be checked."""

    def __init__(self):
        self.transport = _Transport()
        self.out = bytearray()

    def writelines(self, bufs) -> None:
        for b in bufs:
            self.out += b

    async def drain(self) -> None:
        pass


def replies(out: bytes) -> list[dict]:
    """Every frame the server wrote, decoded (raises BadFrameError if one is not well-formed)."""
    got, pos = [], 0
    while pos < len(out):
        hlen, plen = wire.parse_prefix(memoryview(out)[pos:pos + wire.PREFIX_NBYTES])
        end = pos + wire.PREFIX_NBYTES + hlen + plen
        header, _ = wire.decode(out[pos:end], RESPONSE_SCHEMA)
        got.append(header)
        pos = end
    return got


async def fuzz_store(server, rng, requests, kinds, counts) -> None:
    for i in range(STORE_INPUTS):
        data = b"".join(mutate(rng, rng.choice(requests)) if rng.random() < 0.8 else rng.choice(requests)
                        for _ in range(rng.randint(1, 4)))
        reader = asyncio.StreamReader(limit=1 << 20)
        reader.feed_data(data)
        reader.feed_eof()  # the client has sent everything and left
        writer = _Writer()
        try:
            async with asyncio.timeout(2.0):
                await server._serve_requests(_Conn(reader, writer, f"fuzz client #{i}"))
        except Exception as exc:
            raise AssertionError(f"input #{i} {data[:200]!r}: {type(exc).__name__}: {exc}") from exc
        got = replies(bytes(writer.out))
        for h in got:
            kinds[h["k"]] = kinds.get(h["k"], 0) + 1
        counts[0] += any(h["k"] == "err" and h["i"] == 0 for h in got)
        counts[1] += bool(got)


@pytest.mark.timeout(120)
async def test_store_request_parsing_survives_mutated_requests():
    rng = random.Random(SEED + 1)
    requests = [encode(h, p) for schema, h, p in SEEDS if schema is REQUEST_SCHEMA]
    server = StoreServer("127.0.0.1", 0, secret=b"fuzz", max_value_nbytes=1 << 16)  # not started: no socket
    kinds: dict[str, int] = {}
    counts = [0, 0]  # dropped for a bad frame, answered
    store_log = logging.getLogger("ringweave.store")
    level = store_log.level
    store_log.setLevel(logging.ERROR)  # 10,000 "disconnected: bad frame" warnings would be kept by pytest
    rss0 = rss()
    t0 = time.monotonic()
    try:
        await fuzz_store(server, rng, requests, kinds, counts)
    finally:
        store_log.setLevel(level)
    dropped, answered = counts
    took, growth = time.monotonic() - t0, rss() - rss0
    st_ = server.statistics()
    await server.close()
    print(f"\n== store request parsing: {STORE_INPUTS} connections of 1-4 mutated requests in {took:.1f} s: "
          f"{answered} answered, {dropped} dropped for a bad frame, replies by kind {kinds}, "
          f"{st_.requests} requests served, {st_.keys} keys kept ({st_.value_nbytes} bytes); "
          f"RSS growth {growth / 2**20:.1f} MiB (bound {RSS_GROWTH_BOUND / 2**20:.0f})")
    assert answered > 1000 and dropped > 1000, (answered, dropped)
    assert growth < RSS_GROWTH_BOUND


_FIELDS = st.sampled_from(["k", "t", "m", "f", "i", "n", "e", "g", "x", "key", "keys", "v", "z"])
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12)
_KINDS = st.sampled_from(sorted(set(RANK_SCHEMA) | set(REQUEST_SCHEMA)) + ["", "zz"])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=_KINDS, fields=st.dictionaries(_FIELDS, _VALUES, max_size=5), payload=st.binary(max_size=64),
       schema=st.sampled_from([RANK_SCHEMA, REQUEST_SCHEMA]))
def test_any_msgpack_header_decodes_or_is_refused(kind, fields, payload, schema):
    header = dict(fields, k=kind)
    try:
        frame = encode(header, payload)
    except (BadFrameError, OverflowError, TypeError, ValueError):
        return  # msgpack cannot pack it (ints past 64 bits): nothing to send
    try:
        got, body = wire.decode(frame, schema)
    except BadFrameError:
        return
    assert got["k"] == kind and kind in schema and bytes(body) == payload
