"""Point-to-point throughput and latency between two ranks, beside a plain socket.

    python bench/p2p.py                      # launches itself with 2 ranks
    python bench/p2p.py --max-mib 16 --iters 10 --out-dir bench/out      # writes bench/out/p2p.json

Both measurements are ping-pong between the same two processes in the same run:
rank 0 sends ``size`` bytes, rank 1 receives them into a preallocated buffer
and sends them back. One-way time = round trip / 2; throughput = size / one-way
time. "ringweave" goes through ``Actor.send`` / ``Actor.recv_into`` (frames,
posted receive buffers, the event loop); "socket" is a plain blocking
``sendall`` / ``recv_into`` loop over one TCP connection with the same socket
options (TCP_NODELAY, 4 MiB buffers) - the ceiling a Python program can reach
on this machine. WARMUP rounds per size are not timed; the median of ``--iters`` is shown.

Targets: at 64 MiB ringweave >= 70% of the plain socket; a small message's round trip below
100 us.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np


WARMUP = 30  # untimed rounds per size: the first tens run slower (bench/results/harness.md#ping-pong-warm-up)


def sizes(max_mib: int) -> list[int]:
    out, s = [], 1024
    while s <= max_mib * 1024 * 1024:
        out.append(s)
        s *= 4
    return [8] + out


def _iters_for(size: int, iters: int) -> int:
    return max(3, min(iters * 20, (64 << 20) // max(size, 1) * iters // 4, 2000))


async def ringweave_pingpong(rt, size: int, iters: int) -> list[float]:
    a = rt.actor
    peer = 1 - rt.rank
    buf = np.ones(size, np.uint8)
    back = np.empty(size, np.uint8)
    times = []
    for i in range(iters + WARMUP):
        t0 = time.perf_counter()
        if rt.rank == 0:
            fut = a.post((peer, "pp"), peer, memoryview(back))
            await a.send(peer, "pp", buf)
            await fut
        else:
            await a.recv_into(peer, "pp", back)
            await a.send(peer, "pp", back)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def socket_pingpong(sock: socket.socket, rank: int, size: int, iters: int) -> list[float]:
    buf = np.ones(size, np.uint8)
    back = np.empty(size, np.uint8)
    mv = memoryview(back)

    def recv_all():
        got = 0
        while got < size:
            got += sock.recv_into(mv[got:], size - got)

    times = []
    for i in range(iters + WARMUP):
        t0 = time.perf_counter()
        if rank == 0:
            sock.sendall(buf)
            recv_all()
        else:
            recv_all()
            sock.sendall(back)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


async def plain_socket(rt) -> socket.socket:
    """A blocking TCP connection between the two ranks, set up through the runtime."""
    from runtime import net
    if rt.rank == 0:
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        await rt.actor.send(1, "port", lsock.getsockname()[1])
        loop = asyncio.get_running_loop()
        lsock.setblocking(False)
        conn, _ = await loop.sock_accept(lsock)
        lsock.close()
    else:
        port = await rt.actor.recv(0, "port")
        conn = socket.create_connection(("127.0.0.1", port))
    net.tune(conn)
    conn.setblocking(True)
    return conn


async def rank_main(args) -> None:
    import runtime
    rt = await runtime.init()
    sock = await plain_socket(rt)
    rows = []
    try:
        for size in sizes(args.max_mib):
            n = _iters_for(size, args.iters)
            ours = await ringweave_pingpong(rt, size, n)
            theirs = socket_pingpong(sock, rt.rank, size, n)
            if rt.rank == 0:
                t_ours, t_sock = statistics.median(ours) / 2, statistics.median(theirs) / 2
                rows.append({"bytes": size, "iters": n, "ringweave_us": t_ours * 1e6, "socket_us": t_sock * 1e6,
                             "ringweave_gbps": size / t_ours / 1e9, "socket_gbps": size / t_sock / 1e9,
                             "ratio": t_sock / t_ours, "ringweave_rtt_us": statistics.median(ours) * 1e6})
                r = rows[-1]
                print(f"{size:>10d} B  ringweave {r['ringweave_us']:9.1f} us {r['ringweave_gbps']:6.2f} GB/s   "
                      f"socket {r['socket_us']:9.1f} us {r['socket_gbps']:6.2f} GB/s   "
                      f"ratio {r['ratio']:.2f}   (rtt {r['ringweave_rtt_us']:.1f} us)", flush=True)
    finally:
        sock.close()
    if rt.rank == 0 and args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"loop": type(asyncio.get_running_loop()).__module__, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    await runtime.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out-dir", default=None, help="directory for p2p.json (default: the current directory)")
    p.add_argument("--json", default=None, help="JSON path (default: OUT_DIR/p2p.json); '' for none")
    p.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args()
    if args.json is None:  # never the source tree: where the user says, else here
        args.json = os.path.abspath(os.path.join(args.out_dir or os.getcwd(), "p2p.json"))
    if "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "runtime.launch", "-n", "2", __file__, *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))
    if args.no_uvloop:
        asyncio.run(rank_main(args))
    else:
        import uvloop
        uvloop.run(rank_main(args))


if __name__ == "__main__":
    main()
