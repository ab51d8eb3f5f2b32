"""Where the GPU cases run: on a real GPU in the pytest process, or under the CUDA simulator in a
fresh interpreter.

The case modules (``tests/*/gpu_*_cases.py``, every test marked ``gpu``) hold one set of tests for
both. numba.cuda decides at its first import whether it simulates (``NUMBA_ENABLE_CUDASIM``), which a
whole-suite pytest process cannot promise for the tests that want the simulator, so CI runs the case
modules through :func:`run_under_simulator` (tests/*/test_*_cuda.py, each marked ``cudasim(CASES)``),
all of this pytest run's in one fresh interpreter, and tests/conftest.py collects the modules directly,
in-process, where :func:`gpu_usable` (a real GPU, or the simulator switched on for the whole process).
README.md "GPU tests" says how to run them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The simulator's block manager polls its threads in a loop that holds the GIL until the interpreter
# takes it away (every 5 ms by default), while the simulated threads wait for it at each barrier: a
# short switch interval hands it over sooner (tests/conftest.py sets it where the simulator is on).
SWITCH_INTERVAL_S = 1e-4

_wanted: set[pathlib.Path] = set()  # the case modules this pytest run's tests ask for (tests/conftest.py)
_runs: dict[frozenset, dict] = {}  # modules run together -> their outcome


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


def want(cases: pathlib.Path) -> None:
    """Names a case module that a test of this pytest run will run under the simulator."""
    _wanted.add(pathlib.Path(cases).resolve())


def run_under_simulator(cases: pathlib.Path, timeout_s: float = 280) -> str:
    """Asserts that every case of the module ``cases`` passed under the simulator (none failed,
    skipped or deselected, no warning) and returns pytest's output.

    The first call runs every module named through :func:`want` (and ``cases``) in one fresh
    interpreter, one import of numba's simulator and of the project for all of them; later calls
    read their module's outcome from that run (pytest's JUnit XML: one testcase per case). The
    simulator runs device code on NumPy scalars, which warn on the uint64 wrap-around that the
    stochastic-rounding hash relies on (hardware wraps silently): that one warning is ignored, and
    every other one is an error of the case that raised it.
    """
    cases = pathlib.Path(cases).resolve()
    run = next((r for modules, r in _runs.items() if cases in modules), None)
    if run is None:
        modules = frozenset(m for m in _wanted | {cases} if not any(m in ran for ran in _runs))
        run = _runs[modules] = _run(sorted(modules), timeout_s)
    assert "error" not in run, run.get("error")
    out = run["out"]
    assert run["rc"] in (0, 1), out[-6000:] + run["stderr"][-2000:]  # 1: some case failed, said below
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert " passed" in summary and "deselected" not in summary and "warning" not in summary, out[-3000:]
    mine = run["modules"].get(_dotted(cases), [])
    assert mine, f"no case of {cases.name} ran\n" + out[-6000:] + run["stderr"][-2000:]
    bad = [(name, outcome, text) for name, outcome, text in mine if outcome != "passed"]
    assert not bad, "\n\n".join(f"{name}: {outcome}\n{text[-3000:]}" for name, outcome, text in bad[:5])
    return out


def _dotted(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _run(modules: list[pathlib.Path], timeout_s: float) -> dict:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    with tempfile.TemporaryDirectory(prefix="cudasim-") as tmp:
        xml = pathlib.Path(tmp, "cases.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
               "-m", "gpu", "-W", "error", "-W", "ignore:overflow encountered in scalar:RuntimeWarning",
               f"--junitxml={xml}", *map(str, modules)]  # fmt: skip
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            told = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            return {"error": f"the simulator run of {[m.name for m in modules]} took over {timeout_s} s\n"
                             f"{told[-4000:]}"}
        by_module: dict[str, list] = {}
        if xml.exists():
            for case in ET.parse(xml).iter("testcase"):
                module = case.get("classname") or case.get("name", "")  # a collection error: no class
                problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
                outcome = "passed" if problem is None else problem.tag
                text = "" if problem is None else f"{problem.get('message', '')}\n{problem.text or ''}"
                by_module.setdefault(module, []).append((case.get("name", ""), outcome, text))
    return {"rc": proc.returncode, "out": proc.stdout, "stderr": proc.stderr, "modules": by_module}
