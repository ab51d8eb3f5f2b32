"""Load and soak: many small collectives in a row, many store clients at once, and no
growth in file descriptors or memory beyond a stated bound. Each test prints its figures.

* 10,000 small collectives in a row on 4 ranks over the in-memory transport
  (all_reduce, all_gather, broadcast, barrier in turn, results checked), then
  2,000 more over real loopback TCP. Memory and descriptors are measured after
  a warm-up (the first 1,000), so one-time costs (buffers, caches) are not
  counted: RSS may grow by at most RSS_BOUND, descriptors not at all.
* 300 store clients connected to one server at once, each authenticated,
  each adding to one counter and waiting on one key, in 3 rounds: the count is
  exact, the server sees 300 clients at the peak and 0 after, and after the
  first round (which grows the allocator's arenas for the sockets' buffers)
  the process's descriptors do not grow and its RSS by less than
  STORE_RSS_BOUND. The server has room for HANDSHAKING handshakes at once, so the
  burst is several times its bound: it drops handshakes (counted, and required)
  and every dropped client retries and gets in.

Both run in this process; RSS is this process's (ranks and server included).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time

import numpy as np
import pytest

import collectives as C
from runtime.testing import run_ranks

RSS_BOUND = 16 * 1024**2  # growth allowed after the warm-up, bytes


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def collectives_in_a_row(transport: str, calls: int, warmup: int) -> dict:
    """Runs ``calls`` small collectives on 4 ranks; returns the figures."""
    marks: dict[str, tuple[int, int, float]] = {}

    async def body(g):
        n, r = g.size, g.rank
        x = np.empty(256, np.float32)
        out = np.empty(n * 16, np.int32)
        mine = np.full(16, r, np.int32)
        b = np.empty(64, np.float64)
        for i in range(calls):
            if i == warmup and r == 0:
                gc.collect()
                marks["warm"] = (rss(), fds(), time.monotonic())
            op = i % 4
            if op == 0:
                x.fill(r + 1)
                await C.all_reduce(x)
                assert x[0] == n * (n + 1) / 2 and x[-1] == x[0], (i, x[:2])
            elif op == 1:
                await C.all_gather(out, mine)
                assert out[0] == 0 and out[-1] == n - 1, (i, out)
            elif op == 2:
                b.fill(r)
                await C.broadcast(b, src=i % n)
                assert b[0] == i % n and b[-1] == b[0], (i, b[:2])
            else:
                await C.barrier()
        if r == 0:
            gc.collect()
            marks["end"] = (rss(), fds(), time.monotonic())
        return g.runtime.actor.statistics()

    t0 = time.monotonic()
    stats = await run_ranks(4, body, transport=transport, timeout_s=60)
    took = time.monotonic() - t0
    (rss_w, fds_w, t_w), (rss_e, fds_e, t_e) = marks["warm"], marks["end"]
    return {"took_s": took, "per_call_us": (t_e - t_w) / (calls - warmup) * 1e6, "rss_warm": rss_w,
            "rss_end": rss_e, "fds_warm": fds_w, "fds_end": fds_e, "stats": stats[0]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport,calls", [("memory", 10_000), ("tcp", 2_000)])
async def test_small_collectives_in_a_row(transport, calls, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "0")  # the transport under test, not /dev/shm
    fig = await collectives_in_a_row(transport, calls, warmup=1_000)
    growth = fig["rss_end"] - fig["rss_warm"]
    st = fig["stats"]
    print(f"\n== {calls} small collectives in a row, 4 ranks, {transport}: {fig['took_s']:.1f} s, "
          f"{fig['per_call_us']:.0f} us per call (all 4 ranks in one process) after the warm-up; "
          f"RSS {fig['rss_warm'] / 2**20:.1f} -> {fig['rss_end'] / 2**20:.1f} MiB "
          f"(+{growth / 2**20:.2f}, bound {RSS_BOUND / 2**20:.0f}); fds {fig['fds_warm']} -> {fig['fds_end']}; "
          f"rank 0 mailbox at the end: {st.unexpected_frames} frames / {st.unexpected_nbytes} bytes kept")
    assert growth < RSS_BOUND
    assert fig["fds_end"] <= fig["fds_warm"]
    assert st.unexpected_frames == 0 and st.unexpected_nbytes == 0


CLIENTS = 300
HANDSHAKING = 64  # the server's max_handshaking: CLIENTS at once are several times it
ROUNDS = 3
STORE_RSS_BOUND = 3 * 1024**2 // 2  # growth allowed after the first round (which sizes the allocator's arenas)


@pytest.mark.timeout(180)
async def test_store_clients_at_once_past_the_handshake_bound():
    from runtime.store_server import StoreServer
    from runtime.store_tcp import TCPStore

    secret = b"soak-secret"
    server = await StoreServer("127.0.0.1", 0, secret=secret, job="soak", max_handshaking=HANDSHAKING).start()
    try:
        gc.collect()
        fds0, rss0 = fds(), rss()
        rounds = []
        for round_ in range(ROUNDS):
            peak = 0

            async def one(i: int) -> int:
                nonlocal peak
                client = await TCPStore.connect("127.0.0.1", server.port, secret=secret, job="soak",
                                                timeout_s=60, who={"client": i})
                try:
                    count = await client.add(f"count/{round_}", 1)
                    if count == CLIENTS:
                        peak = server.statistics().clients
                        await client.set(f"go/{round_}", b"1")
                    await client.get(f"go/{round_}", 60)  # every client holds its connection until all came
                    return count
                finally:
                    await client.close()

            t0 = time.monotonic()
            counts = await asyncio.gather(*(one(i) for i in range(CLIENTS)))
            took = time.monotonic() - t0
            assert sorted(counts) == list(range(1, CLIENTS + 1))  # every add counted once
            deadline = time.monotonic() + 10
            while server.statistics().clients and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            gc.collect()
            rounds.append((took, peak, server.statistics().clients, fds(), rss()))
        evicted = server.statistics().evicted
        print(f"\n== {CLIENTS} store clients at once, {ROUNDS} rounds, room for {HANDSHAKING} handshakes: {evicted} "
              f"dropped in the handshake and retried (fds and RSS of this process: server and clients; before "
              f"round 0: {fds0} fds, {rss0 / 2**20:.1f} MiB)")
        assert evicted > 0  # the burst went past the handshake bound, and every client still came in
        for k, (took, peak, after, f, m) in enumerate(rounds):
            print(f"   round {k}: all connected, counted and closed in {took:.2f} s; server clients at the peak "
                  f"{peak}, after {after}; then {f} fds, RSS {m / 2**20:.1f} MiB "
                  f"({'warm-up' if k == 0 else f'{(m - rounds[0][4]) / 2**20:+.2f} MiB since round 0'})")
            assert peak == CLIENTS and after == 0
        _, _, _, fds_warm, rss_warm = rounds[0]
        print(f"   after the warm-up round: fds {fds_warm} -> {rounds[-1][3]} (bound: no growth), RSS "
              f"{(rounds[-1][4] - rss_warm) / 2**20:+.2f} MiB (bound {STORE_RSS_BOUND / 2**20:.1f} MiB)")
        assert fds_warm <= fds0 + 2  # one-time: e.g. the loop's resolver thread pool
        for _, _, _, f, m in rounds[1:]:
            assert f <= fds_warm, (fds_warm, f)
            assert m - rss_warm < STORE_RSS_BOUND
    finally:
        await server.close()
