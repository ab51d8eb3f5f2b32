"""What installs what: the runtime and the collectives need none of the trainer's extras
(scikit-learn, SciPy, matplotlib), and each feature that needs one says so in one line, naming the
extra; the Makefile installs the extras its two commands need and CUDA 13's compilers (the ptx
extra) only where asked for or where a driver runs them.

The extras are hidden from a subprocess by a folder first on its path whose packages of those
names fail to import, as they would where they are not installed. Before: scikit-learn (and SciPy
with it) were dependencies of the whole package, and `make` installed the CUDA compilers on every
machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trainer.extras import MissingExtra

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("sklearn", "scipy", "matplotlib")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory) -> dict:
    """An environment in which scikit-learn, SciPy and matplotlib cannot be imported."""
    folder = tmp_path_factory.mktemp("hidden")
    for name in HIDDEN:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(f'raise ImportError("No module named {name!r} (hidden)")\n')
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))


def python(args, env, timeout=50) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_base_dependencies_hold_no_extra_and_the_trainer_extra_holds_the_data_sets():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split(";")[0].strip() for d in project["dependencies"]}
    assert names == {"numpy", "numba", "msgpack", "ml_dtypes", "threadpoolctl", "uvloop"}
    extras = {k: {d.split(">")[0].strip() for d in v} for k, v in project["optional-dependencies"].items()}
    assert extras["trainer"] == {"scikit-learn", "scipy"} and extras["plot"] == {"matplotlib"}
    assert extras["ptx"] == {"nvidia-nvvm", "nvidia-cuda-nvrtc"}


def test_the_runtime_and_the_collectives_import_without_the_extras(without_extras):
    code = ("import importlib, pkgutil, runtime, collectives\n"
            "for pkg in (runtime, collectives):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "import sys\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('sklearn', 'scipy', 'matplotlib')))")
    proc = python(["-c", code], without_extras)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-3000:]


def test_the_trainer_runs_on_synthetic_data_without_them_and_the_digits_say_which_extra(without_extras, tmp_path):
    ok = python(["-m", "trainer", "--data", "synthetic", "--size", "120", "--in-dim", "4", "--classes", "2",
                 "--width", "8", "--depth", "1", "--epochs", "1", "--log-every", "0"], without_extras)
    assert ok.returncode == 0 and "validation accuracy" in ok.stdout, ok.stderr[-3000:]
    digits = python(["-m", "trainer", "--epochs", "1"], without_extras)
    assert digits.returncode == 2 and "Traceback" not in digits.stderr, digits.stderr[-3000:]
    assert digits.stderr.splitlines()[-1] == ("trainer: error: the digits data set needs scikit-learn, which is not "
                                              "installed: pip install -e '.[trainer]' (or pip install "
                                              "'ringweave[trainer]')")
    (tmp_path / "m.csv").write_text("kind,step,loss\nstep,1,2.0\n")
    plot = python(["-m", "trainer.plot", str(tmp_path / "m.csv")], without_extras)
    assert plot.returncode == 1 and plot.stderr == ("trainer.plot: trainer.plot needs matplotlib, which is not "
                                                    "installed: pip install -e '.[plot]' (or pip install "
                                                    "'ringweave[plot]')\n")


def test_the_exact_gelus_reference_kernel_without_scipy_names_the_extra(monkeypatch):
    import numpy as np

    from trainer.nn.layers import GELU

    monkeypatch.setitem(sys.modules, "scipy.special", None)
    with pytest.raises(MissingExtra, match=r"the exact GELU's reference kernel needs SciPy, which is not installed: "
                                           r"pip install -e '\.\[trainer\]'"):
        GELU("none", kernel="reference").forward({}, np.ones(3), None)


def make(*args, path=None) -> str:
    env = dict(os.environ, PATH=path or os.environ["PATH"])
    proc = subprocess.run([shutil.which("make"), "-n", "-B", *args, "VENV=/nonexistent/venv"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_installs_the_cuda_compilers_only_where_asked_for_or_where_a_driver_runs_them(tmp_path):
    bare = str(tmp_path)  # a PATH without nvidia-smi: no GPU
    for name in ("sed", "head", "sh"):
        os.symlink(shutil.which(name), tmp_path / name)
    assert 'pip install -e ".[test,cuda,trainer,plot]"' in make("venv", path=bare)
    assert 'pip install -e ".[test,cuda,trainer,plot,ptx]"' in make("venv", "PTX=1", path=bare)
    assert "RINGWEAVE_REQUIRE_PTX=1 /nonexistent/venv/bin/python -m pytest" in make("test", "PTX=1", path=bare)
    assert 'pip install -e ".[test,cuda,trainer,plot,ptx]"' in make("test", path=bare)  # the tests need them
    assert "RINGWEAVE_REQUIRE_PTX=1 /nonexistent/venv/bin/python -m pytest" in make("test", path=bare)
    assert "RINGWEAVE_REQUIRE_PTX" not in make("test", "PTX=0", path=bare)
    smi = tmp_path / "nvidia-smi"
    for cuda, extras in (("13.0", "test,cuda,trainer,plot,ptx"), ("12.4", "test,cuda,trainer,plot")):
        smi.write_text(f"#!/bin/sh\necho '| NVIDIA-SMI 580.65   Driver Version: 580.65   CUDA Version: {cuda}  |'\n")
        smi.chmod(0o755)
        assert f'pip install -e ".[{extras}]"' in make("venv", path=bare), cuda
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")  # exactly the README's
