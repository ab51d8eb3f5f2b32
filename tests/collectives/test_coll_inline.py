"""Small collectives through the real launcher, where Call.sendrecv may read a peer's frame
straight from its socket (one runtime per process; runtime.testing's ranks-as-tasks never
take that path): closed-form answers for every call, whichever path each message took.

The job mixes all_reduce (several ops, dtypes and lengths), barrier, broadcast from every
root, all_gather and reduce_scatter, a few of them with messages up to 600 KiB (sent with one
writev by send_now, read head first and then straight into place), then a few calls in flight at once (which take the event loop's path).
Each rank reports how many frames it took off the socket itself
(``ConnectionStatistics.frames_received_now``): some with the path on, none with
``RINGWEAVE_INLINE_WAIT_US=0``. The wait is the receiving rank's own choice, so one job holds
both: ranks 2 and 3 run with the setting at 0 (the job sets it before init), ranks 0 and 1
with the default.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

JOB = r'''
import asyncio, os
import numpy as np
import runtime
import collectives as C

if os.environ["RANK"] in os.environ.get("INLINE_OFF_RANKS", "").split(","):  # the test's: these read no frame inline
    os.environ["RINGWEAVE_INLINE_WAIT_US"] = "0"


async def main():
    rt = await runtime.init()
    n, r = rt.world_size, rt.rank
    wrong = []

    def expect(what, got, want):
        if not np.array_equal(got, want):
            wrong.append(f"{what}: got {got[:4]} want {np.asarray(want)[:4]}")

    calls = 0
    for it in range(60):
        for dtype in (np.float32, np.int64, np.float64):
            for count in (1, 3, 1000):
                x = np.full(count, r + 1 + it % 3, dtype)
                await C.all_reduce(x)
                expect(f"sum {dtype.__name__} {count}", x, np.full(count, n * (n + 1) // 2 + n * (it % 3), dtype))
                x = np.full(count, r + it, dtype)
                await C.all_reduce(x, op="max")
                expect(f"max {dtype.__name__} {count}", x, np.full(count, n - 1 + it, dtype))
                calls += 2
        await C.barrier()
        root = it % n
        for length in (100, 70_000):  # 70 000 int32: a frame read head first, payload straight into b
            b = np.arange(length, dtype=np.int32) * (root + 1) if r == root else np.zeros(length, np.int32)
            await C.broadcast(b, src=root)
            expect(f"broadcast {length} from {root}", b, np.arange(length, dtype=np.int32) * (root + 1))
        out = np.full(n * 5, -1.0, np.float32)
        await C.all_gather(out, np.full(5, r + it, np.float32))
        expect("all_gather", out, np.repeat(np.arange(n, dtype=np.float32) + it, 5))
        mine = np.full(5, -1, np.int32)  # block j of rank q's input is q + j + it
        await C.reduce_scatter(mine, np.repeat(np.arange(n, dtype=np.int32) + r + it, 5))
        expect("reduce_scatter", mine, np.full(5, n * (n - 1) // 2 + n * (r + it), np.int32))
        calls += 5
        if it % 10 == 0:  # larger messages: sent with one writev (send_now), read head first then into place
            big = np.full(300_000, r + it, np.float32)  # 1.2 MiB: halving-doubling, one sendrecv per step
            await C.all_reduce(big, algorithm="halving_doubling")
            expect("all_reduce 1.2 MiB", big, np.full(300_000, n * (n - 1) / 2 + n * it, np.float32))
            mid = np.full(70_000, r + 1, np.float64)  # 560 KiB: recursive doubling's whole-array exchanges
            await C.all_reduce(mid, algorithm="recursive_doubling")
            expect("all_reduce 560 KiB", mid, np.full(70_000, n * (n + 1) / 2))
            out = np.full(n * 100_000, -1, np.int32)  # 400 KiB blocks: direct, one sendrecv per turn
            await C.all_gather(out, np.full(100_000, r + it, np.int32), algorithm="direct")
            expect("all_gather 400 KiB blocks", out, np.repeat(np.arange(n, dtype=np.int32) + it, 100_000))
            calls += 3
    xs = [np.full(7, (r + 1) * (i + 1), np.float64) for i in range(3)]
    await asyncio.gather(*(C.all_reduce(x) for x in xs))  # in flight at once: the event loop's path
    for i, x in enumerate(xs):
        expect(f"concurrent {i}", x, np.full(7, (i + 1) * n * (n + 1) / 2))
    now = sum(c.statistics().frames_received_now for c in rt.actor.conns.values())
    total = sum(c.statistics().frames_received for c in rt.actor.conns.values())
    print(f"rank {r}: calls={calls} wrong={len(wrong)} now={now} frames={total}", flush=True)
    for w in wrong[:5]:
        print(f"rank {r}: WRONG {w}", flush=True)
    await runtime.shutdown()

runtime.run(main())
'''

LINE = re.compile(r"rank (\d): calls=(\d+) wrong=(\d+) now=(\d+) frames=(\d+)")


def run_job(tmp_path: Path, env: dict) -> dict[int, tuple[int, int, int]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    full_env = dict(os.environ, PYTHONPATH=str(REPO), RINGWEAVE_SHM="0", **env)
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "4", str(script)], cwd=str(REPO),
                          env=full_env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {int(m.group(1)): (int(m.group(3)), int(m.group(4)), int(m.group(5))) for m in LINE.finditer(proc.stdout)}
    assert sorted(found) == [0, 1, 2, 3], proc.stdout[-3000:]
    assert all(wrong == 0 for wrong, _, _ in found.values()), proc.stdout[-3000:]
    return found


@pytest.mark.timeout(180)
def test_small_collectives_in_processes_are_right_and_read_off_the_socket_unless_the_wait_is_0(tmp_path):
    found = run_job(tmp_path, {"INLINE_OFF_RANKS": "2,3"})  # every answer right on every rank (run_job)
    assert all(found[r][1] > 0 for r in (0, 1)), found  # the path was taken on every rank with it on
    assert all(found[r][1] == 0 for r in (2, 3)), found  # RINGWEAVE_INLINE_WAIT_US=0 turns it off
