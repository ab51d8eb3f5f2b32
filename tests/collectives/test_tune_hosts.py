"""The tuner across hosts (collectives/tune.py), in one process: the probe's pairs (one on the
rank's host, one on another), the file keyed to the world's shape and its choices taken for the
world's layout, a 2x2 file found by every 2x2 job and by no one-host 4-rank job, and a launched
run's checks (every host's first rank holds the file; a job of the shape loads it)."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from collectives import api, costmodel, p2p, registry, tune, tunefile
from runtime.init import current
from runtime.topology import HostTopology
from test_tune_probe import ticking  # every call the same time: ties

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Rules on, read from a temporary cache; shared memory off; nothing loaded or chosen before."""
    monkeypatch.setenv("RINGWEAVE_TUNE", "1")
    monkeypatch.setenv("RINGWEAVE_SHM", "0")
    for name in ("RINGWEAVE_TUNE_FILE", "RINGWEAVE_TUNE_PROBE_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    registry.forget()
    yield tmp_path
    registry.forget()


def group_of(nodes: str):
    return SimpleNamespace(topology=HostTopology.of(nodes), size=len(nodes), shm_enabled=True)


@pytest.mark.parametrize("nodes, want", [
    ("aabb", {0: (1, 2), 1: (0, 3), 2: (3, 0), 3: (2, 1)}),          # the launcher's 2x2
    ("abab", {0: (2, 1), 1: (3, 0), 2: (0, 3), 3: (1, 2)}),          # ranks dealt round-robin
    ("ab", {0: (None, 1), 1: (None, 0)}),                            # a host each
    ("aaa", {0: (1, None), 1: (0, None), 2: (None, None)}),          # one host, an odd count
    ("aabbc", {0: (1, 2), 1: (0, 3), 2: (3, 0), 3: (2, 1), 4: (None, None)}),  # an odd host count
])
def test_probe_partners(nodes, want):
    topo = HostTopology.of(nodes)
    got = {r: tune.partners(topo.nodes, r) for r in range(len(nodes))}
    assert got == want
    for r, (inside, across) in got.items():  # pairs are mutual, on one host / on two
        if inside is not None:
            assert got[inside][0] == r and nodes[inside] == nodes[r]
        if across is not None:
            assert got[across][1] == r and nodes[across] != nodes[r]


def test_fitted_link_recovers_the_closed_form():
    alpha, beta, o = 50e-6, 1e-9, 5e-6
    sizes = (8, 64 << 10, 1 << 20, 4 << 20)
    halves = [alpha if n == 8 else alpha + n * beta for n in sizes]
    link = tune.fitted_link(sizes, halves, 2 * alpha + (tune.BURST - 1) * o)
    assert link.alpha == pytest.approx(alpha) and link.beta == pytest.approx(beta, rel=1e-6)
    assert link.o == pytest.approx(o)


def test_candidates_follow_the_layout():
    m = costmodel.Machine(costmodel.Link(30e-6, 5e-6, 1e-9), costmodel.Link(2e-6, 1e-6, 1e-10), 1e-10, 1e-10,
                          costmodel.Link(1e-3, 5e-6, 1e-8))
    one = tune.candidates(m, "reduce_scatter", 4, 4096, True, True, "one", 1)
    packed = tune.candidates(m, "reduce_scatter", 4, 4096, True, True, "packed", 2)
    assert "shm" in one and "shm" not in packed and "hierarchical" in packed  # shm maps every peer: one host
    assert "hierarchical" not in tune.candidates(m, "reduce_scatter", 4, 4096, False, True, "packed", 2)
    for n in (16, 4096, 1 << 20):  # the table's choice for the layout is always timed
        table = registry._chosen("reduce_scatter", n, 4, True, "packed", 2)[0]
        assert table in tune.candidates(m, "reduce_scatter", 4, n, True, False, "packed", 2)


def sends(monkeypatch) -> list:
    """Records (rank, peer, tag) of every p2p.send."""
    seen, send = [], p2p.send

    async def recording(buf, dst, *a, tag=0, **k):
        seen.append((current().rank, dst, tag))
        return await send(buf, dst, *a, tag=tag, **k)
    monkeypatch.setattr(p2p, "send", recording)
    return seen


async def test_measure_keys_the_file_to_the_shape_and_takes_the_layouts_table(fresh, monkeypatch, ranks):
    ticking(monkeypatch, 0.01)  # every call 10 ms: ties everywhere, the table's choices stay
    seen = sends(monkeypatch)

    async def body(world):
        world.runtime.nodes = ["a", "a", "b", "b"]
        doc = await tune.measure(world.runtime, ("reduce_scatter", "broadcast"), (4, 64 << 10), True, False)
        return await tune.shared(world.runtime, doc)
    docs = await ranks(4, body)
    assert all(d == docs[0] for d in docs)
    doc = docs[0]
    assert doc["key"] == tunefile.machine_key(4, 2, 2) and doc["model"]["network"] is not None
    # the probe: every rank pings its host's other rank (tags 7-9) and its peer on the other host (10-12)
    inside = {(r, d) for r, d, t in seen if t in (7, 8, 9)}
    across = {(r, d) for r, d, t in seen if t in (10, 11, 12)}
    assert inside == {(0, 1), (1, 0), (2, 3), (3, 2)} and across == {(0, 2), (2, 0), (1, 3), (3, 1)}
    rules = tunefile.parse(tunefile._text(doc).encode(), None, registry.ALGORITHMS)
    for state in doc["rules"]:
        for collective in ("reduce_scatter", "broadcast"):
            for nbytes in map(int, doc["times"][collective]):
                want = registry._chosen(collective, nbytes, 4, state == "shm", "packed", 2)[0]
                assert rules.pick(collective, state == "shm", nbytes) == want, (state, collective, nbytes)


async def test_one_host_probe_measures_no_network(fresh, monkeypatch, ranks):
    ticking(monkeypatch, 0.01)
    seen = sends(monkeypatch)
    docs = await ranks(2, lambda world: tune.measure(world.runtime, ("barrier",), (0,), True, False))
    assert docs[0]["key"] == tunefile.machine_key(2, 1, 2) and docs[0]["model"].get("network") is None
    assert not [t for _, _, t in seen if t in (10, 11, 12)]


def rules_doc(world, hosts, per_host, chosen="hierarchical"):
    return {"format": tunefile.FORMAT, "key": tunefile.machine_key(world, hosts, per_host),
            "rules": {"shm": {"reduce_scatter": [[65536, chosen], [None, None]]},
                      "tcp": {"reduce_scatter": [[None, None]]}}}


def test_a_two_host_file_is_found_by_its_shape_only(fresh, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "1")
    monkeypatch.setattr(registry, "shm_usable", lambda: True)
    packed, mixed, one, uneven = group_of("aabb"), group_of("abab"), group_of("aaaa"), group_of("aaab")
    table = {name: registry.choose("reduce_scatter", 1024, 4, group=g)[0]
             for name, g in (("packed", packed), ("one", one))}
    assert table["packed"] == "ring"  # what the file is for: the table keeps ring at 2x2
    path = tunefile.save(rules_doc(4, 2, 2), registry.ALGORITHMS)
    assert path == tunefile.default_path(tunefile.machine_key(4, 2, 2)) and "-h2x2-" in os.path.basename(path)
    registry.forget()
    assert registry.choose("reduce_scatter", 1024, 4, group=packed)[0] == "hierarchical"
    assert registry.choose("reduce_scatter", 1024, 4, group=mixed)[0] == "hierarchical"  # the same shape
    assert registry.choose("reduce_scatter", 1 << 20, 4, group=packed)[0] == \
        registry._chosen("reduce_scatter", 1 << 20, 4, True, "packed", 2)[0]  # past the rules: the table
    assert tunefile.for_group(one) is None and tunefile.rules_for(4, 1, 4) is None  # a one-host job: never
    assert registry.choose("reduce_scatter", 1024, 4, group=one)[0] == table["one"]
    assert tunefile.for_group(uneven) is None  # 2 hosts, 3 on one: another shape
    assert tunefile.rules_for(4, 2, 2).path == path
    text = tune.explain(tunefile.rules_for(4, 2, 2), 4, hosts=2)
    assert path in text and '"hosts": 2' in text
    assert "2 hosts x 2" in tune.explain(None, 4, hosts=2)


async def test_every_host_holds_the_file_and_a_job_of_the_shape_loads_it(fresh, monkeypatch, ranks):
    doc = dict(rules_doc(4, 2, 2, "ring"), times={"reduce_scatter": {"16": {"ring": 1e-3}}})
    path = tunefile.default_path(doc["key"])
    wrote_there: set = set()
    holds = tunefile.holds

    def other_filesystem(p, d):  # host b's first rank (rank 2) sees a filesystem of its own, once
        if current().rank == 2 and 2 not in wrote_there:
            wrote_there.add(2)
            return False
        return holds(p, d)
    monkeypatch.setattr(tunefile, "holds", other_filesystem)

    async def body(world):
        world.runtime.nodes = ["a", "a", "b", "b"]
        wrote = await tune.write_on_every_host(world.runtime, doc, path)
        return wrote, await tune.loaded_by_a_job(world.runtime, doc, path, ["reduce_scatter"])
    results = await ranks(4, body)
    assert [w for w, _ in results] == [True, False, True, False]  # rank 0, then host b's first rank
    assert holds(path, doc)
    assert all(line == results[0][1] for _, line in results)
    assert results[0][1].startswith("# every rank of a job of this shape loads it") and "ring" in results[0][1]
    os.remove(path)
    registry.forget()

    async def one_host(world):  # the same file under a one-host key's name: not loaded by this 2x2 job
        world.runtime.nodes = ["a", "a", "b", "b"]
        if world.rank == 0:
            tunefile.save(dict(doc, key=tunefile.machine_key(4, 1, 4)), registry.ALGORITHMS)
        await api.barrier()
        return await tune.loaded_by_a_job(world.runtime, doc, path, ["reduce_scatter"])
    assert all(line.startswith("# NOT loaded") for line in await ranks(4, one_host))


async def test_the_network_link_is_the_one_between_hosts(fresh, monkeypatch, ranks):
    """A message between hosts a and b 10 ms late: the network link's round is at least that,
    loopback's (inside a host) well below it."""
    crossing_s, send = 0.01, p2p.send

    async def late_across(buf, dst, *a, **k):
        if current().nodes[current().rank] != current().nodes[dst]:
            await asyncio.sleep(crossing_s)
        return await send(buf, dst, *a, **k)
    monkeypatch.setattr(p2p, "send", late_across)

    async def body(world):
        world.runtime.nodes = ["a", "a", "b", "b"]
        return await tune.probe(world.runtime, True)
    machines = await ranks(4, body, timeout_s=60)
    m = machines[0]
    assert all(x == m for x in machines)
    assert m.network.alpha >= crossing_s and m.loopback.alpha < crossing_s / 2


def test_holds_tells_the_file_written_from_another(fresh):
    doc = rules_doc(4, 2, 2)
    path = tunefile.default_path(doc["key"])
    assert not tunefile.holds(path, doc)
    tunefile.save(doc, registry.ALGORITHMS)
    assert tunefile.holds(path, doc) and not tunefile.holds(path, rules_doc(4, 2, 2, "ring"))


def test_the_command_line():
    assert [tune.size(t) for t in ("4096", "64K", "256KiB", "1M", "1g")] == [4096, 64 << 10, 256 << 10, 1 << 20, 1 << 30]
    for bad in ("", "K", "1.5M", "64X"):
        with pytest.raises(ValueError, match="not a size"):
            tune.size(bad)
    assert tune.parse_args(["--launched", "--max-size", "256K"]).max_size == 256 << 10
    for argv in (["-n", "4", "--hosts", "2"], ["--max-size", "2"], ["--max-size", "1.5M"]):
        with pytest.raises(SystemExit):
            tune.parse_args(argv)
    args = tune.parse_args(["-n", "4", "--hosts", "2", "--explain"])
    assert (args.nproc, args.hosts) == (4, 2)
    assert tune.command(tune.parse_args(["--launched", "--quick"]), 2, 2).startswith(
        "python -m collectives.tune --launched --quick (on 2 hosts, at most 2 ranks on one)")
