"""Runs the CUDA codec cases under the CUDA simulator, in a fresh interpreter.

NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported, which a
whole-suite pytest process cannot promise. The simulator runs device code with
NumPy scalars, which warn on the uint64 wrap-around that the stochastic-rounding
hash relies on (hardware wraps silently); that one warning is ignored there.
"""

import os
import pathlib
import subprocess
import sys

import pytest

CASES = pathlib.Path(__file__).with_name("cudasim_compress_cases.py")


def test_cuda_codecs_under_simulator():
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-W", "ignore:overflow encountered in scalar:RuntimeWarning", str(CASES)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout and "warning" not in proc.stdout, proc.stdout
