"""``python -m collectives.tune -n 2 --quick`` launches two ranks, measures and writes a rules file
that the checks of collectives/tunefile.py accept for this machine and layout."""

from __future__ import annotations

import os
import subprocess
import sys

from collectives import registry, tunefile
from collectives.kernels import jitcache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_tune_writes_a_valid_rules_file(tmp_path):
    os.makedirs(tmp_path / "ringweave", mode=0o700)
    if os.path.isdir(jitcache.cache_root()):  # the kernels compiled already: the run does not compile them again
        os.symlink(jitcache.cache_root(), tmp_path / "ringweave" / "numba")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "collectives.tune", "-n", "2", "--quick",
                           "--ops", "all_reduce,barrier", "--timeout-s", "60"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    key = tunefile.machine_key(2, 1, 2)
    path = tunefile.default_path(key).replace(tunefile.cache_dir(), os.path.join(tmp_path, "ringweave", "tune"))
    assert f"rules written to {path}" in proc.stdout
    assert "every rank of a job of this shape loads it" in proc.stdout or "RINGWEAVE_TUNE=0" in proc.stdout
    assert os.stat(path).st_mode & 0o777 == 0o600
    rules = tunefile.load(path, key, registry.ALGORITHMS)
    for state in rules.rules:
        for collective in ("all_reduce", "barrier"):
            entries = rules.rules[state][collective]
            assert entries[-1] == (None, None)  # --quick: beyond its sizes, the table
            for _, name in entries[:-1]:
                assert name in registry.ALGORITHMS[collective]
