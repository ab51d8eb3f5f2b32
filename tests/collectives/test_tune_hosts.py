"""The tuner across hosts (collectives/tune.py, tunefile.py): the probe pairs ranks inside a host
and across hosts, and the link between hosts is what it measures as ``network``; the file is keyed
by the group's shape (hosts, most ranks on one), so a 2x2 file is never a one-host job's, and a job
of that shape loads it and chooses by it; the table's choices are those of the group's layout.
In process (ranks on hosts named by hand), and once across 2 emulated hosts (bench/netem.py:
needs root, ip, tc and unshare, skipped otherwise)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from collectives import p2p, registry, tune, tunefile
from collectives.kernels import jitcache
from runtime.init import current
from runtime.topology import HostTopology

ROOT = Path(__file__).resolve().parents[2]
CROSSING_S = 0.01  # what a message between the hosts named by hand costs in process
NUMBA_CACHE = jitcache.cache_root()  # this run's compiled kernels, before a test moves XDG_CACHE_HOME


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """Rules on, read from a temporary cache; nothing loaded before or after."""
    monkeypatch.setenv("RINGWEAVE_TUNE", "1")
    monkeypatch.delenv("RINGWEAVE_TUNE_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    registry.forget()
    yield tmp_path / "cache"
    registry.forget()


def group_on(nodes: str, shm: bool = True):
    """A stand-in group whose rank i is on host nodes[i] (what registry.choose reads of a group)."""
    return SimpleNamespace(topology=HostTopology.of(nodes), size=len(nodes), shm_enabled=shm)


@pytest.mark.parametrize("ids, inside, across", [
    ("aaaa", [1, 0, 3, 2], [None] * 4),                   # one host: r ^ 1, as before
    ("aaa", [1, 0, None], [None] * 3),
    ("aabb", [1, 0, 3, 2], [2, 3, 0, 1]),                 # 2x2: the i-th rank of each host together
    ("abab", [2, 3, 0, 1], [1, 0, 3, 2]),                 # interleaved: by place on the host, not rank
    ("abcd", [None] * 4, [1, 0, 3, 2]),                   # a rank per host: host 0-1, 2-3
    ("aabbb", [1, 0, 3, 2, None], [2, 3, 0, 1, None]),    # unequal hosts: the extra rank measures nothing
    ("aabbcc", [1, 0, 3, 2, 5, 4], [2, 3, 0, 1, None, None]),  # an odd host out
])
def test_the_probe_pairs_ranks_inside_and_across_hosts(ids, inside, across):
    nodes = HostTopology.of(ids).nodes
    got = [tune.partners(nodes, r) for r in range(len(ids))]
    assert [g[0] for g in got] == inside and [g[1] for g in got] == across
    for r, (i, a) in enumerate(got):  # a pair is mutual, on one host and across two
        assert i is None or (got[i][0] == r and ids[i] == ids[r])
        assert a is None or (got[a][1] == r and ids[a] != ids[r])


async def test_measure_on_two_hosts_keys_by_shape_and_measures_the_link_between(cache, monkeypatch, ranks):
    """4 ranks on hosts a a b b, a message between a and b 10 ms late: the network link's round is
    at least that and loopback's is not; the file is keyed 4 ranks on 2 hosts x 2; with every
    algorithm timed equal, the rules are the packed table's choices, not one host's."""
    send = p2p.send

    async def crossing(buf, dst, *args, **kw):
        if current().nodes[current().rank] != current().nodes[dst]:
            await asyncio.sleep(CROSSING_S)
        return await send(buf, dst, *args, **kw)
    monkeypatch.setattr(p2p, "send", crossing)

    async def ties(starts, quick):  # every algorithm equal: the table's choice stays
        return {name: 1e-3 for name in starts}
    monkeypatch.setattr(tune, "time_calls", ties)

    async def body(world):
        world.runtime.nodes = list("aabb")
        return await tune.measure(world.runtime, ("all_reduce", "reduce_scatter"), (4, 256 << 10), True, False)
    docs = await ranks(4, body, timeout_s=60)
    doc = docs[0]
    assert all(d["key"] == doc["key"] for d in docs) and doc["key"] == tunefile.machine_key(4, 2, 2)
    model = tunefile.parse(json.dumps(doc).encode(), None, registry.ALGORITHMS).model
    assert model.network is not None and model.network.alpha >= CROSSING_S
    assert model.loopback.alpha < CROSSING_S / 2 < model.network.alpha
    rules = tunefile.TuneRules(doc["key"], {s: {c: tuple(map(tuple, e)) for c, e in t.items()}
                                            for s, t in doc["rules"].items()})
    for state in doc["rules"]:
        on = state == "shm"
        for collective in ("all_reduce", "reduce_scatter"):
            for n in (tune.registry_nbytes(collective, s, 4) for s in (4, 256 << 10)):
                assert rules.pick(collective, on, n) == registry._chosen(collective, n, 4, on, "packed", 2)[0]
    n = tune.registry_nbytes("all_reduce", 256 << 10, 4)  # where the packed table differs from one host's
    assert rules.pick("all_reduce", False, n) == "ring" != registry._chosen("all_reduce", n, 4, False, "one", 1)[0]


def two_by_two(pick: str) -> dict:
    """A rules file for 4 ranks on 2 hosts x 2 naming ``pick`` for reduce_scatter to 64 KiB."""
    entries = [[64 << 10, pick], [None, None]]
    return {"format": tunefile.FORMAT, "key": tunefile.machine_key(4, 2, 2),
            "rules": {"shm": {"reduce_scatter": entries}, "tcp": {"reduce_scatter": [[64 << 10, "ring"], [None, None]]}}}


def test_a_two_host_file_serves_its_shape_only(cache):
    assert registry.choose("reduce_scatter", 64, 4, group=group_on("aabb"))[0] == "ring"  # the table
    path = tunefile.save(two_by_two("hierarchical"), registry.ALGORITHMS)
    assert path == tunefile.default_path(tunefile.machine_key(4, 2, 2)) and "/w4-h2x2-" in path
    registry.forget()
    assert tunefile.rules_for(4, 2, 2).path == path
    assert tunefile.rules_for(4, 1, 4) is None and tunefile.rules_for(4, 4, 1) is None  # not carried either
    assert registry.choose("reduce_scatter", 64, 4, group=group_on("aabb"))[0] == "hierarchical"
    assert registry.choose("reduce_scatter", 128 << 10, 4, group=group_on("aabb"))[0] == "ring"  # past it: the table
    assert registry.choose("reduce_scatter", 64, 4, group=group_on("aabb", shm=False))[0] == "ring"
    assert registry.choose("reduce_scatter", 64, 4, group=group_on("aaaa"))[0] == "shm"  # one host: the table
    assert path in tune.explain(tunefile.rules_for(4, 2, 2), 4, hosts=2)
    assert "no rules for 4 ranks on 2 hosts x 2" in tune.explain(None, 4, hosts=2)


def test_holds_tells_the_file_written_from_another(cache):
    doc = two_by_two("hierarchical")
    path = tunefile.default_path(doc["key"])
    assert not tunefile.holds(path, doc)
    tunefile.save(doc, registry.ALGORITHMS)
    assert tunefile.holds(path, doc) and not tunefile.holds(path, two_by_two("ring"))


@pytest.mark.parametrize("text, nbytes", [("4096", 4096), ("64K", 65536), ("256KiB", 256 << 10), ("1m", 1 << 20)])
def test_max_size_reads_sizes(text, nbytes):
    assert tune.size(text) == nbytes
    with pytest.raises(ValueError, match="not a size"):
        tune.size("1.5M")


_spec = importlib.util.spec_from_file_location("bench_netem", ROOT / "bench" / "netem.py")
netem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netem)
WHY_NOT = netem.why_not()


@pytest.mark.serial
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
@pytest.mark.timeout(90)
def test_tune_across_two_emulated_hosts(cache):
    """--quick across 2 emulated hosts x 2 ranks: the file is keyed 2x2, in the cache both hosts
    read, and every rank of the job loads it at that shape (the tuner checks it and says so)."""
    (cache / "ringweave").mkdir(parents=True)
    os.symlink(NUMBA_CACHE, cache / "ringweave" / "numba")  # the kernels compiled already (else a minute)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "netem.py"), "-n", "2", "--per-node", "2", "--shm", "on",
                           "--max-time-s", "60", "--", "-m", "collectives.tune", "--launched", "--quick",
                           "--ops", "reduce_scatter"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tunefile.default_path(tunefile.machine_key(4, 2, 2))
    assert f"rules written to {path}" in proc.stdout, proc.stdout[-3000:]
    assert "every rank of a job of this shape loads it; it chooses reduce_scatter 16 B " in proc.stdout
    rules = tunefile.load(path, tunefile.machine_key(4, 2, 2), registry.ALGORITHMS)
    assert (rules.key["world"], rules.key["hosts"], rules.key["per_host"]) == (4, 2, 2)
    assert rules.model.network is not None
    assert tunefile.rules_for(4, 1, 4) is None  # a one-host job of 4 ranks does not take it
