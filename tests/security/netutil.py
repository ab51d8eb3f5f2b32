"""Small helpers of the security tests: who listens where (from /proc), process memory and
file descriptors, and the raw frames an attacker sends.

Not here: what the tests expect of them (the test files say that).
"""

from __future__ import annotations

import os
import socket
import struct

from runtime import wire

_TCP_LISTEN = "0A"


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _decode_addr(hex_addr: str, v6: bool) -> str:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if v6:  # four little-endian 32-bit words
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{int(port_hex, 16)}"
    return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port_hex, 16)}"


def listening(pid: int, netns_pid: int | None = None) -> list[str]:
    """The TCP addresses ``pid`` listens on, e.g. ``["127.0.0.1:43121"]`` (what ``ss -ltnp`` shows)."""
    mine = _socket_inodes(pid)
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(f"/proc/{netns_pid or pid}/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _TCP_LISTEN and int(cols[9]) in mine:
                out.append(_decode_addr(cols[1], v6))
    return sorted(out)


def is_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host == "::1"


# -- what an attacker writes ------------------------------------------------------------

def prefix(header_len: int, payload_len: int, magic: bytes = wire.MAGIC, version: int = wire.VERSION) -> bytes:
    return struct.pack("<3sBIQ", magic, version, header_len, payload_len)


def truncated_frame() -> bytes:
    """A prefix announcing a 100-byte header, then 10 bytes of it (the sender then closes)."""
    return prefix(100, 0) + b"\x81\xa1k\xa4auth" + b"\x00" * 3


HUGE_HEADER = prefix(2**32 - 1, 0)           # a 4 GiB header
HUGE_PAYLOAD = prefix(10, 2**63)              # an 8 EiB payload
