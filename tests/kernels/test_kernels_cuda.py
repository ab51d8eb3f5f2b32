"""Runs the CUDA reduction cases under the CUDA simulator, in a subprocess.

The simulator has to be switched on (NUMBA_ENABLE_CUDASIM=1) before numba.cuda
is first imported, and in a whole-suite pytest run some other test may already
have imported it; a fresh interpreter sidesteps that. On a machine with a GPU
and numba.cuda already imported, the same cases run on hardware by running
``pytest tests/kernels/cudasim_kernel_cases.py`` with the variable set to 0.
"""

import os
import pathlib
import subprocess
import sys

import pytest

CASES = pathlib.Path(__file__).with_name("cudasim_kernel_cases.py")


def test_cuda_kernels_under_simulator():
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
