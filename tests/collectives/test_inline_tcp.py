"""The small TCP all_reduce run inline (collectives/inline_tcp.py), through the real launcher
(one runtime per process; runtime.testing's ranks-as-tasks never take the path): the answers
against NumPy at 2, 3 and 4 ranks, whichever path each call took; the call handed to the
normal path when a peer is late, when the ranks disagree (a mismatch, raised on every rank)
and when a peer is gone; nothing left behind (no warning, no task, no unclosed socket).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

JOB = r'''
import asyncio, os, time, warnings
import numpy as np
import runtime
import collectives as C
from collectives import inline_tcp
from runtime.errors import CollectiveMismatchError, RingweaveError

warnings.simplefilter("error")  # a ResourceWarning or a never-retrieved exception fails the job
MODE = os.environ["JOB_MODE"]
paths = {"inline": 0, "rest": 0, "normal": 0}
_taken = inline_tcp.all_reduce


def spy(*args):
    got = _taken(*args)
    paths["normal" if got is None else "inline" if got is inline_tcp.DONE else "rest"] += 1
    return got


inline_tcp.all_reduce = spy


def inputs(q, it, count, dtype):
    return (np.arange(count) % 7 + q * 3 + it % 5).astype(dtype)  # small integers: exact in every dtype


REF = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "min": np.min, "max": np.max}


async def main():
    rt = await runtime.init()
    n, r = rt.world_size, rt.rank
    wrong = []
    if MODE in ("answers", "late"):
        for it in range(12):
            for dtype in (np.float32, np.int64, np.float64):
                for count in (1, 3, 1000):
                    for op in ("sum", "avg", "prod", "min", "max"):
                        if MODE == "late" and r == n - 1 and it % 3 == 0:
                            time.sleep(0.02)  # 10x the inline wait: the others' rounds go to group.run
                        x = inputs(r, it, count, dtype)
                        await C.all_reduce(x, op=op)
                        want = REF[op](np.stack([inputs(q, it, count, dtype) for q in range(n)]), axis=0)
                        if op == "avg":
                            want = want / n if dtype != np.int64 else want // n
                        if not np.array_equal(x, want.astype(dtype)):
                            wrong.append(f"{op} {dtype.__name__} {count}: {x[:3]} != {want[:3]}")
        print(f"rank {r}: wrong={len(wrong)} {' '.join(f'{k}={v}' for k, v in paths.items())}", flush=True)
        for w in wrong[:3]:
            print(f"rank {r}: WRONG {w}", flush=True)
    elif MODE == "ahead":  # rank 0 gives the loop time first: rank 1's frame of the call is kept before it
        for it in range(30):
            if r == 0:
                await asyncio.sleep(0.01)
            x = inputs(r, it, 5, np.float64)
            await C.all_reduce(x, op="max")
            want = np.max(np.stack([inputs(q, it, 5, np.float64) for q in range(n)]), axis=0)
            if not np.array_equal(x, want):
                wrong.append(f"max: {x[:3]} != {want[:3]}")
        print(f"rank {r}: wrong={len(wrong)} {' '.join(f'{k}={v}' for k, v in paths.items())}", flush=True)
    elif MODE in ("mismatch", "mismatch_ahead"):
        x = np.ones(3, np.float32)
        await C.all_reduce(x)  # one call on the path first
        if r == 0 and MODE == "mismatch_ahead":
            await asyncio.sleep(0.05)  # rank 1's frame of the next call is kept by then
        try:
            await C.all_reduce(x, op="max" if r == 1 else "sum", timeout=20)
            print(f"rank {r}: no error", flush=True)
        except CollectiveMismatchError:
            print(f"rank {r}: mismatch {' '.join(f'{k}={v}' for k, v in paths.items())}", flush=True)
    elif MODE == "lost":
        x = np.ones(3, np.float32)
        await C.all_reduce(x)
        if r == 1:
            print(f"rank {r}: leaving", flush=True)
            time.sleep(0.5)  # rank 0 is in its next call by now
            os._exit(0)  # gone without a word: the kernel closes its sockets
        started = time.monotonic()
        try:
            await C.all_reduce(x, timeout=20)
            print(f"rank {r}: no error", flush=True)
        except RingweaveError as exc:
            print(f"rank {r}: {type(exc).__name__} after {time.monotonic() - started:.1f} s", flush=True)
    await runtime.shutdown()
    print(f"rank {r}: done", flush=True)

runtime.run(main())
'''


def run_job(tmp_path: Path, n: int, mode: str, expect_rc: int = 0) -> str:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, PYTHONPATH=str(REPO), RINGWEAVE_SHM="0", JOB_MODE=mode, PYTHONDEVMODE="1")
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", str(n), str(script)], cwd=str(REPO),
                          env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, out[-3000:]
    for bad in ("Warning", "never retrieved", "Task was destroyed", "Traceback"):
        assert bad not in out, out[-3000:]
    return proc.stdout


PATHS = re.compile(r"rank (\d): wrong=(\d+) inline=(\d+) rest=(\d+) normal=(\d+)")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_answers_match_numpy_and_the_inline_path_is_taken_where_the_world_is_a_power_of_two(tmp_path, n):
    out = run_job(tmp_path, n, "answers")
    found = {int(m[1]): tuple(map(int, m.groups()[1:])) for m in PATHS.finditer(out)}
    assert sorted(found) == list(range(n)), out
    assert all(wrong == 0 for wrong, *_ in found.values()), out
    calls = 12 * 3 * 3 * 5
    assert all(sum(p) == calls for _, *p in found.values()), found  # every call asked the inline path
    if n == 3:  # recursive doubling folds at 3: every call on the normal path
        assert all(inline == rest == 0 for _, inline, rest, _ in found.values()), found
    else:
        assert all(inline > 0 for _, inline, _, _ in found.values()), found  # (how often: the load's)


@pytest.mark.timeout(180)
def test_a_late_peer_sends_the_rest_of_the_call_to_the_normal_path_with_the_right_answer(tmp_path):
    out = run_job(tmp_path, 2, "late")
    found = {int(m[1]): tuple(map(int, m.groups()[1:])) for m in PATHS.finditer(out)}
    assert all(wrong == 0 for wrong, *_ in found.values()), out
    assert found[0][2] > 0, found  # rank 0 waited past the inline wait: the rest went to group.run
    assert found[0][1] > 0, found


@pytest.mark.timeout(120)
def test_a_frame_kept_before_the_call_began_is_taken_inline(tmp_path):
    out = run_job(tmp_path, 2, "ahead")
    found = {int(m[1]): tuple(map(int, m.groups()[1:])) for m in PATHS.finditer(out)}
    assert all(wrong == 0 for wrong, *_ in found.values()), out
    assert found[0][1] >= 25, found  # rank 0's calls found rank 1's frame kept, and still went inline


@pytest.mark.timeout(120)
def test_a_mismatched_frame_kept_before_the_call_raises_on_every_rank(tmp_path):
    out = run_job(tmp_path, 2, "mismatch_ahead")
    assert re.search(r"rank 0: mismatch", out) and re.search(r"rank 1: mismatch", out), out


@pytest.mark.timeout(120)
def test_a_mismatch_on_the_inline_path_raises_on_every_rank(tmp_path):
    out = run_job(tmp_path, 2, "mismatch")
    assert re.search(r"rank 0: mismatch", out) and re.search(r"rank 1: mismatch", out), out
    assert "inline=1" in out, out  # the first call went inline, the second could not


@pytest.mark.timeout(120)
def test_a_peer_gone_before_the_call_fails_it_at_once_not_at_the_deadline(tmp_path):
    out = run_job(tmp_path, 2, "lost")
    m = re.search(r"rank 0: (\w+) after ([\d.]+) s", out)
    assert m, out
    assert m[1] == "PeerLostError" and float(m[2]) < 10, out
