"""Where the GPU cases run: on a real GPU in the pytest process, or under the CUDA simulator in a
fresh interpreter.

The case modules (``tests/*/gpu_*_cases.py``, every test marked ``gpu``) hold one set of tests for
both. numba.cuda decides at its first import whether it simulates (``NUMBA_ENABLE_CUDASIM``), which a
whole-suite pytest process cannot promise for the tests that want the simulator, so CI runs each case
module through :func:`run_under_simulator` (tests/*/test_*_cuda.py), and tests/conftest.py collects the
modules directly, in-process, where :func:`gpu_usable` (a real GPU, or the simulator switched on for
the whole process). README.md "GPU tests" says how to run them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def is_case_module(path: pathlib.Path) -> bool:
    return path.name.startswith("gpu_") and path.name.endswith("_cases.py")


@functools.cache
def gpu_usable() -> bool:
    """True where the GPU cases can run in this process: NUMBA_ENABLE_CUDASIM=1 is set, or a CUDA
    driver loads and numba.cuda finds a device. numba.cuda is imported only when the driver loads,
    so a machine without one (CI) never imports it here."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    try:
        from numba import cuda
    except ImportError:
        return False
    return bool(cuda.is_available())


def run_under_simulator(cases: pathlib.Path, timeout_s: float = 150) -> str:
    """Runs one case module under the simulator in a fresh interpreter; asserts that every case
    passed (none skipped or deselected) and returns pytest's output.

    The simulator runs device code on NumPy scalars, which warn on the uint64 wrap-around that the
    stochastic-rounding hash relies on (hardware wraps silently): that one warning is ignored.
    """
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
           "-W", "ignore:overflow encountered in scalar:RuntimeWarning", str(cases)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-2000:]
    assert " passed" in out and "skipped" not in out and "deselected" not in out, out[-2000:]
    assert "warning" not in out, out[-3000:]
    return out
