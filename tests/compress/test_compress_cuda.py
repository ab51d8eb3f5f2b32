"""Runs the CUDA codec cases (gpu_codec_cases.py) under the CUDA simulator, in a fresh interpreter
shared with the session's other case modules (tests/cudasim.py says why); on a GPU the same cases
run with ``pytest -m gpu``."""

import pathlib

import pytest

from tests import cudasim

CASES = pathlib.Path(__file__).with_name("gpu_codec_cases.py")


@pytest.mark.cudasim(CASES)
@pytest.mark.timeout(300)  # the first of the session's simulator tests runs every case module
def test_cuda_codecs_under_simulator():
    pytest.importorskip("numba.cuda")
    cudasim.run_under_simulator(CASES)
