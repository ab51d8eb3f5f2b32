"""The frame: the only thing ringweave puts on a socket.

A frame is three parts back to back::

    prefix   16 bytes, little endian   magic b"RWV" | version u8 | header_len u32 | payload_len u64
    header   header_len bytes          a msgpack map; its "k" field names the kind of frame
    payload  payload_len bytes         raw bytes (an array's memory, a store value), never parsed

Worked example: a 4-byte payload with header ``{"k": "d", "t": 7}`` is
``b"RWV" 01 | 06 00 00 00 | 04 00 00 00 00 00 00 00`` then the 6 header bytes
``81 a1 6b a1 64 ...`` then the 4 payload bytes.

Encoding never copies the payload: :func:`encode_head` returns the prefix and
header as one small ``bytes`` and the caller writes the payload buffer after
it. Decoding checks, in this order, the magic, the version, the header limit,
the payload limit, that the header is msgpack, that it is a map with string
keys, and that it follows the schema of its kind; anything else raises
:class:`BadFrameError` saying which check failed and the value that failed it.

This module deliberately knows nothing of sockets, tasks or NumPy, and never
unpickles anything.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import msgpack

from runtime.errors import BadFrameError

MAGIC = b"RWV"
VERSION = 1
PREFIX = struct.Struct("<3sBIQ")
PREFIX_NBYTES = PREFIX.size  # 16
_PREFIX_PACK = PREFIX.pack

MAX_HEADER_NBYTES = 64 * 1024  # headers are small maps; anything larger is hostile
DEFAULT_MAX_PAYLOAD_NBYTES = 16 * 1024**3  # 16 GiB; each protocol passes its own limit

ANY = object()  # schema marker: any msgpack value
Schema = Mapping[str, Mapping[str, tuple]]  # kind -> field -> (allowed types..., required)


_packer = msgpack.Packer(use_bin_type=True)  # reused: packb() would build a Packer per frame


def pack_header(header: Mapping[str, Any]) -> bytes:
    """The msgpack bytes of a header; callers that send many frames with one
    header (a collective call) pack it once and pass the bytes to encode_head.

    Raises:
        BadFrameError: the packed header is over MAX_HEADER_NBYTES.
    """
    packed = _packer.pack(header)
    if len(packed) > MAX_HEADER_NBYTES:
        raise BadFrameError(
            f"header of kind {header.get('k')!r} is {len(packed)} bytes; the limit is {MAX_HEADER_NBYTES}")
    return packed


def encode_head(header: Mapping[str, Any] | bytes, payload_nbytes: int = 0) -> bytes:
    """Returns prefix + packed header for a frame whose payload has
    ``payload_nbytes`` bytes; ``header`` is a map or what pack_header made of it.
    The payload itself is written by the caller."""
    packed = header if type(header) is bytes else pack_header(header)
    return _PREFIX_PACK(MAGIC, VERSION, len(packed), payload_nbytes) + packed


def encode(header: Mapping[str, Any], payload: bytes | bytearray | memoryview = b"") -> list:
    """Returns the buffers of a whole frame: ``[head, payload]`` (payload not copied)."""
    mv = memoryview(payload).cast("B") if len(payload) else memoryview(b"")
    return [encode_head(header, mv.nbytes), mv]


def parse_prefix(buf, max_payload_nbytes: int = DEFAULT_MAX_PAYLOAD_NBYTES, where: str = "",
                 max_header_nbytes: int = MAX_HEADER_NBYTES) -> tuple[int, int]:
    """Parses the 16-byte prefix. Returns ``(header_len, payload_len)``.

    Args:
        max_header_nbytes: a smaller header limit than MAX_HEADER_NBYTES (the handshake's).
    Raises:
        BadFrameError: wrong magic or version, header or payload over its limit.
    """
    magic, version, header_len, payload_len = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadFrameError(f"bad frame{where}: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise BadFrameError(f"bad frame{where}: version {version}, this build speaks {VERSION}")
    if header_len == 0 or header_len > max_header_nbytes:
        raise BadFrameError(f"bad frame{where}: header of {header_len} bytes, limit 1..{max_header_nbytes}")
    if payload_len > max_payload_nbytes:
        raise BadFrameError(
            f"bad frame{where}: payload of {payload_len} bytes, limit {max_payload_nbytes}")
    return header_len, payload_len


SHOWN_CHARS = 100  # of a value a sender chose, in an error or a log line


def shown(value: Any) -> str:
    """``repr(value)`` cut to SHOWN_CHARS characters, saying how long it was: what a sender
    chose goes into errors and logs, and must not make them as long as a header."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def _type_ok(value: Any, allowed: tuple) -> bool:
    if ANY in allowed:
        return True
    t = type(value)
    if t is bool:  # bool is an int subclass; only accept it where asked for
        return bool in allowed
    return t in allowed


# id(fields) -> (fields, types, required). The fields map itself is kept in the entry: keyed by
# id() alone, a schema that was freed could hand its id to a new one and its checks with it.
_fast_specs: dict[int, tuple[Mapping, dict, frozenset]] = {}
_ANY_TYPE = frozenset()  # in a compiled spec: the field takes any value


def _compile(fields: Mapping[str, tuple]) -> tuple[dict, frozenset]:
    """field -> exact allowed types ("k" included; _ANY_TYPE where any value goes), and the
    required names ("k" included)."""
    types = {"k": frozenset((str,))}
    for name, spec in fields.items():
        allowed = spec[:-1]
        types[name] = _ANY_TYPE if ANY in allowed else frozenset(allowed)
    return types, frozenset(["k", *(name for name, spec in fields.items() if spec[-1])])


def parse_header(buf, schema: Schema, where: str = "") -> dict:
    """Unpacks and schema-checks a header. Returns the header map.

    ``schema[kind][field] = (type, ..., required: bool)``; unknown kinds and
    unknown fields are rejected.

    Raises:
        BadFrameError: not msgpack, not a map with string keys, unknown kind,
            a missing required field, an unknown field, or a field of the wrong type.
    """
    try:
        header = msgpack.unpackb(buf, raw=False, use_list=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadFrameError(
            f"bad frame{where}: header is not msgpack ({type(exc).__name__}: {str(exc)[:SHOWN_CHARS]})") from None
    if type(header) is not dict:
        raise BadFrameError(f"bad frame{where}: header is a {type(header).__name__}, expected a map")
    kind = header.get("k")
    fields = schema.get(kind) if type(kind) is str else None
    if fields is None:
        raise BadFrameError(f"bad frame{where}: unknown kind {shown(kind)}; known: {sorted(schema)}")
    fast = _fast_specs.get(id(fields))
    if fast is None or fast[0] is not fields:
        fast = _fast_specs[id(fields)] = (fields, *_compile(fields))
    _, types, required = fast
    # The fast path: every field known and of an allowed type, and the required ones there.
    # Anything else goes to the slow path, which says what is wrong.
    for name, value in header.items():
        allowed = types.get(name)
        if allowed is None or (type(value) not in allowed and allowed is not _ANY_TYPE):
            break
    else:
        if header.keys() >= required:
            return header
    for name, value in header.items():  # the slow path says exactly what is wrong
        if name == "k":
            continue
        spec = fields.get(name)
        if spec is None:
            raise BadFrameError(f"bad frame{where}: kind {kind!r} has no field {shown(name)}")
        if not _type_ok(value, spec[:-1]):
            raise BadFrameError(
                f"bad frame{where}: field {name!r} of kind {kind!r} is {type(value).__name__}, "
                f"expected {'/'.join(t.__name__ for t in spec[:-1] if t is not ANY)}")
    for name, spec in fields.items():
        if spec[-1] and name not in header:
            raise BadFrameError(f"bad frame{where}: kind {kind!r} lacks required field {name!r}")
    return header


def decode(frame: bytes | bytearray | memoryview, schema: Schema,
           max_payload_nbytes: int = DEFAULT_MAX_PAYLOAD_NBYTES) -> tuple[dict, memoryview]:
    """Decodes one whole frame held in memory (tests, fuzzing, the store).

    Returns ``(header, payload)`` where payload is a view into ``frame``.

    Raises:
        BadFrameError: any check above, a truncated frame, or trailing bytes.
    """
    mv = memoryview(frame).cast("B")
    if mv.nbytes < PREFIX_NBYTES:
        raise BadFrameError(f"bad frame: truncated prefix ({mv.nbytes} of {PREFIX_NBYTES} bytes)")
    hlen, plen = parse_prefix(mv, max_payload_nbytes)
    if mv.nbytes != PREFIX_NBYTES + hlen + plen:
        raise BadFrameError(
            f"bad frame: {mv.nbytes} bytes, the prefix announces {PREFIX_NBYTES + hlen + plen}")
    header = parse_header(mv[PREFIX_NBYTES:PREFIX_NBYTES + hlen], schema)
    return header, mv[PREFIX_NBYTES + hlen:]
