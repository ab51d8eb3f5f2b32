"""Shared test set-up: the repository root on sys.path (for tests.conformance), the multi-rank
fixture ``ranks`` from runtime.testing, and the ``gpu`` marker: the GPU case modules
(``tests/*/gpu_*_cases.py``) are collected where a GPU is usable (tests/cudasim.py), and run under
the simulator in CI through tests/*/test_*_cuda.py either way (marked ``cudasim``: this pytest run's
case modules run together, in one interpreter)."""

import os
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests import cudasim  # noqa: E402 - after the root is on sys.path

pytest_plugins = ["runtime.testing"]

# The built-in tables, whatever rules `python -m collectives.tune` left in this user's cache (the
# tuner's own tests turn them back on); ranks that tests start inherit it.
os.environ["RINGWEAVE_TUNE"] = "0"
# No warm-up at init: most test processes make a call or two, and loading every kernel in each of
# them costs the suite CPU (tests/collectives/test_coll_first_call.py turns it back on).
os.environ["RINGWEAVE_WARMUP"] = "0"
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":  # simulated threads get the GIL sooner (tests/cudasim.py)
    sys.setswitchinterval(cudasim.SWITCH_INTERVAL_S)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: numba.cuda cases (tests/*/gpu_*_cases.py): on a real GPU with `pytest -m gpu`, "
        "collected where numba.cuda finds a device; under the simulator in CI (tests/cudasim.py)")
    config.addinivalue_line(
        "markers", "cudasim(cases): the test runs the case module `cases` under the simulator; the session's "
        "case modules run in one interpreter (tests/cudasim.py)")


def pytest_collect_file(file_path, parent):
    """The GPU case modules, where a GPU is usable; a module named on the command line is
    collected by pytest itself."""
    if cudasim.is_case_module(file_path) and not parent.session.isinitpath(file_path) and cudasim.gpu_usable():
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_finish(session):
    """The case modules that the selected tests will run under the simulator, for one run of all."""
    for item in session.items:
        marker = item.get_closest_marker("cudasim")
        if marker is not None:
            cudasim.want(marker.args[0])
