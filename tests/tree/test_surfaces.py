"""Every package says what is public: an ``__all__`` whose names all resolve, and ``_INTERNAL``,
the modules that are machinery (a literal tuple of module names in the package's __init__.py),
imported only from inside their own layer (runtime/, collectives/, trainer/). bench/ and the
tests may look inside anything. ``dir(collectives)`` lists the API, loaded on first use or not.

The internal-module rule is read from the source with ``ast`` (tests/tree/test_imports.py's
``imports``), and also run on small made-up trees to show that it fails when broken.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from test_imports import ROOT, imports, modules

PACKAGES = ("runtime", "collectives", "trainer", "tools")
OWN_LAYER_ONLY = ("runtime", "collectives", "trainer")  # bench/ and tools/ may import internals


def packages(root: Path) -> dict[str, Path]:
    """Dotted name -> __init__.py of every package under PACKAGES."""
    return {name: path for name, path in modules(root).items()
            if path.name == "__init__.py" and name.split(".")[0] in PACKAGES}


def internal_of(path: Path) -> tuple[str, ...] | None:
    """The ``_INTERNAL`` tuple of a package's __init__.py (None: it declares none)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_INTERNAL" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return None


def internal_violations(root: Path) -> list[str]:
    """Every ``_INTERNAL`` entry that names no module of its package, and every import of an
    internal module from another layer's library code."""
    known = modules(root)
    edges, _, _ = imports(root)
    problems = []
    for package, init in sorted(packages(root).items()):
        for short in internal_of(init) or ():
            module = f"{package}.{short}"
            if module not in known:
                problems.append(f"{package}._INTERNAL names {short!r}, not a module of {package}")
                continue
            layer = package.split(".")[0]
            for importer, targets in sorted(edges.items()):
                if importer.split(".")[0] in OWN_LAYER_ONLY and importer.split(".")[0] != layer and any(
                        t == module or t.startswith(module + ".") for t in targets):
                    problems.append(f"{importer} imports {module}, internal to {layer}/ ({package}._INTERNAL)")
    return problems


def test_every_package_declares_its_public_names():
    missing, unresolved = [], []
    for name in sorted(packages(ROOT)):
        package = importlib.import_module(name)
        public = getattr(package, "__all__", None)
        if not isinstance(public, list) or not all(isinstance(n, str) for n in public):
            missing.append(name)
            continue
        for attr in public:
            try:
                getattr(package, attr)
            except AttributeError:
                try:
                    importlib.import_module(f"{name}.{attr}")  # a public submodule (trainer's)
                except ImportError:
                    unresolved.append(f"{name}.{attr}")
    assert not missing, f"packages without a list __all__: {missing}"
    assert not unresolved, f"names in __all__ that do not resolve: {unresolved}"


def test_internal_modules_stay_in_their_layer():
    problems = internal_violations(ROOT)
    assert not problems, "\n".join(problems)
    assert "calls" in internal_of(ROOT / "collectives" / "__init__.py")  # the check has something to check


def test_dir_of_collectives_shows_the_api():
    """In a fresh interpreter, before any name is loaded (they load on first use)."""
    out = subprocess.run([sys.executable, "-c", "import collectives; print(' '.join(dir(collectives)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    import collectives
    assert set(collectives.__all__) <= set(out), sorted(set(collectives.__all__) - set(out))
    assert {"all_reduce", "Communicator", "all_gather_v", "broadcast_object", "send"} <= set(out)


@pytest.mark.parametrize("files, expected", [
    ({"collectives/__init__.py": '_INTERNAL = ("core",)\n', "collectives/core.py": "",
      "trainer/a.py": "from collectives import core\n"},
     "trainer.a imports collectives.core, internal to collectives/"),
    ({"collectives/__init__.py": '_INTERNAL = ("gone",)\n'}, "collectives._INTERNAL names 'gone'"),
])
def test_the_internal_rule_fails_when_broken(tmp_path, files, expected):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    problems = internal_violations(tmp_path)
    assert any(expected in p for p in problems), problems
    (tmp_path / "trainer" / "a.py").parent.mkdir(exist_ok=True)
    (tmp_path / "trainer" / "a.py").write_text("import collectives\n")
    (tmp_path / "bench").mkdir(exist_ok=True)
    (tmp_path / "bench" / "b.py").write_text("from collectives import core\n")  # bench may look inside
    (tmp_path / "collectives" / "__init__.py").write_text('_INTERNAL = ("core",)\n')
    (tmp_path / "collectives" / "core.py").write_text("")
    assert internal_violations(tmp_path) == []
