"""The tuner's rules file (collectives/tunefile.py) and registry.choose reading it: a round trip,
refusals (malformed, another user's, writable by others, a link, keyed to something else), the
rules used where present and the table where off or where the rule cannot run."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest

from collectives import registry, tune, tunefile, tunefit
from runtime.topology import HostTopology


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Rules on, read from a temporary cache; nothing loaded or chosen before."""
    monkeypatch.setenv("RINGWEAVE_TUNE", "1")
    monkeypatch.delenv("RINGWEAVE_TUNE_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    registry.forget()
    yield tmp_path
    registry.forget()


def doc(world=2, hosts=1, per_host=None, rules=None):
    return {"format": tunefile.FORMAT, "key": tunefile.machine_key(world, hosts, per_host),
            "rules": rules or {"tcp": {"all_reduce": [[1024, "ring"], [None, None]]}}}


def test_round_trip(fresh):
    path = tunefile.save(doc(), registry.ALGORITHMS)
    assert path == tunefile.default_path(tunefile.machine_key(2))
    assert path.startswith(str(fresh / "cache" / "ringweave" / "tune"))
    assert os.stat(path).st_mode & 0o777 == 0o600
    rules = tunefile.load(path, tunefile.machine_key(2), registry.ALGORITHMS)
    assert rules.pick("all_reduce", False, 1024) == "ring"
    assert rules.pick("all_reduce", False, 1025) is None  # past the rules: the table
    assert rules.pick("all_reduce", True, 8) is None  # no rules for shared memory on
    assert rules.pick("broadcast", False, 8) is None


def test_choose_takes_the_rules_and_the_table_when_off(fresh, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "0")
    assert registry.choose("all_reduce", 1024, 2)[0] == "recursive_doubling"  # no file: the table
    tunefile.save(doc(), registry.ALGORITHMS)
    assert registry.choose("all_reduce", 1024, 2)[0] == "recursive_doubling"  # files are read once
    registry.forget()
    assert registry.choose("all_reduce", 1024, 2)[0] == "ring"
    assert registry.choose("all_reduce", 4096, 2)[0] == "recursive_doubling"  # beyond the rules
    assert registry.choose("all_reduce", 1024, 2, "halving_doubling")[0] == "halving_doubling"  # overrides first
    assert registry.choose("all_reduce", 1024, 4)[0] == "recursive_doubling"  # another group size: no file
    monkeypatch.setenv("RINGWEAVE_ALGO_ALL_REDUCE", "halving_doubling")  # a setting changed between calls
    assert registry.choose("all_reduce", 1024, 2)[0] == "halving_doubling"
    monkeypatch.delenv("RINGWEAVE_ALGO_ALL_REDUCE")
    assert registry.choose("all_reduce", 1024, 2)[0] == "ring"
    monkeypatch.setenv("RINGWEAVE_TUNE", "0")
    assert registry.choose("all_reduce", 1024, 2)[0] == "recursive_doubling"
    monkeypatch.setenv("RINGWEAVE_TUNE", "1")
    assert registry.choose("all_reduce", 1024, 2)[0] == "ring"


def test_a_rule_that_cannot_run_falls_back_to_the_table(fresh, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "1")
    monkeypatch.setattr(registry, "shm_usable", lambda: True)
    group = SimpleNamespace(topology=HostTopology.of("aabb"), size=4, shm_enabled=True)
    tunefile.save(doc(4, 2, 2, {"shm": {"all_reduce": [[None, "shm"]]}}), registry.ALGORITHMS)  # "shm" needs one host
    assert registry.choose("all_reduce", 4096, 4, group=group)[0] == "recursive_doubling"
    assert registry.choose("all_reduce", 1 << 20, 4, group=group)[0] == "hierarchical"


def refused(caplog, fresh, monkeypatch, path) -> str:
    monkeypatch.setenv("RINGWEAVE_TUNE_FILE", str(path))
    with caplog.at_level(logging.WARNING, logger="ringweave.tune"):
        assert tunefile.rules_for(2, 1, 2, registry.ALGORITHMS) is None
        assert tunefile.rules_for(2, 1, 2, registry.ALGORITHMS) is None  # warned once
    lines = [r.getMessage() for r in caplog.records if r.name == "ringweave.tune"]
    assert len(lines) == 1 and "\n" not in lines[0] and "built-in table" in lines[0], lines
    assert registry.choose("all_reduce", 4, 2, subcall=True)[0] == "recursive_doubling"
    return lines[0]


def write(path, data: bytes, mode=0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mutate, why", [
    (lambda d: "{not json", "not JSON"),
    (lambda d: dict(d, format="other/1"), "format"),
    (lambda d: dict(d, key=dict(d["key"], cores=d["key"]["cores"] + 1)), "cores differ"),
    (lambda d: dict(d, key=dict(d["key"], world=4)), "world differ"),
    (lambda d: dict(d, key=dict(d["key"], version="0.0.0+other")), "version differ"),
    (lambda d: dict(d, rules={"tcp": {"all_reduce": [[None, "bogus"]]}}), "'bogus' is not a tcp algorithm"),
    (lambda d: dict(d, rules={"tcp": {"all_reduce": [[None, "shm"]]}}), "'shm' is not a tcp algorithm"),
    (lambda d: dict(d, rules={"tcp": {"all_reduce": [[64, "ring"], [8, "ring"], [None, None]]}}), "rising"),
    (lambda d: dict(d, rules={"tcp": {"all_reduce": [[64, "ring"]]}}), "null in the last"),
    (lambda d: dict(d, rules={"tcp": {"nope": [[None, "ring"]]}}), "unknown collective"),
    (lambda d: dict(d, pickle="x"), "unknown fields"),
])
def test_malformed_or_foreign_key_is_refused(fresh, monkeypatch, caplog, mutate, why):
    out = mutate(doc())
    data = (out if isinstance(out, str) else json.dumps(out)).encode()
    assert why in refused(caplog, fresh, monkeypatch, write(fresh / "rules.json", data))


def test_file_others_may_write_is_refused(fresh, monkeypatch, caplog):
    path = write(fresh / "rules.json", json.dumps(doc()).encode(), 0o666)
    assert "not a regular file of this user" in refused(caplog, fresh, monkeypatch, path)


def test_link_is_refused(fresh, monkeypatch, caplog):
    target = write(fresh / "real.json", json.dumps(doc()).encode())
    os.symlink(target, fresh / "link.json")
    assert "symbolic link" in refused(caplog, fresh, monkeypatch, fresh / "link.json")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_file_is_refused(fresh, monkeypatch, caplog):
    path = write(fresh / "rules.json", json.dumps(doc()).encode())
    os.chown(path, 65534, -1)
    assert "uid 65534" in refused(caplog, fresh, monkeypatch, path)


def test_missing_named_file_is_warned(fresh, monkeypatch, caplog):
    assert "no such file" in refused(caplog, fresh, monkeypatch, fresh / "absent.json")


def test_missing_cache_file_is_silent(fresh, caplog):
    with caplog.at_level(logging.WARNING, logger="ringweave.tune"):
        assert tunefile.rules_for(2, 1, 2, registry.ALGORITHMS) is None
    assert not caplog.records


def test_thresholds_cut_at_the_geometric_midpoint():
    winners = [(4, "a"), (64, "a"), (1024, "b")]
    assert tunefit.thresholds(winners, {}, extrapolate=True) == [[256, "a"], [None, "b"]]
    assert tunefit.thresholds(winners, {}, extrapolate=False) == [[256, "a"], [1024, "b"], [None, None]]
    assert tunefit.thresholds([(4, None)], {}, extrapolate=False) == [[None, None]]


def test_the_table_stays_within_tie_of_the_fastest():
    times = {"ring": 1.0, "direct": 1.03, "bruck": 2.0}
    assert tune.pick(times, times, "direct") == "direct"
    assert tune.pick(times, times, "bruck") == "ring"
    assert tune.pick(times, ["bruck"], "ring") == "bruck"
    assert tune.pick({}, [], "ring") == "ring"
