"""Rendezvous store benchmark: round trips, one client shared by many tasks, many clients.

    python bench/store.py [--loop asyncio|uvloop] [--clients 1000] [--quick]

The server runs in a child process (its own interpreter and event loop), so
the client side is what is timed. Figures, each against a peer measured in
the same run:

- round trip of set / get / add on one client, sequential (median, p99),
  and the same on an in-process MemoryStore as the floor;
- one client shared by T tasks: requests tagged with ids (what TCPStore does)
  against the same client serialized by one lock, the other design;
- C clients connecting at once (each a handshake), then one add each, then a
  barrier (everyone waits on one key that the last arrival sets);
- a 4 MiB value set + get, in MiB/s.

Prints one line per figure. Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.store import MemoryStore, Store  # noqa: E402
from runtime.store_server import StoreServer  # noqa: E402
from runtime.store_tcp import TCPStore  # noqa: E402

SECRET = b"bench-secret"


def _serve(port_queue, stop_event, use_uvloop: bool) -> None:
    async def main() -> None:
        async with StoreServer("127.0.0.1", 0, secret=SECRET, max_clients=8192) as srv:
            port_queue.put(srv.port)
            while not stop_event.is_set():
                await asyncio.sleep(0.1)

    if use_uvloop:
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def round_trips(store: Store, n: int) -> dict[str, tuple[float, float]]:
    out = {}
    await store.set("rt", b"x" * 16)
    for name, op in (("set", lambda: store.set("rt", b"x" * 16)),
                     ("get", lambda: store.get("rt")),
                     ("add", lambda: store.add("rt_n"))):
        for _ in range(min(100, n)):  # warm-up, not timed
            await op()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await op()
            times.append(time.perf_counter() - t0)
        out[name] = (statistics.median(times) * 1e6, _percentile(times, 0.99) * 1e6)
    return out


async def shared_client(store: TCPStore, tasks: int, per_task: int, serialize: bool) -> float:
    lock = asyncio.Lock()

    async def worker(i: int) -> None:
        for _ in range(per_task):
            if serialize:
                async with lock:
                    await store.add(f"shared/{i % 8}")
            else:
                await store.add(f"shared/{i % 8}")

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(tasks):
            tg.create_task(worker(i))
    return tasks * per_task / (time.perf_counter() - t0)


async def many_clients(port: int, n: int, round_: int) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    clients = await asyncio.gather(*(TCPStore.connect("127.0.0.1", port, secret=SECRET, timeout_s=120.0)
                                     for _ in range(n)))
    t_connect = time.perf_counter() - t0
    key, go = f"arrived/{round_}", f"go/{round_}"
    try:
        t1 = time.perf_counter()

        async def arrive(c: TCPStore) -> None:
            if await c.add(key) == n:
                await c.set(go, b"")
            await c.wait([go], timeout_s=120.0)

        async with asyncio.TaskGroup() as tg:
            for c in clients:
                tg.create_task(arrive(c))
        t_barrier = time.perf_counter() - t1
    finally:
        t2 = time.perf_counter()
        await asyncio.gather(*(c.close() for c in clients))
        t_close = time.perf_counter() - t2
    return t_connect, t_barrier, t_close


async def bench(port: int, args) -> None:
    n = 500 if args.quick else 5000
    mem = MemoryStore()
    for name, (med, p99) in (await round_trips(mem, n)).items():
        print(f"memory  {name:4s} round trip   median {med:8.1f} us   p99 {p99:8.1f} us")
    await mem.close()

    store = await TCPStore.connect("127.0.0.1", port, secret=SECRET, timeout_s=60.0)
    try:
        for name, (med, p99) in (await round_trips(store, n)).items():
            print(f"tcp     {name:4s} round trip   median {med:8.1f} us   p99 {p99:8.1f} us")
        for tasks in (1, 16, 200):
            per = max(1, (2000 if args.quick else 10000) // tasks)
            tagged = await shared_client(store, tasks, per, serialize=False)
            locked = await shared_client(store, tasks, per, serialize=True)
            print(f"one client, {tasks:3d} tasks: tagged {tagged:9.0f} req/s   one lock {locked:9.0f} req/s   "
                  f"ratio {tagged / locked:5.2f}x")
        big = os.urandom(4 * 1024**2)
        reps = 5 if args.quick else 20
        t0 = time.perf_counter()
        for _ in range(reps):
            await store.set("big", big)
            assert len(await store.get("big")) == len(big)
        dt = time.perf_counter() - t0
        print(f"4 MiB value set+get: {2 * reps * len(big) / dt / 2**20:8.1f} MiB/s")
    finally:
        await store.close()

    for r, n_clients in enumerate(sorted({min(100, args.clients), args.clients})):
        t_connect, t_barrier, t_close = await many_clients(port, n_clients, r)
        print(f"{n_clients:5d} clients: connect+handshake all {t_connect * 1e3:8.1f} ms   "
              f"add+barrier {t_barrier * 1e3:8.1f} ms   close all {t_close * 1e3:8.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve, args=(port_queue, stop_event, args.loop == "uvloop"), daemon=True)
    proc.start()
    try:
        port = port_queue.get(timeout=30)
        print(f"store bench: client and server loops {args.loop}, server in pid {proc.pid}, port {port}, "
              f"{os.cpu_count()} cores")
        if args.loop == "uvloop":
            import uvloop
            uvloop.run(bench(port, args))
        else:
            asyncio.run(bench(port, args))
    finally:
        stop_event.set()
        proc.join(10)


if __name__ == "__main__":
    main()
