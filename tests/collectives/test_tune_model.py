"""The cost model (collectives/costmodel.py): each formula against values worked out by hand on a
made-up machine, and the model's choice flipping where two formulas cross."""

from __future__ import annotations

import pytest

from collectives import costmodel, registry
from collectives.costmodel import Link, Machine

# alpha 10 us, o 2 us, 1 GB/s; shared memory 1 us, 10 GB/s; reduce 2 GB/s; copy 10 GB/s
M = Machine(loopback=Link(10e-6, 2e-6, 1e-9), shm=Link(1e-6, 1e-6, 0.1e-9), gamma=0.5e-9, copy=0.1e-9)
MiB = 1 << 20


def test_every_registered_algorithm_has_a_formula():
    assert {c: set(a) for c, a in registry.ALGORITHMS.items()} == {c: set(f) for c, f in costmodel.FORMULAS.items()}


@pytest.mark.parametrize("collective, algorithm, p, nbytes, seconds", [
    # 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma; one segment per 1 MiB chunk
    ("all_reduce", "ring", 4, 4 * MiB, 60e-6 + 6.291456e-3 + 1.572864e-3),
    # p = 2, 8 MiB chunks: two 4 MiB segments a step, the second sent back to back (o)
    ("all_reduce", "ring", 2, 16 * MiB, 2 * (10e-6 + 2e-6) + 16.777216e-3 + 4.194304e-3),
    # log2 p rounds of the whole array, reduced and copied
    ("all_reduce", "recursive_doubling", 4, 4, 2 * (10e-6 + 4 * (1e-9 + 0.5e-9 + 0.1e-9))),
    # p = 3 folds first: the array in, reduced, and the result back
    ("all_reduce", "recursive_doubling", 3, 4, 2 * (10e-6 + 4e-9) + 2e-9 + (10e-6 + 6.4e-9)),
    # 2 log2 p rounds, ring's volume; no segments up to 2 MiB
    ("all_reduce", "halving_doubling", 4, 1 * MiB, 40e-6 + 1.5 * MiB * 1e-9 + 0.75 * MiB * 0.5e-9),
    ("all_gather", "direct", 4, 1000, 10e-6 + 2 * 2e-6 + 3000e-9),
    ("all_gather", "bruck", 4, 1000, 2 * 10e-6 + 3000e-9 + 8000 * 0.1e-9),
    ("broadcast", "tree", 4, 8 * MiB, 2 * (10e-6 + 8 * MiB * 1e-9)),
    # 8 segments of 1 MiB: fill three links, then seven more back to back
    ("broadcast", "chain", 4, 8 * MiB, 3 * (10e-6 + MiB * 1e-9) + 7 * (2e-6 + MiB * 1e-9)),
    ("barrier", "dissemination", 5, 0, 3 * 10e-6),
    ("barrier", "shm", 5, 0, 1e-6),
])
def test_formula_against_hand_computed_value(collective, algorithm, p, nbytes, seconds):
    assert costmodel.predict(M, collective, algorithm, p, nbytes) == pytest.approx(seconds, rel=1e-9)


def test_one_rank_costs_nothing():
    assert costmodel.predict(M, "all_reduce", "ring", 1, MiB) == 0.0


def test_choice_flips_where_the_formulas_cross():
    # recursive doubling 20 us + 3.2 ns/B, ring 60 us + 1.875 ns/B: they cross at 40 us / 1.325 ns/B
    cross = 40e-6 / ((2 * (1e-9 + 0.5e-9 + 0.1e-9)) - (1.5e-9 + 0.375e-9))
    pair = ("ring", "recursive_doubling")

    def best(nbytes):
        return costmodel.ranking(M, "all_reduce", 4, nbytes, allowed=pair)[0][1]
    assert best(int(cross) - 64) == "recursive_doubling"
    assert best(int(cross) + 64) == "ring"
    # the chain overtakes the tree for large broadcasts, never for tiny ones
    assert costmodel.ranking(M, "broadcast", 4, 4, allowed=("tree", "chain"))[0][1] == "tree"
    assert costmodel.ranking(M, "broadcast", 4, 8 * MiB, allowed=("tree", "chain"))[0][1] == "chain"


def test_network_link_is_used_across_hosts_only():
    slow = Machine(M.loopback, M.shm, M.gamma, M.copy, network=Link(50e-6, 5e-6, 10e-9))
    assert costmodel.predict(slow, "broadcast", "tree", 4, 100, hosts=1) == costmodel.predict(M, "broadcast", "tree", 4, 100)
    assert costmodel.predict(slow, "broadcast", "tree", 4, 100, hosts=2) == pytest.approx(2 * (50e-6 + 1000e-9))


def test_machine_json_round_trip_and_refusal():
    assert Machine.from_json(M.to_json()) == M
    bad = M.to_json()
    bad["loopback"]["beta"] = -1
    with pytest.raises(ValueError, match="model.loopback.beta"):
        Machine.from_json(bad)


def test_hierarchical_all_reduce_of_equal_hosts_overlaps_the_crossing_and_unequal_go_through_leaders():
    n = 16 * MiB
    across = min(costmodel.all_reduce_ring(M, 2, n, 2), costmodel.all_reduce_halving_doubling(M, 2, n, 2))
    # 2 hosts x 2 ranks: one copy-in, half the array reduced and copied out per rank (8 MiB), by hand
    inside = 2e-6 + n * 0.1e-9 + n / 2 * (0.5e-9 + 0.1e-9) + n / 2 * 0.1e-9
    assert inside < across  # the link bounds it: the host's work hides under the crossing
    equal = costmodel.all_reduce_hierarchical(M, 4, n, hosts=2)
    assert equal == pytest.approx(across + 2e-6, rel=1e-12)
    # 5 ranks on 2 hosts (3 + 2): the leaders' stages one after the other, the gather and spread too
    unequal = costmodel.all_reduce_hierarchical(M, 5, n, hosts=2)
    assert unequal == pytest.approx(costmodel.all_reduce_shm(M, 3, n) + 1e-6 + n * 0.1e-9 + across, rel=1e-12)
