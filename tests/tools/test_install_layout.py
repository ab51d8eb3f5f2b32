"""What an installed ringweave does outside its source tree: ``python -m tools.status`` from any
folder (tools is shipped), Numba's kernel cache in the user's cache folder (not the package's),
and the README's pytest recipe working in a fresh project."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def test_tools_is_one_of_the_installed_packages():
    """What ``pip install`` ships is what [tool.setuptools.packages.find] finds."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(where=str(ROOT), include=find["include"])
    assert "tools" in packages, packages
    assert {"runtime", "collectives", "trainer"} <= set(packages)


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_CACHE_DIR")}
    env.update(extra)
    return env


def test_the_kernel_cache_goes_to_the_users_cache_folder(tmp_path):
    code = ("from collectives.kernels import cpu; from collectives.compress import cpu as codecs; "
            "print(cpu.reduce_native._cache._cache_path); print(codecs.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=_clean_env(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    cache_path, source = proc.stdout.split()
    assert cache_path.startswith(str(tmp_path / "cache" / "ringweave" / "numba")), cache_path
    assert not cache_path.startswith(str(Path(source).parents[1])), cache_path  # not in the package
    # NUMBA_CACHE_DIR is the user's choice and wins
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=_clean_env(NUMBA_CACHE_DIR=str(tmp_path / "mine"), PYTHONPATH=str(ROOT)))
    assert proc.stdout.split()[0].startswith(str(tmp_path / "mine")), proc.stdout + proc.stderr


def recipe_files(readme: str) -> dict[str, str]:
    """The files of the README's pytest recipe: fenced blocks whose first line is ``# <file name>``."""
    section = readme.split("### Testing your own distributed code", 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```(?:python|ini)\n(.*?)```", section, re.S):
        first, _, rest = block.partition("\n")
        m = re.fullmatch(r"# ([\w.]+)", first.strip())
        if m:
            files[m.group(1)] = rest
    return files


def test_the_readme_pytest_recipe_works_in_a_fresh_project(tmp_path):
    files = recipe_files((ROOT / "README.md").read_text())
    assert set(files) == {"pytest.ini", "conftest.py", "test_sum.py"}, sorted(files)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=100,
                          env=_clean_env(PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout
