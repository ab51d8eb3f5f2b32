"""Compiles every CUDA kernel of the project to PTX for a real device, on a machine with no GPU.

Run by test_kernels_ptx.py in a fresh interpreter (numba.cuda must not be simulating); prints one
JSON object: kernel name -> {"error": message or null, "ops": the float instructions of its PTX,
"maxntid": the threads per block its launch bounds declare, or null}; or {"missing": why} when
not even a one-line kernel compiles (no libNVVM / NVRTC here).

What it catches that the simulator cannot: the simulator runs kernels as Python, so code that does
not type under numba.cuda (``math.floor`` returns a float there, ``or_(int64, float64)`` has no
implementation) passes there and fails on the first real launch. Compiling to PTX runs numba.cuda's
type inference and NVVM, the whole compiler but the driver's last step.

Without a device, numba.cuda cannot say which compute capability a device function called from a
kernel is for (``get_current_device``): it is answered here with the target's, ``--cc`` (default
9.0, an H100). Needs libNVVM and NVRTC: the ``ptx`` extra (CUDA 13's from PyPI) or a CUDA toolkit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from numba import cuda
from numba.cuda import dispatcher

MAXNTID = re.compile(r"\.maxntid\s+(\d+)")  # the kernel's launch bounds, as ptxas budgets registers for them
FLOAT_OPS = re.compile(r"\b((?:fma|mul|add|sub|div)(?:\.r[nzmp])?(?:\.ftz)?\.f(?:32|64))\b")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 (H100) or 8.0 (A100)")
    cc = tuple(int(p) for p in parser.parse_args().cc.split("."))

    class Target:
        compute_capability = cc

    dispatcher.get_current_device = lambda: Target()

    missing = missing_compilers(cc)
    if missing:
        print(json.dumps({"missing": missing}))
        return
    from collectives.compress import cuda as ccuda
    from collectives.kernels import cuda as kcuda

    results, listed = {}, set()
    for module in (kcuda, ccuda):
        for name, kernel, sig in module.ptx_cases():
            listed.add(id(kernel))
            try:
                bounds = kernel.targetoptions.get("launch_bounds")
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc, launch_bounds=bounds)
                maxntid = MAXNTID.search(ptx)
                results[f"{module.__name__}:{name}"] = {"error": None, "ops": sorted(set(FLOAT_OPS.findall(ptx))),
                                                        "maxntid": int(maxntid.group(1)) if maxntid else None}
            except Exception as e:  # reported per kernel by the test
                results[f"{module.__name__}:{name}"] = {"error": f"{type(e).__name__}: {e}"[:3000], "ops": [],
                                                        "maxntid": None}
    kernels = [(m.__name__, n, k) for m in (kcuda, ccuda) for n, k in vars(m).items() if _is_kernel(k)]
    kernels += [(kcuda.__name__, f"{op}.{n}", k) for op, ks in kcuda._KERNELS.items() for n, k in ks.items()]
    unlisted = sorted(f"{m}:{n}" for m, n, k in kernels if id(k) not in listed)
    print(json.dumps({"results": results, "unlisted": unlisted}))


def missing_compilers(cc) -> str | None:
    """Why no kernel can be compiled here (no libNVVM or NVRTC that numba.cuda can load), or None."""
    def probe(out):  # pragma: no cover - compiled, never run
        out[0] = 1

    try:
        cuda.compile_ptx(probe, "void(int32[:])", cc=cc)
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:500]
    return None


def _is_kernel(obj) -> bool:
    return isinstance(obj, dispatcher.CUDADispatcher) and not obj.targetoptions.get("device", False)


if __name__ == "__main__":
    main()
