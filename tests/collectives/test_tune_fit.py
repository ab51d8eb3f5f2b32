"""The tuner's fitted lines (collectives/tunefit.py) and what the rules file sets besides algorithms:
lines recovered from made-up timings, the boundary at their crossing, extrapolation past the grid
and to a group size not tuned, the streaming threshold and the compiled path taken from the file
unless a setting forces them, and ``--explain``."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from collectives import costmodel, registry, tune, tunefile, tunefit
from collectives.costmodel import Link, Machine
from runtime.topology import HostTopology

M = Machine(loopback=Link(10e-6, 2e-6, 1e-9), shm=Link(1e-6, 1e-6, 0.1e-9), gamma=0.5e-9, copy=0.1e-9)
GRID = [4 << (2 * k) for k in range(13)]
MiB = 1 << 20


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("RINGWEAVE_TUNE", "1")
    for name in ("RINGWEAVE_TUNE_FILE", "RINGWEAVE_SHM_STREAM_MIN", "RINGWEAVE_SHM_COMPILED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    registry.forget()
    yield tmp_path
    registry.forget()


def line(alpha, beta):
    return lambda n: alpha + n * beta


def test_fit_recovers_a_line_and_keeps_terms_non_negative():
    t = line(20e-6, 1e-9)
    alpha, beta = tunefit.fit([(n, t(n)) for n in GRID])
    assert alpha == pytest.approx(20e-6, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6)
    assert tunefit.fit([(64, 5e-6)]) == (5e-6, 0.0)  # one point: flat
    alpha, beta = tunefit.fit([(1, 3e-6), (1000, 2e-6), (10**6, 1e-6)])  # falling times: no negative slope
    assert beta == 0.0 and 1e-6 < alpha < 3e-6
    assert tunefit.fit([(n, n * 2e-9) for n in GRID[3:]]) == pytest.approx((0.0, 2e-9))  # through the origin
    with pytest.raises(ValueError):
        tunefit.fit([(8, 0.0)])


def timings(lines: dict, sizes) -> dict:
    """Measured times as tune.measure keeps them: {"all_reduce": {"<bytes>": {algorithm: seconds}}}."""
    return {"all_reduce": {str(n): {a: f(n) for a, f in lines.items()} for n in sizes}}


def test_model_from_injected_timings_puts_the_boundary_at_the_crossing():
    lines = {"recursive_doubling": line(10e-6, 1e-9), "ring": line(100e-6, 0.5e-9)}  # cross at 180000 B
    sizes = [4, 64 << 10, MiB]
    fits = {a: tuple(v) for a, v in tune.fits_of(timings(lines, sizes))["all_reduce"].items()}
    winners = [(n, tune.pick({a: f(n) for a, f in lines.items()}, lines, None)) for n in sizes]
    assert winners == [(4, "recursive_doubling"), (65536, "recursive_doubling"), (MiB, "ring")]
    out = tunefit.thresholds(winners, fits, extrapolate=True)
    assert abs(out[0][0] - 180000) <= 1 and out == [[out[0][0], "recursive_doubling"], [None, "ring"]]
    # without lines: the geometric midpoint, as before the fit
    assert tunefit.thresholds(winners, {}, extrapolate=True) == [[262144, "recursive_doubling"], [None, "ring"]]
    # a crossing outside the two sizes (the lines disagree with the clock there): the midpoint
    far = {"recursive_doubling": (10e-6, 1e-9), "ring": (1e-3, 0.5e-9)}
    assert tunefit.thresholds(winners, far, extrapolate=True)[0] == [262144, "recursive_doubling"]


def test_lines_carry_the_rules_past_the_grid():
    fits = {"shm": (5e-6, 0.3e-9), "ring": (0.05, 0.2e-9), "tree": (1e-6, 1e-9)}
    # shm wins at the top (64 MiB); ring's flatter line crosses below it near 500 MB; tree never again
    out = tunefit.thresholds([(4, "tree"), (64 * MiB, "shm")], fits, extrapolate=True)
    far = int(tunefit.crossing(fits["shm"], fits["ring"]))
    assert 499e6 < far < 501e6
    assert out == [[int(tunefit.crossing(fits["tree"], fits["shm"])), "tree"], [far, "shm"], [None, "ring"]]
    assert tunefit.thresholds([(4, "tree"), (64 * MiB, "shm")], fits, extrapolate=False)[-2:] == \
        [[64 * MiB, "shm"], [None, None]]


def test_rescale_follows_the_models_latency_and_bandwidth_parts():
    lat = {p: costmodel.predict(M, "all_reduce", "ring", p, 0) for p in (2, 8)}
    bw = {p: (costmodel.predict(M, "all_reduce", "ring", p, tunefit.BIG) - lat[p]) / tunefit.BIG for p in (2, 8)}
    alpha, beta = tunefit.rescale(M, "all_reduce", "ring", (30e-6, 2e-9), 2, 8)
    assert alpha == pytest.approx(30e-6 * lat[8] / lat[2]) and beta == pytest.approx(2e-9 * bw[8] / bw[2])
    assert lat[8] / lat[2] == pytest.approx(7)  # 2(p-1) rounds


def save(world, fits=None, settings=None, rules=None, key=None, model=M):
    doc = {"format": tunefile.FORMAT, "key": key or tunefile.machine_key(world, 1, world),
           "rules": rules or {"shm": {}, "tcp": {}}, "fits": fits or {}, "settings": settings or {}}
    if model is not None:
        doc["model"] = model.to_json()
    return tunefile.save(doc, registry.ALGORITHMS, tunefile.default_path(tunefile.machine_key(world, 1, world)))


def test_a_group_size_not_tuned_takes_the_nearest_sizes_lines(fresh, monkeypatch):
    monkeypatch.setenv("RINGWEAVE_SHM", "0")
    fits = {"all_reduce": {"recursive_doubling": [10e-6, 2e-9], "ring": [60e-6, 0.75e-9]}}
    save(2, fits, {"shm_stream_min": 1 << 20, "shm_compiled": False})
    rules = tunefile.rules_for(4, 1, 4)
    assert rules is not None and "carried from 2 ranks" in rules.path
    assert rules.settings == {"shm_stream_min": 1 << 20}  # the compiled path depends on cores per rank
    moved = {a: tunefit.rescale(M, "all_reduce", a, v, 2, 4) for a, v in fits["all_reduce"].items()}
    for n in (4, 64 << 10, MiB, 64 * MiB):
        want = min(moved, key=lambda a: tunefit.at(moved[a], n))
        assert registry.choose("all_reduce", n, 4)[0] == want, n
    assert {registry.choose("all_reduce", n, 4)[0] for n in (4, 64 * MiB)} == {"recursive_doubling", "ring"}
    assert tunefile.rules_for(3, 1, 3).path.endswith("(carried from 2 ranks)")  # nearest: 2, not 4 (not a file)
    monkeypatch.setenv("RINGWEAVE_TUNE", "0")
    assert registry.choose("all_reduce", 64 * MiB, 4)[0] == "halving_doubling"  # the table


def test_another_machines_file_is_not_carried(fresh, caplog):
    save(2, {"all_reduce": {"ring": [1e-6, 1e-9]}}, key=dict(tunefile.machine_key(2), cpu="another"))
    with caplog.at_level(logging.WARNING, logger="ringweave.tune"):
        assert tunefile.rules_for(4, 1, 4) is None
    assert any("cpu differ" in r.getMessage() for r in caplog.records)


def group(world=2):
    return SimpleNamespace(size=world, topology=HostTopology.of("a" * world), shm_enabled=True)


def test_stream_threshold_from_the_file_unless_set(fresh, monkeypatch):
    assert tunefile.stream_min(group()) == 4 << 20  # no file: the default
    save(2, settings={"shm_stream_min": 123456})
    registry.forget()
    assert tunefile.stream_min(group()) == 123456
    monkeypatch.setenv("RINGWEAVE_SHM_STREAM_MIN", "4M")  # set, even to the default: it wins
    assert tunefile.stream_min(group()) == 4 << 20
    monkeypatch.setenv("RINGWEAVE_SHM_STREAM_MIN", " ")  # blank counts as unset
    assert tunefile.stream_min(group()) == 123456
    monkeypatch.setenv("RINGWEAVE_TUNE", "0")
    assert tunefile.stream_min(group()) == 4 << 20


@pytest.mark.parametrize("setting, tuned, own, cooperative, enabled", [
    ("auto", None, True, False, True),  # no file: the heuristic (a core per rank)
    ("auto", None, False, False, False),
    ("auto", True, False, False, True),  # the file's measurement over the heuristic
    ("auto", False, True, False, False),
    ("auto", False, False, True, True),  # tasks of one process: always
    ("0", True, True, False, False),  # a set value wins
    ("1", False, False, False, True),
])
def test_compiled_path_from_the_file_unless_set(fresh, monkeypatch, setting, tuned, own, cooperative, enabled):
    from collectives.slots import common, fastpath
    if tuned is not None:
        save(2, settings={"shm_compiled": tuned})
    monkeypatch.setenv("RINGWEAVE_SHM_COMPILED", setting)
    monkeypatch.setattr(common, "own_cores", lambda g, n: own)
    dom = SimpleNamespace(control_addresses=[0, 0], group=group(), rank=0, size=2, cooperative=cooperative)
    assert fastpath._Compiled(dom).enabled is enabled
    assert tunefile.compiled(group(), own) is (own if tuned is None else tuned)


def test_stream_cut():
    sizes = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
    assert tune.stream_cut(sizes, [False, False, True, True]) == 8 * MiB + 1
    assert tune.stream_cut(sizes, [True, True, True, True]) == 1 * MiB
    assert tune.stream_cut(sizes, [False, True, True, False]) == tune.NEVER  # lost at the top: never
    assert tune.stream_cut(sizes, [True, False, False, True]) == 32 * MiB + 1


@pytest.mark.parametrize("bad, why", [
    ({"fits": {"all_reduce": {"bogus": [1, 1]}}}, "unknown algorithm"),
    ({"fits": {"all_reduce": {"ring": [1, -1]}}}, "fits.all_reduce.ring[1]"),
    ({"fits": {"all_reduce": {"ring": [1]}}}, "[alpha, beta]"),
    ({"settings": {"shm_stream_min": -1}}, "byte count"),
    ({"settings": {"shm_compiled": 1}}, "true or false"),
    ({"settings": {"spin": 3}}, "keys among"),
])
def test_malformed_lines_or_settings_are_refused(fresh, bad, why):
    doc = {"format": tunefile.FORMAT, "key": tunefile.machine_key(2), "rules": {}, **bad}
    with pytest.raises(ValueError) as info:
        tunefile.parse(json.dumps(doc).encode(), None, registry.ALGORITHMS)
    assert why in str(info.value)


def test_round_trip_keeps_lines_and_settings(fresh):
    fits = {"all_reduce": {"ring": [6e-05, 7.5e-10]}}
    path = save(2, fits, {"shm_stream_min": 1 << 20, "shm_compiled": True})
    rules = tunefile.load(path, tunefile.machine_key(2), registry.ALGORITHMS)
    assert rules.fits == {"all_reduce": {"ring": (6e-05, 7.5e-10)}} and rules.model == M
    assert rules.settings == {"shm_stream_min": 1 << 20, "shm_compiled": True}


def test_explain_prints_lines_rules_and_settings(fresh, capsys):
    assert "built-in table chooses" in tune.explain(None, 2)
    save(2, {"all_reduce": {"ring": [6e-05, 1e-9]}}, {"shm_compiled": True},
         {"shm": {"all_reduce": [[65536, "shm"], [None, "ring"]]}})
    assert tune.main(["-n", "2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "ring (tcp)  alpha      60.0 us  1/beta 1.00 GB/s" in out
    assert "model terms: loopback alpha 10.0 us, o 2.0 us, 1/beta 1.00 GB/s; shm alpha 1.0 us" in out
    assert "[shm] all_reduce: 0..65536 B shm, 65537.. B ring" in out
    assert '"shm_compiled": true' in out
