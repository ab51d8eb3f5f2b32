"""Small helpers of the security tests (and bench/security.py): who listens where (from /proc),
process memory and file descriptors, the raw frames an attacker sends, and an attacker who
squats shared-memory names.

Not here: what the tests expect of them (the test files say that).
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
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


def squat_shm_names(prefix: str, ranks: int, min_log2: int, shm_dir: str = "/dev/shm") -> dict:
    """Run as another user: watches ``shm_dir`` with inotify and, for each name of the job
    (``prefix``) created there, creates the names a domain-wide part of it would give away:
    every rank's control file and data slots of 12 sizes from ``2**min_log2``. Makes
    ``<prefix>ready`` once it watches; returns ``{"seen": names of the job seen, "made": files
    made}`` when sent SIGTERM."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    if fd < 0 or libc.inotify_add_watch(fd, shm_dir.encode(), 0x100) < 0:  # IN_CREATE
        raise OSError(ctypes.get_errno(), f"inotify on {shm_dir}")
    shape = re.compile(r"^(.*-g\d+d\d+-r)\d+-(ctl|v\d+)$")
    seen, mine = [], set()

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with open(os.path.join(shm_dir, prefix + "ready"), "w"):
        pass
    try:
        while True:
            select.select([fd], [], [], 0.1)
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            pos = 0
            while pos < len(data):  # struct inotify_event: wd, mask, cookie, len; then the name
                n = struct.unpack_from("iIII", data, pos)[3]
                name = data[pos + 16:pos + 16 + n].rstrip(b"\0").decode()
                pos += 16 + n
                m = shape.match(name) if name.startswith(prefix) and name not in mine else None
                if m is None:
                    continue
                seen.append(name)
                for r in range(ranks):
                    for what in ["ctl"] + [f"v{k}" for k in range(min_log2, min_log2 + 12)]:
                        guess = f"{m.group(1)}{r}-{what}"
                        try:
                            os.close(os.open(os.path.join(shm_dir, guess), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                                             0o644))
                            mine.add(guess)
                        except FileExistsError:
                            pass
    except KeyboardInterrupt:
        return {"seen": len(seen), "made": len(mine)}
