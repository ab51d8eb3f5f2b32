"""The frame format: round trips under hypothesis, and every malformed frame
rejected with BadFrameError saying which check failed."""

import struct

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from runtime import wire
from runtime.actor import SCHEMA
from runtime.errors import BadFrameError

tags = st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=20),
                 st.tuples(st.integers(0, 2**31), st.integers(0, 2**31)))


@settings(max_examples=300, deadline=None)
@given(tag=tags, payload=st.binary(max_size=4096), meta=st.none() | st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1)))
def test_data_frame_round_trips(tag, payload, meta):
    header = {"k": "d", "t": tag}
    if meta is not None:
        header["m"] = meta
    frame = b"".join(bytes(b) for b in wire.encode(header, payload))
    got, body = wire.decode(frame, SCHEMA)
    assert got == header and bytes(body) == payload


def test_encode_does_not_copy_the_payload():
    payload = bytearray(b"abcd")
    parts = wire.encode({"k": "d", "t": 1}, payload)
    payload[0] = ord("z")  # the frame's payload part is a view of the caller's buffer
    assert bytes(parts[1]) == b"zbcd"


def frame(header_bytes: bytes, payload: bytes = b"", magic=wire.MAGIC, version=wire.VERSION, plen=None):
    plen = len(payload) if plen is None else plen
    return struct.pack("<3sBIQ", magic, version, len(header_bytes), plen) + header_bytes + payload


GOOD = msgpack.packb({"k": "d", "t": 1})


@pytest.mark.parametrize("data, message", [
    (frame(GOOD, magic=b"XYZ"), "magic"),
    (frame(GOOD, version=9), "version"),
    (frame(b""), "header of 0 bytes"),
    (struct.pack("<3sBIQ", wire.MAGIC, 1, wire.MAX_HEADER_NBYTES + 1, 0), "header of"),
    (frame(GOOD, plen=2**62), "payload of"),
    (frame(b"\xc1"), "not msgpack"),
    (frame(msgpack.packb([1, 2])), "expected a map"),
    (frame(msgpack.packb({"k": "zz"})), "unknown kind"),
    (frame(msgpack.packb({"k": "d"})), "lacks required field 't'"),
    (frame(msgpack.packb({"k": "d", "t": 1, "evil": 2})), "no field 'evil'"),
    (frame(msgpack.packb({"k": "d", "t": 1.5})), "field 't'"),
    (frame(msgpack.packb({"k": "c", "t": 1, "f": "x"})), "field 't'"),
    (frame(msgpack.packb({"k": "q", "i": True, "n": "x"})), "field 'i'"),
    (frame(msgpack.packb({1: 2})), "not msgpack"),
    (frame(GOOD)[:10], "truncated prefix"),
    (frame(GOOD, b"abc")[:-1], "announces"),
    (frame(GOOD) + b"x", "announces"),
])
def test_malformed_frames_are_rejected(data, message):
    with pytest.raises(BadFrameError, match=message):
        wire.decode(data, SCHEMA, max_payload_nbytes=1 << 30)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        wire.decode(data, SCHEMA)
    except BadFrameError:
        pass


def test_oversized_header_is_refused_when_encoding():
    with pytest.raises(BadFrameError, match="limit"):
        wire.encode_head({"k": "d", "t": "x" * (wire.MAX_HEADER_NBYTES + 10)})


def test_schema_checks_follow_the_schema_not_a_stale_cache_entry(monkeypatch):
    """The compiled checks are cached per schema map; an entry left by a map that was freed
    (whose id a new map may get) must not apply to the new one."""
    strict = {"x": (int, True)}
    loose = {"x": (str, True)}
    schema = {"m": strict}
    header = msgpack.packb({"k": "m", "x": "text"})
    with pytest.raises(BadFrameError, match="field 'x' of kind 'm' is str"):
        wire.parse_header(header, schema)
    stale = {"x": (str, True)}  # a different map that allowed str, cached under strict's id
    monkeypatch.setitem(wire._fast_specs, id(strict), (stale, *wire._compile(loose)))
    with pytest.raises(BadFrameError, match="field 'x' of kind 'm' is str"):
        wire.parse_header(header, schema)
