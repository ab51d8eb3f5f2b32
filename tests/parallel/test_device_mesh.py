"""The n-dimensional mesh against a plain NumPy reference: for every shape (1-d to 4-d, sizes of 1
among them) the members of each group, of each sub-mesh (slices and transposes) and of each
flattened dimension are the ranks that ``arange(P).reshape(shape)`` puts there, found by brute
force over every rank's coordinates; every rank makes the same groups in the same order; the
trainer's mesh with replicas (HSDP) lays dp out as replicas x shard ranks; a lost rank fails
every group of the mesh."""

import asyncio
import itertools

import numpy as np
import pytest

from runtime.errors import PeerLostError
from runtime.testing import run_ranks
from trainer.parallel import DeviceMesh, Mesh

SHAPES = [((5,), ("x",)), ((2, 3), ("dp", "tp")), ((2, 2, 2), ("a", "b", "c")),
          ((3, 1, 2, 2), ("pp", "r", "s", "tp"))]


def reference(shape, axes: list[int], rank: int) -> np.ndarray:
    """The ranks of ``rank``'s slice over ``axes`` (indices, in that order) of arange(P).reshape(shape):
    entry [i, j, ...] is the rank whose coordinates are rank's, but i, j, ... on those axes."""
    P = int(np.prod(shape))
    coords = np.array(np.unravel_index(np.arange(P), shape)).T  # (P, ndim)
    out = np.full([shape[a] for a in axes], -1)
    for q in range(P):
        if all(coords[q][d] == coords[rank][d] for d in range(len(shape)) if d not in axes):
            out[tuple(coords[q][a] for a in axes)] = q
    assert (out >= 0).all()
    return out


def flat_reference(shape, axes: list[int], rank: int) -> list[int]:
    """The flattened group over ``axes``: that slice, row-major in the order of ``axes``."""
    return reference(shape, axes, rank).reshape(-1).tolist()


def slicings(names):
    """Every ordered choice of 1 or more names: slices in the mesh's order and transposed."""
    return [c for k in range(1, len(names) + 1) for c in itertools.permutations(names, k)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape, names", SHAPES, ids=["1d", "2d", "3d", "4d"])
async def test_groups_slices_and_flattening_equal_the_numpy_reference(shape, names):
    P = int(np.prod(shape))
    flats = [c for k in (2, 3) for c in itertools.combinations(range(len(names)), k)]  # in mesh order
    flats += [tuple(reversed(c)) for c in flats if len(c) == 2]  # and backwards

    async def body(world):
        mesh = DeviceMesh(world, shape, names)
        groups = {n: (mesh[n].ranks, mesh[n].rank) for n in names}
        subs = {s: (mesh[s].ranks.tolist(), mesh[s].coords, dict(mesh[s].shape)) for s in slicings(names)}
        flat = {}
        for axes in flats:
            group = mesh.flatten([names[a] for a in axes], "f" + "".join(map(str, axes)))
            flat[axes] = (group.ranks, group.rank, mesh.coordinate(world.rank, ["f" + "".join(map(str, axes))]))
        every = {n: mesh.members(n) for n in names}
        return mesh.coords, groups, subs, flat, every, mesh.rank_of(**mesh.coords)

    for rank, (coords, groups, subs, flat, every, back) in enumerate(await run_ranks(P, body)):
        want = dict(zip(names, np.unravel_index(rank, shape)))
        assert coords == want and back == rank
        for i, n in enumerate(names):
            assert groups[n] == (flat_reference(shape, [i], rank), want[n])  # group rank == coordinate
            # every group along n, in rank order of its first member (the order the ranks make them)
            assert every[n] == [g for q in range(P) if (g := flat_reference(shape, [i], q))[0] == q]
        for sub, (members, sub_coords, sub_shape) in subs.items():
            axes = [names.index(n) for n in sub]
            assert members == reference(shape, axes, rank).tolist(), sub
            assert sub_coords == {n: want[n] for n in sub} and sub_shape == {n: shape[names.index(n)] for n in sub}
        for axes, (members, group_rank, coordinate) in flat.items():
            assert members == flat_reference(shape, list(axes), rank), axes
            assert group_rank == members.index(rank) == list(coordinate.values())[0]


@pytest.mark.timeout(60)
async def test_every_rank_makes_the_same_groups_in_the_same_order():
    async def body(world):
        await asyncio.sleep(0.001 * world.rank)  # ranks reach the mesh at different times
        mesh = DeviceMesh(world, (2, 3, 2), ("a", "b", "c"))
        mesh["a", "c"].flatten(("a", "c"), "ac")  # through a sub-mesh: groups for every slice
        mesh.flatten(("a", "c"), "ac")  # again: the same group, nothing made
        Mesh(world, tp=2, replicate=3)
        return [(gid, tuple(g.ranks)) for gid, g in sorted(world.runtime.groups.items())]

    made = await asyncio.wait_for(run_ranks(12, body), 30)
    assert all(m == made[0] for m in made)
    # world; c, b, a groups; ac; then the trainer's tp, dp_shard, dp_replicate, pp (1-rank groups), dp
    assert len(made[0]) == 1 + (6 + 4 + 6) + 3 + (6 + 6 + 4 + 12 + 2)
    assert made[0][17] == (17, (0, 1, 6, 7)) and made[0][18] == (18, (2, 3, 8, 9))  # ac: a x c, row-major


@pytest.mark.timeout(30)
async def test_names_slices_and_flattening_that_do_not_fit_are_refused():
    async def body(world):
        with pytest.raises(ValueError, match=r"mesh a=2 x b=2 = 4 ranks, but the world has 6"):
            DeviceMesh(world, (2, 2), ("a", "b"))
        with pytest.raises(ValueError, match="must be distinct non-empty strings"):
            DeviceMesh(world, (2, 3), ("a", "a"))
        with pytest.raises(ValueError, match="mesh size b must be a positive integer, got 0"):
            DeviceMesh(world, (6, 0), ("a", "b"))
        mesh = DeviceMesh(world, (2, 3), ("a", "b"))
        with pytest.raises(KeyError, match=r"one of \('a', 'b'\), got 'c'"):
            mesh["c"]
        mesh.flatten(("a", "b"), "ab")
        with pytest.raises(KeyError, match="overlap"):
            mesh["ab", "a"]
        with pytest.raises(ValueError, match="the name 'a' is taken"):
            mesh.flatten(("b",), "a")
        with pytest.raises(ValueError, match="the name 'ab' is taken"):
            mesh.flatten(("b", "a"), "ab")
        with pytest.raises(ValueError, match="outside 0..2"):
            mesh.rank_of(a=0, b=3)
        with pytest.raises(ValueError, match="no coordinate for"):
            mesh.rank_of(a=0)
        with pytest.raises(ValueError, match="given twice"):
            mesh.rank_of(a=0, ab=1)
        return mesh.rank_of(ab=4), mesh["ab"].ranks, mesh["ab"] is mesh.flatten(("a", "b"), "ab")

    assert await run_ranks(6, body) == [(4, list(range(6)), True)] * 6


@pytest.mark.timeout(30)
async def test_hsdp_lays_dp_out_as_replicas_of_contiguous_shard_groups():
    async def body(world):
        mesh = Mesh(world, tp=2, replicate=2)  # 8 ranks: dp 4 = 2 replicas x 2 shard ranks
        plain = Mesh(world, tp=2)  # replicate=1: dp_shard is the dp group, dp_replicate one rank
        out = {d: mesh[d].ranks for d in ("dp", "dp_shard", "dp_replicate", "tp")}
        return (mesh.shape, mesh.coords, out, mesh.rank_of(pp=0, dp=3, tp=1), repr(mesh),
                plain["dp_shard"] is plain["dp"], plain["dp_replicate"].ranks)

    for rank, (shape, coords, groups, rank_of, text, same, single) in enumerate(await run_ranks(8, body)):
        assert shape == {"pp": 1, "dp": 4, "tp": 2} and coords == {"pp": 0, "dp": rank // 2, "tp": rank % 2}
        block = rank // 4 * 4  # a shard group and its tp peers: 4 contiguous ranks (a host of 4)
        assert groups["dp_shard"] == [block + rank % 2, block + 2 + rank % 2]
        assert groups["dp_replicate"] == [rank % 4, rank % 4 + 4]
        assert groups["dp"] == [rank % 2 + 2 * i for i in range(4)]  # replica-major: dp = r * shard + s
        assert rank_of == 7 and "dp=4 (dp_replicate=2 x dp_shard=2)" in text
        assert same and single == [rank]


@pytest.mark.timeout(30)
async def test_one_replica_per_host_and_replica_counts_that_do_not_divide():
    async def body(world):
        world.runtime.nodes = ["a"] * 4 + ["b"] * 4  # the launcher's layout on two hosts of 4
        sizes = [Mesh(world, replicate="hosts").dim_size("dp_replicate"),
                 Mesh(world, tp=2, replicate="hosts").dim_size("dp_replicate"),
                 Mesh(world, pp=2, replicate="hosts").dim_size("dp_replicate")]  # each stage is a host
        world.runtime.nodes = ["a"] * 8
        sizes.append(Mesh(world, replicate="hosts").dim_size("dp_replicate"))
        with pytest.raises(ValueError, match=r"dp=4 ranks do not split into replicate=3 replicas"):
            Mesh(world, tp=2, replicate=3)
        return sizes

    assert await run_ranks(8, body) == [[2, 2, 1, 1]] * 8


@pytest.mark.timeout(60)
async def test_a_lost_rank_fails_every_group_of_an_hsdp_mesh():
    leaver = 3

    async def body(world):
        mesh = Mesh(world, replicate=2)  # 4 ranks: shard groups [0, 1] [2, 3], replicas [0, 2] [1, 3]
        if world.rank == leaver:
            for conn in list(world.runtime.actor.conns.values()):
                conn.abort()
            return None
        async with asyncio.timeout(10):
            while mesh.error is None:
                await asyncio.sleep(0.01)
        return [(g.ranks, type(g.error), str(g.error)) for g in mesh.groups()]

    for rank, out in enumerate(await run_ranks(4, body, transport="tcp", timeout_s=20)):
        if rank == leaver:
            continue
        assert len(out) == 5  # the 1-rank tp and pp groups, dp_shard, dp_replicate and dp
        for ranks, kind, message in out:
            assert issubclass(kind, PeerLostError) and "rank 3" in message, (rank, ranks, message)
