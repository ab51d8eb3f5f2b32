"""The probe at init (collectives/tuneprobe.py) on ranks of one process: every rank ends with the
same rules however differently its own clock ran, the probe stops at its budget, it is off unless
asked for, and the rules it writes make the next job skip it."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from collectives import registry, tune, tuneprobe, tunefile
import runtime
from runtime.init import current
from runtime.store import MemoryStore

pytestmark = pytest.mark.timeout(120)

GRID = (64, 64 << 10)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The probe on, a small grid, rules read from a temporary cache; nothing loaded before."""
    monkeypatch.setenv("RINGWEAVE_TUNE", "1")
    monkeypatch.setenv("RINGWEAVE_TUNE_PROBE_S", "10")
    for name in ("RINGWEAVE_TUNE_FILE", "RINGWEAVE_SHM_STREAM_MIN", "RINGWEAVE_SHM_COMPILED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tuneprobe, "GRID", GRID)
    monkeypatch.setattr(tuneprobe, "STREAM_SIZES", (1 << 20,))
    registry.forget()
    yield tmp_path
    registry.forget()


def ticking(monkeypatch, step_s: float):
    """Every reading of a rank's clock is ``step_s`` after its last: each call takes the same time."""
    ticks: dict = {}

    def now():
        r = current().rank
        ticks[r] = ticks.get(r, 0) + 1
        return ticks[r] * step_s
    monkeypatch.setattr(tune, "_now", now)


async def test_ranks_agree_though_their_clocks_differ(fresh, monkeypatch, ranks):
    jitter, ticks = {r: random.Random(r) for r in range(3)}, {}

    def now():  # every reading of rank r's clock is (r + 1) ms after its last, and a jitter of its own
        r = current().rank
        ticks[r] = ticks.get(r, 0.0) + (r + 1) * 1e-3 + jitter[r].uniform(0, 1e-3)
        return ticks[r]
    monkeypatch.setattr(tune, "_now", now)

    async def body(world):
        doc = await tuneprobe.at_init(world.runtime)
        return doc, [registry.choose("all_reduce", n, 3, group=world)[0] for n in (4, 64 << 10, 1 << 20, 64 << 20)]
    results = await ranks(3, body)
    docs = [doc for doc, _ in results]
    assert docs[0] is not None and all(doc == docs[0] for doc in docs)
    assert set(docs[0]["times"]["all_reduce"]) == {str(tune.registry_nbytes("all_reduce", s, 3)) for s in GRID}
    assert len({tuple(chosen) for _, chosen in results}) == 1
    path = tunefile.default_path(tunefile.machine_key(3, 1, 3))
    assert os.stat(path).st_mode & 0o777 == 0o600
    written = tunefile.load(path, tunefile.machine_key(3, 1, 3), registry.ALGORITHMS)
    assert written.rules == tunefile.rules_for(3, 1, 3).rules  # what this job uses is what it cached

    def not_again(*a, **k):
        raise AssertionError("probed although every rank has the rules file")
    monkeypatch.setattr(tune, "measure", not_again)
    assert await ranks(3, lambda world: tuneprobe.at_init(world.runtime)) == [None] * 3


async def test_equal_times_keep_the_table_and_the_budget_bounds_the_sizes(fresh, monkeypatch, ranks):
    ticking(monkeypatch, 0.01)  # every call 10 ms: ties everywhere

    async def body(world):
        return await tuneprobe.at_init(world.runtime)
    doc = (await ranks(2, body))[0]
    assert len(doc["times"]["all_reduce"]) == len(GRID)
    rules = tunefile.rules_for(2, 1, 2)
    for state in doc["rules"]:
        for n in GRID:  # ties: the table's choice stays
            want = registry._chosen("all_reduce", n, 2, state == "shm", "one", 1)[0]
            assert rules.pick("all_reduce", state == "shm", n) == want, (state, n)
    registry.forget()
    os.remove(tunefile.default_path(tunefile.machine_key(2, 1, 2)))
    monkeypatch.setenv("RINGWEAVE_TUNE_PROBE_S", "0.05")  # spent by the model's terms already
    doc = (await ranks(2, body))[0]
    assert "all_reduce" not in doc["times"] and not any(doc["rules"].values())


@pytest.mark.parametrize("setting", [("RINGWEAVE_TUNE_PROBE_S", "0"), ("RINGWEAVE_TUNE", "0")])
async def test_off_measures_nothing(fresh, monkeypatch, ranks, setting):
    monkeypatch.setenv(*setting)

    def refuse(*a, **k):
        raise AssertionError("measured while off")
    monkeypatch.setattr(tune, "measure", refuse)
    monkeypatch.setattr(tune, "agreed_max", refuse)
    assert await ranks(2, lambda world: tuneprobe.at_init(world.runtime)) == [None, None]
    assert not os.path.exists(tunefile.cache_dir())


def test_a_bad_budget_is_a_setting_error(monkeypatch):
    from runtime import env
    from runtime.errors import SettingError
    monkeypatch.setenv("RINGWEAVE_TUNE_PROBE_S", "60")
    with pytest.raises(SettingError, match="RINGWEAVE_TUNE_PROBE_S"):
        env.TUNE_PROBE.get()


async def test_runtime_init_runs_the_probe(fresh, monkeypatch):
    """``import collectives`` registers the probe; runtime.init() runs it on every rank once joined."""
    ticking(monkeypatch, 0.01)
    store = MemoryStore(10)

    async def rank(r):
        rt = await runtime.init(r, 2, store=store, timeout_s=30)
        await rt.close()
    await asyncio.gather(*(rank(r) for r in range(2)))
    path = tunefile.default_path(tunefile.machine_key(2, 1, 2))
    assert tunefile.load(path, tunefile.machine_key(2, 1, 2), registry.ALGORITHMS).rules == \
        tunefile.rules_for(2, 1, 2).rules
