"""A delay line in user space for bench/netem.py where the kernel has no sch_netem.

    ip netns exec NS python bench/_delayline.py --queue 0 --delay 1ms [--loss 0.1%]

netem.py starts one in each emulated host's namespace, waits for its ``ready`` line, then sends
the host's IPv4 packets on its link through netfilter's queue (iptables ``-j NFQUEUE``: OUTPUT
``-o`` the link, its sends; INPUT ``-i`` the link, its receives). This process holds each
packet's verdict until its arrival + the delay, then accepts it; a lost one (``--loss``) is
dropped at once. Only the verdict is held, never the bytes: the queue copies no payload to user
space (NFQNL_COPY_META) and passes GSO packets whole (NFQA_CFG_F_GSO), so one 64 KiB TCP segment
is one message and the packet rate at 1 Gbit/s stays in the thousands per second. The delay is
the same for every packet, so the queue is first-in first-out and one batch verdict (every id up
to the last one due) releases whatever is due.

The nfnetlink_queue messages are built and parsed here with ``struct`` over an AF_NETLINK socket
(no library, nothing compiled). The rules and this process live in the namespace: deleting it
(netem.py's teardown, SIGTERM first) removes both.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5
NLMSG_ERROR, NLM_F_REQUEST, NLM_F_ACK = 2, 1, 4
SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 1, 2, 3
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND, CMD_UNBIND = 1, 2
COPY_META = 1
F_GSO = 4
PACKET_HDR, VERDICT_HDR = 1, 2
NF_DROP, NF_ACCEPT = 0, 1
QUEUE_MAXLEN = 1 << 16  # packets held at once: far above 1 Gbit/s x the largest delay's worth of segments
ACK_TIMEOUT_S = 5

NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
NFGENMSG = struct.Struct("!BBH")    # family, version, queue number (big-endian)
NLATTR = struct.Struct("=HH")


class NetlinkError(RuntimeError):
    """The kernel refused a configuration message (its errno)."""


def attr(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    raw = NLATTR.pack(NLATTR.size + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def message(msg: int, queue: int, attrs: bytes, seq: int, flags: int = NLM_F_REQUEST, family: int = 0) -> bytes:
    body = NFGENMSG.pack(family, 0, queue) + attrs
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), (SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def config_messages(queue: int, maxlen: int = QUEUE_MAXLEN) -> list[bytes]:
    """Bind ``queue``, copy only the metadata, hold up to ``maxlen`` packets, pass GSO packets whole."""
    ack = NLM_F_REQUEST | NLM_F_ACK
    return [message(MSG_CONFIG, queue, attr(CFG_CMD, struct.pack("!BxH", CMD_BIND, 0)), 1, ack),
            message(MSG_CONFIG, queue, attr(CFG_PARAMS, struct.pack("!IB", 0, COPY_META))
                    + attr(CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))
                    + attr(CFG_MASK, struct.pack("!I", F_GSO)) + attr(CFG_FLAGS, struct.pack("!I", F_GSO)), 2, ack)]


def verdict(queue: int, packet_id: int, accept: bool, batch: bool = False) -> bytes:
    """NF_ACCEPT or NF_DROP for ``packet_id`` (with ``batch``: for every id up to it still held)."""
    return message(MSG_VERDICT_BATCH if batch else MSG_VERDICT, queue,
                   attr(VERDICT_HDR, struct.pack("!II", NF_ACCEPT if accept else NF_DROP, packet_id)), 0)


def parse(buf: bytes) -> tuple[list[int], list[tuple[int, int]]]:
    """The packet ids queued in ``buf`` (one recv), and the (sequence, errno) of each ack or error."""
    ids, acks, at = [], [], 0
    while at + NLMSGHDR.size <= len(buf):
        length, kind, _flags, seq, _port = NLMSGHDR.unpack_from(buf, at)
        if length < NLMSGHDR.size or at + length > len(buf):
            break
        if kind == NLMSG_ERROR:
            acks.append((seq, -struct.unpack_from("=i", buf, at + NLMSGHDR.size)[0]))
        elif kind == (SUBSYS_QUEUE << 8) | MSG_PACKET:
            a, end = at + NLMSGHDR.size + NFGENMSG.size, at + length
            while a + NLATTR.size <= end:
                alen, atype = NLATTR.unpack_from(buf, a)
                if alen < NLATTR.size:
                    break
                if atype & 0x3FFF == PACKET_HDR:
                    ids.append(struct.unpack_from("!I", buf, a + NLATTR.size)[0])
                a += (alen + 3) & ~3
        at += (length + 3) & ~3
    return ids, acks


def seconds(text: str) -> float:
    """tc's spelling of a time: ``1ms``, ``100us``, ``0.5s``; a bare number is microseconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(s|sec|secs|ms|msec|msecs|us|usec|usecs)?\s*", text)
    if m is None:
        raise ValueError(f"not a time: {text!r} (e.g. 1ms, 100us)")
    scale = {"s": 1.0, "se": 1.0, "ms": 1e-3, "us": 1e-6}[(m.group(2) or "us")[:2]]
    return float(m.group(1)) * scale


def fraction(text: str | None) -> float:
    """tc's spelling of a loss: ``0.1%`` or a fraction; None is none."""
    if not text:
        return 0.0
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"a loss must be within 0..100%: {text!r}")
    return value


def open_queue(queue: int) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root): room for bursts of metadata
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    for msg in config_messages(queue):
        seq = NLMSGHDR.unpack_from(msg)[3]
        sock.sendall(msg)
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while True:
            if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise NetlinkError(f"no answer to configuration message {seq} in {ACK_TIMEOUT_S} s")
            code = dict(parse(sock.recv(65536))[1]).get(seq)
            if code is not None:
                break
        if code:
            raise NetlinkError(f"nfnetlink_queue refused configuration message {seq}: {os.strerror(code)}")
    sock.setblocking(False)
    return sock


def serve(sock: socket.socket, queue: int, delay_s: float, loss: float, rng: random.Random) -> None:
    """Holds each packet until its arrival + ``delay_s``; runs until a signal ends the process."""
    held: collections.deque = collections.deque()  # (due, id), in arrival order
    buf = bytearray(1 << 20)
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        if select.select([sock], [], [], timeout)[0]:
            while True:
                try:
                    n = sock.recv_into(buf)
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno == errno.ENOBUFS:
                        continue
                    raise
                now = time.monotonic()
                for pid in parse(bytes(buf[:n]))[0]:
                    if loss and rng.random() < loss:
                        sock.send(verdict(queue, pid, False))
                    else:
                        held.append((now + delay_s, pid))
        now, last = time.monotonic(), None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            sock.send(verdict(queue, last, True, batch=True))


def start(ns: str, dev: str, delay: str | None, loss: str | None, timeout_s: float, log, into: list) -> None:
    """Starts a delay line in namespace ``ns`` (appended to ``into`` at once, so that its caller
    reaps it whatever follows), waits for it to bind its queue, then queues ``dev``'s IPv4 sends
    and receives to it. A failure stops the run (SystemExit) with the reason."""
    seconds(delay or "0"), fraction(loss)  # a bad spelling fails here, not in the namespace
    cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--queue", "0",
           "--delay", delay or "0"] + (["--loss", loss] if loss else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    into.append(proc)
    with proc.stdout:
        ready = select.select([proc.stdout], [], [], timeout_s)[0] and proc.stdout.readline().strip() == "ready"
    if not ready:
        raise SystemExit(f"netem: the delay line in {ns} did not start in {timeout_s} s "
                         f"(exit {proc.poll()}; its errors are in the run's log)")
    for chain, way in (("OUTPUT", "-o"), ("INPUT", "-i")):
        rule = ["ip", "netns", "exec", ns, "iptables", "-A", chain, way, dev, "-j", "NFQUEUE", "--queue-num", "0"]
        try:
            done = subprocess.run(rule, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"netem: `{' '.join(rule)}` had not finished after {timeout_s} s") from None
        if done.returncode:
            raise SystemExit(f"netem: `{' '.join(rule)}` failed: {done.stderr.strip()}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="hold each queued packet's verdict for a delay (netem.py)")
    p.add_argument("--queue", type=int, default=0)
    p.add_argument("--delay", default="0ms")
    p.add_argument("--loss", default=None)
    args = p.parse_args(argv)
    delay_s, loss = seconds(args.delay), fraction(args.loss)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sock = open_queue(args.queue)
    print("ready", flush=True)
    try:
        serve(sock, args.queue, delay_s, loss, random.Random())
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()


if __name__ == "__main__":
    main()
