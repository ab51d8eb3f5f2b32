"""bench/common.py's two times of a timed iteration over the ranks (what bench/collectives.py
reduces after each row): ``call`` = max over ranks of (t1 - t0), ``last`` = max t1 - max t0,
checked against closed forms on made-up stamps; the host's clock id; the rounds' order that every
rank draws alike (--shuffle). No speed is measured."""

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402


def over_ranks(t0, t1) -> np.ndarray:
    """What the ranks' max-reduce of their stamps leaves (rank is the first axis)."""
    return np.maximum.reduce([common.stamps(a, b) for a, b in zip(t0, t1)])


def test_call_and_last_against_their_closed_forms():
    # 3 ranks, 4 iterations, in us. Iteration 0: 2 ranks as a small broadcast lands when the receiver
    # (rank 1) is let out of the barrier first and waits 150 us for the root (rank 0) to wake up;
    # iteration 3: every rank enters at once, so both figures are the slowest call.
    t0 = np.array([[150.0, 1000.0, 2000.0, 3000.0],
                   [0.0, 1010.0, 2050.0, 3000.0],
                   [140.0, 1020.0, 2010.0, 3000.0]])
    t1 = np.array([[185.0, 1100.0, 2100.0, 3050.0],
                   [190.0, 1150.0, 2100.0, 3060.0],
                   [180.0, 1110.0, 2120.0, 3070.0]])
    got = common.iteration_times(over_ranks(t0, t1), one_clock=True)
    # call: the largest of each column's t1 - t0
    assert got["call"].tolist() == [190.0, 140.0, 110.0, 70.0]
    # last: the largest t1 less the largest t0 of each column
    assert got["last"].tolist() == [190.0 - 150.0, 1150.0 - 1020.0, 2120.0 - 2050.0, 3070.0 - 3000.0]
    assert got["last"][0] < got["call"][0] / 4 and got["last"][3] == got["call"][3]


def test_last_never_exceeds_call_and_is_absent_without_one_clock():
    rng = np.random.default_rng(0)
    t0 = 1e5 + rng.uniform(0, 1e-3, (4, 2, 50))          # ranks, variants, iterations (s)
    t1 = t0 + rng.exponential(2e-4, (4, 2, 50))
    reduced = over_ranks(t0, t1)                          # (variants, 3 x iterations), as collectives.py has it
    for v in range(2):
        got = common.iteration_times(reduced[v], one_clock=True)
        np.testing.assert_array_equal(got["call"], (t1[:, v] - t0[:, v]).max(axis=0))
        np.testing.assert_array_equal(got["last"], t1[:, v].max(axis=0) - t0[:, v].max(axis=0))
        assert (got["last"] <= got["call"]).all() and (got["last"] < got["call"]).any()
    assert common.iteration_times(reduced[0], one_clock=False)["last"] is None


def test_every_process_of_a_host_has_the_same_clock_id():
    mine = common.clock_id()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert mine == int(f.read().replace("-", "")[:12], 16) and 0 <= mine < 2 ** 48  # exact in a float64
    other = subprocess.run([sys.executable, "-c", "from bench import common; print(common.clock_id())"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr[-2000:]
    assert int(other.stdout) == mine


def test_every_process_draws_the_same_order_and_every_variant_follows_every_other():
    orders = [common.shuffled(4, 3, 16, r) for r in range(400)]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    follows = {}
    for o in orders:
        for a, b in zip(o, o[1:]):
            follows[a, b] = follows.get((a, b), 0) + 1
    assert len(follows) == 12 and min(follows.values()) > 60  # 1200 pairs, about 100 each
    code = "from bench import common; print([common.shuffled(4, 3, 16, r) for r in range(400)])"
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={"PYTHONHASHSEED": "7", "PATH": ""})
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.strip() == str(orders)
