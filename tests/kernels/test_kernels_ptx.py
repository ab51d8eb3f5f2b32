"""Every CUDA kernel, for every dtype it is launched with, compiles for a real device (PTX for an
H100), on this machine without a GPU; and the kernels whose bits must equal NumPy's hold no
contractible multiply (ptx_build.py says how and why).

The simulator runs kernels as Python and never type-checks them: before this test, no float16 or
bfloat16 kernel compiled for a device (``math.floor`` is a float under numba.cuda). Needs numba-cuda
with libNVVM and NVRTC (``pip install -e .[cuda,ptx]``, ``make test PTX=1``, as CI runs it). Without
them the tests skip, saying why; with RINGWEAVE_REQUIRE_PTX=1 (``make test PTX=1`` sets it) they fail.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from runtime import env

BUILD = pathlib.Path(__file__).with_name("ptx_build.py")


def verdict(built: dict, environ) -> tuple[str, str]:
    """("run", "") when the kernels were compiled; without the compilers ("skip", why), or ("fail",
    why) where they were asked for (RINGWEAVE_REQUIRE_PTX=1)."""
    if "missing" not in built:
        return "run", ""
    why = (f"no libNVVM / NVRTC to compile PTX with ({built['missing']}); install them with "
           f"pip install -e '.[ptx]' or make test PTX=1")
    return ("fail" if env.REQUIRE_PTX.get(environ) else "skip"), why


@pytest.fixture(scope="module")
def built():
    if importlib.util.find_spec("numba.cuda") is None:
        action, why = verdict({"missing": "no numba.cuda: pip install -e '.[cuda]'"}, os.environ)
    else:
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        proc = subprocess.run([sys.executable, str(BUILD)], env=env, capture_output=True, text=True, timeout=170)
        assert proc.returncode == 0, "PTX build failed to run\n" + proc.stderr[-3000:]
        result = json.loads(proc.stdout)
        action, why = verdict(result, os.environ)
    if action == "skip":
        pytest.skip(why)
    if action == "fail":
        pytest.fail(why + " (RINGWEAVE_REQUIRE_PTX=1: they were asked for)")
    return result


@pytest.mark.parametrize("environ, action", [({}, "skip"), ({"RINGWEAVE_REQUIRE_PTX": "1"}, "fail"),
                                             ({"RINGWEAVE_REQUIRE_PTX": "0"}, "skip")])
def test_without_the_compilers_the_tests_skip_saying_why_unless_they_were_asked_for(environ, action):
    got, why = verdict({"missing": "NvvmSupportError: libNVVM cannot be found"}, environ)
    assert got == action and "libNVVM cannot be found" in why and "pip install -e '.[ptx]'" in why
    assert verdict({"results": {}, "unlisted": []}, environ) == ("run", "")


@pytest.mark.timeout(180)
def test_every_kernel_compiles_for_the_device(built):
    failed = {name: r["error"] for name, r in built["results"].items() if r["error"]}
    assert not failed, "\n\n".join(f"{n}: {e}" for n, e in failed.items())
    assert not built["unlisted"], f"kernels missing from ptx_cases(): {built['unlisted']}"
    names = set(built["results"])
    for dtype in ("float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8"):
        assert f"collectives.kernels.cuda:reduce_sum_{dtype}" in names
        assert f"collectives.kernels.cuda:fold_max_{dtype}" in names


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kernel", ["int8_encode", "int8_residual", "int8_decode"])
def test_int8_products_that_feed_an_addition_are_rounded_on_their_own(built, kernel):
    """ptxas may fuse a plain mul.f32 with the add / sub after it into one FMA (one rounding, where
    NumPy rounds twice): these kernels multiply with mul.rn (never fused) before any addition."""
    ops = built["results"][f"collectives.compress.cuda:{kernel}"]["ops"]
    assert "mul.rn.f32" in ops and not any(op.startswith("fma") for op in ops), ops
    if kernel != "int8_decode":  # int8_decode's one plain mul.f32 is stored as is (decode, not decode_add)
        assert "mul.f32" not in ops, ops


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kernel", ["topk_select", "topk_scan_tiles"])
def test_kernels_launched_as_one_large_block_declare_their_launch_bounds(built, kernel):
    """A block of 1024 threads has at most 64 registers each (65536 per block on an H100): without
    launch bounds ptxas gave topk_scan_tiles more, and every launch on an H200 failed with
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES. `.maxntid` makes ptxas budget registers for the block."""
    assert built["results"][f"collectives.compress.cuda:{kernel}"]["maxntid"] == 1024  # SELECT_THREADS on a device
