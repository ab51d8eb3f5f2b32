"""The selection table on one host with shared memory on, where the default grid
(``bench/collectives.py --algorithm all`` at 2 ranks, a core each, and at 4 ranks on 2 cores)
measured the choices: the broadcast over TCP below 1 MiB at 2-4 ranks (a send and a receive
straight off the socket against the slot's two copies and hand-offs), shared memory above and at 5
ranks and more (not measured there); the reduce's tree at every size at 2 ranks, Rabenseifner from
16 MiB at 3 and more as before; the all_gather and reduce_scatter of 32 MiB and more at 3+ ranks by
the hierarchical algorithm's one hand-off (shm's pipeline below and at 2 ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from collectives import registry
from runtime.topology import HostTopology

KiB, MiB = 1 << 10, 1 << 20


def one_host(world: int):
    """A stand-in group of ``world`` ranks on one host (what registry.choose reads of a group)."""
    return SimpleNamespace(topology=HostTopology.of("a" * world), size=world, shm_enabled=True)


@pytest.fixture
def choice(monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "1")
    monkeypatch.setenv("RINGWEAVE_TUNE", "0")  # the table, not a rules file this machine may hold
    for name in ("RINGWEAVE_ALGO_BROADCAST", "RINGWEAVE_ALGO_REDUCE", "RINGWEAVE_ALGO_BARRIER"):
        monkeypatch.delenv(name, raising=False)

    def choose(collective: str, nbytes: int, world: int) -> str:
        return registry.choose(collective, nbytes, world, group=one_host(world))[0]
    return choose


@pytest.mark.parametrize("world,nbytes,want", [
    (2, 4, "flat"), (2, 1 * KiB, "flat"), (2, 64 * KiB, "flat"), (2, 256 * KiB, "tree"),
    (2, 1 * MiB, "shm"), (2, 64 * MiB, "shm"),
    (4, 4, "flat"), (4, 16 * KiB, "flat"), (4, 64 * KiB, "flat"), (4, 256 * KiB, "tree"), (4, 1 * MiB, "shm"),
    (4, 16 * MiB, "shm"), (3, 4, "flat"), (3, 256 * KiB, "tree"), (3, 1 * MiB, "shm"),
    (8, 4, "shm"), (8, 64 * KiB, "shm"),
])
def test_broadcast_on_one_host(choice, world, nbytes, want):
    assert choice("broadcast", nbytes, world) == want


@pytest.mark.parametrize("world,nbytes,want", [
    (2, 1 * MiB, "tree"), (2, 16 * MiB, "tree"), (2, 64 * MiB, "tree"),
    (4, 4 * MiB, "tree"), (4, 16 * MiB, "rabenseifner"), (4, 64 * MiB, "rabenseifner"),
    (8, 16 * MiB, "rabenseifner"),
])
def test_reduce_on_one_host(choice, world, nbytes, want):
    assert choice("reduce", nbytes, world) == want


@pytest.mark.parametrize("collective,world,nbytes,want", [
    ("all_gather", 2, 32 * MiB, "shm"), ("all_gather", 4, 4 * MiB, "shm"), ("all_gather", 4, 16 * MiB, "hierarchical"),
    ("all_gather", 3, 8 * MiB, "shm"), ("all_gather", 3, 16 * MiB, "hierarchical"),
    ("reduce_scatter", 2, 64 * MiB, "shm"), ("reduce_scatter", 4, 16 * MiB, "shm"),
    ("reduce_scatter", 4, 64 * MiB, "hierarchical"), ("reduce_scatter", 8, 32 * MiB, "hierarchical"),
])
def test_large_blocks_on_one_host_in_one_hand_off(choice, collective, world, nbytes, want):
    assert choice(collective, nbytes, world) == want
