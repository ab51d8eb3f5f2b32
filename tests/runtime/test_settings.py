"""The settings table (runtime/env.py): every RINGWEAVE_* variable the tree mentions is declared
there and read only through it, a bad value is a SettingError naming the variable wherever it is
read (never at import), the README's table is the generated one, and ``python -m runtime.env``
prints the effective values."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import env, net
from runtime.errors import SettingError

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("runtime", "collectives", "trainer", "tools", "bench")
NAME = re.compile(r"RINGWEAVE_[A-Z0-9_]*[A-Z0-9]")
NOT_SETTINGS = {"RINGWEAVE_TEST_ENV_GET", "RINGWEAVE_NOT_A_SETTING",  # test names no setting uses
                "RINGWEAVE_NAME"}  # runtime/env.py's example of a declaration


def py_files(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts]


def declared(name: str) -> bool:
    return name in env.SETTINGS or any(isinstance(s, env.SettingFamily) and (name + "_").startswith(s.prefix)
                                       for s in env.SETTINGS.values())


def test_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert env.readme_block() in readme, "README.md's settings table is stale: run python -m runtime.env --readme"


def test_every_setting_the_tree_mentions_is_declared():
    texts = [p.read_text() for p in py_files(*CODE_DIRS, "tests")]
    texts += [(ROOT / f).read_text() for f in ("README.md", "SECURITY.md", "bench/README.md")]
    names = {m.group(0) for text in texts for m in NAME.finditer(text)} - NOT_SETTINGS
    undeclared = sorted(n for n in names if not declared(n))
    assert not undeclared, f"declare these in runtime/env.py: {undeclared}"


RAW_READ = re.compile(
    r"""(?:os\.environ\.(?:get|pop|setdefault)|os\.getenv|\benv\.get|environ\.get)\(\s*["']RINGWEAVE_"""
    r"""|os\.environ\[\s*["']RINGWEAVE_\w+["']\s*\](?!\s*=[^=])"""
    r"""|^\s*\w+\s*=\s*["']RINGWEAVE_\w+["']""", re.M)


def test_settings_are_read_only_through_runtime_env():
    """No raw os.environ read of a RINGWEAVE_* variable, and no second name for one, outside
    runtime/env.py (a test script that checks what the launcher sets says so on the line)."""
    me = Path(__file__).resolve()
    found = []
    for path in py_files(*CODE_DIRS, "tests"):
        if path == ROOT / "runtime" / "env.py" or path.resolve() == me:
            continue
        for line in path.read_text().splitlines():
            if RAW_READ.search(line) and "the launcher's contract" not in line and not NOT_SETTINGS & set(NAME.findall(line)):
                found.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", [n for n, s in env.SETTINGS.items() if isinstance(s, env.Setting)])
def test_a_bad_value_is_a_setting_error_naming_the_variable(monkeypatch, name):
    setting = env.SETTINGS[name]
    if setting.parse is env.text:  # free text: nothing to refuse
        return
    monkeypatch.setenv(name, "soon")  # no parser but text takes it: not a number, count, size, switch or name
    with pytest.raises(SettingError, match=re.escape(f"{name}='soon'")):
        setting.get()
    monkeypatch.setenv(name, " ")  # blank: the default
    assert setting.get() == setting.get({})


def test_values_follow_the_environment_between_reads(monkeypatch):
    monkeypatch.delenv("RINGWEAVE_SHM_STREAM_MIN", raising=False)
    assert env.SHM_STREAM_MIN.get() == 4 << 20
    monkeypatch.setenv("RINGWEAVE_SHM_STREAM_MIN", "1M")
    assert env.SHM_STREAM_MIN.get() == 1 << 20
    monkeypatch.setenv("RINGWEAVE_SHM_STREAM_MIN", "65536")
    assert env.SHM_STREAM_MIN.get() == 65536
    assert env.SHM_STREAM_MIN.get({"RINGWEAVE_SHM_STREAM_MIN": "2K"}) == 2048  # another mapping
    monkeypatch.setenv("RINGWEAVE_SHM", "off")
    assert env.SHM.get() is False
    monkeypatch.setenv("RINGWEAVE_ALGO_ALL_GATHER", "ring")
    assert env.ALGO.get("all_gather") == "ring" and env.ALGO.get("broadcast") is None
    launched = {"RINGWEAVE_LAUNCHER_PID": "42"}
    assert env.LAUNCHER_PID.pop(launched) == 42 and launched == {}


def test_a_bad_socket_buffer_names_the_variable(monkeypatch):
    """It was int() of the raw text per socket: a bare ValueError that named nothing."""
    monkeypatch.setenv("RINGWEAVE_SOCKET_BUFFER", "lots")
    with socket.socket() as sock, pytest.raises(ValueError, match="RINGWEAVE_SOCKET_BUFFER='lots'"):
        net.tune(sock)


def run_python(*args: str, **extra: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RINGWEAVE_")}
    environ.update(extra, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=120)


def test_a_bad_value_never_breaks_an_import_and_python_m_runtime_env_shows_it():
    """Both shared-memory tuning variables were read at import (int() of the raw text): a bad
    value made `import collectives` fail with a bare ValueError."""
    bad = {"RINGWEAVE_SHM_STREAM_MIN": "lots", "RINGWEAVE_SHM_SPIN": "x", "RINGWEAVE_ALGO_BROADCAST": "tree",
           "RINGWEAVE_NOT_A_SETTING": "1"}
    imported = run_python("-c", "import collectives.api, collectives.registry, trainer", **bad)
    assert imported.returncode == 0, imported.stderr
    shown = run_python("-m", "runtime.env", **bad)
    assert shown.returncode == 1 and not shown.stderr, shown.stderr
    rows = {line.split()[0]: line for line in shown.stdout.splitlines()}
    assert set(rows) >= {n for n, s in env.SETTINGS.items() if isinstance(s, env.Setting)}
    assert "RINGWEAVE_SHM_STREAM_MIN='lots' is not a byte count" in rows["RINGWEAVE_SHM_STREAM_MIN"]
    assert "'tree'" in rows["RINGWEAVE_ALGO_BROADCAST"] and "environment" in rows["RINGWEAVE_ALGO_BROADCAST"]
    assert "not a setting" in rows["RINGWEAVE_NOT_A_SETTING"]
    assert "300.0" in rows["RINGWEAVE_TIMEOUT_S"] and "default" in rows["RINGWEAVE_TIMEOUT_S"]


def test_the_readme_is_regenerated_by_one_command(tmp_path):
    page = tmp_path / "README.md"
    page.write_text(f"# x\n\n{env.README_BEGIN}\n| stale |\n{env.README_END}\n\nafter\n")
    done = run_python("-m", "runtime.env", "--readme", str(page))
    assert done.returncode == 0, done.stderr
    assert page.read_text() == f"# x\n\n{env.readme_block()}\n\nafter\n"
    assert env.update_readme(str(page)) is False  # already up to date
