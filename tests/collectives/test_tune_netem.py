"""``python -m collectives.tune --launched --quick`` across 2 emulated hosts (bench/netem.py): the
file is keyed to 2 hosts x 1 rank, written where the runtime on either host looks (one filesystem),
and every rank of a job of that shape loads it. Needs root, ip, tc and unshare; skipped otherwise."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collectives import registry, tunefile
from collectives.kernels import jitcache

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_netem_tune", ROOT / "bench" / "netem.py")
netem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netem)
WHY_NOT = netem.why_not()


@pytest.mark.serial
@pytest.mark.timeout(120)
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_tune_across_two_emulated_hosts(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "ringweave").mkdir(parents=True, mode=0o700)
    if os.path.isdir(jitcache.cache_root()):  # the compiled kernels this user has: no compiling in the run
        os.symlink(jitcache.cache_root(), cache / "ringweave" / "numba")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "RINGWEAVE_TUNE_FILE")}
    env.update(XDG_CACHE_HOME=str(cache), RINGWEAVE_TUNE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "netem.py"), "-n", "2", "--max-time-s", "90", "--",
                           "-m", "collectives.tune", "--launched", "--quick", "--ops", "barrier"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    key = tunefile.machine_key(2, 2, 1)
    path = tunefile.default_path(key)
    assert f"rules written to {path}" in proc.stdout
    assert "every rank of a job of this shape loads it" in proc.stdout, proc.stdout[-3000:]
    written = json.loads(Path(path).read_text())
    assert written["key"] == key and written["model"]["network"] is not None
    assert written["command"].startswith("python -m collectives.tune --launched --quick")
    tunefile.load(path, key, registry.ALGORITHMS)  # the checks every rank's load makes
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no one-host file beside it
