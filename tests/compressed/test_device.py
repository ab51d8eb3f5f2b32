"""Device-array collectives (collectives/device.py) under the CUDA simulator, in a subprocess:
NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported."""

import os
import pathlib
import subprocess
import sys

import pytest

CASES = pathlib.Path(__file__).with_name("cudasim_device_cases.py")


@pytest.mark.timeout(120)
def test_device_collectives_under_simulator():
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
