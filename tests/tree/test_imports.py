"""Imports point down and never go round: trainer -> collectives -> runtime; bench/ and tools/ may
import anything and nothing of the library imports them; runtime never imports array code; no
cycle among the project's modules, counting the imports inside functions too; and an import
inside a function of runtime/ or collectives/ says why it is there (``# lazy: <reason>``: an
optional or heavy dependency, never a cycle dodged).

Read from the source with ``ast``, nothing imported. The last tests run the same checks on small
made-up trees, to show that each check fails when its rule is broken.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.tree.treeutil import write_tree

ROOT = Path(__file__).resolve().parents[2]
# A module may import its own layer and the layers before it, never one after.
LAYERS = ("runtime", "collectives", "trainer", "tools", "bench")
LIBRARY = ("runtime", "collectives", "trainer")  # bench/ and tools/: nothing of these imports them
# What runtime/ never imports: it knows bytes, never arrays (docs/design.md, "Layers").
ARRAY_PACKAGES = {"numpy", "numba", "ml_dtypes", "cupy", "torch", "scipy", "sklearn"}
LAZY_CHECKED = ("runtime", "collectives")  # every import inside a function there gives its reason


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under the layers' folders of ``root``."""
    found = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if "out" in parts or "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict) -> str | None:
    """The project module that importing ``name`` runs last (a name inside a module: the module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(root: Path) -> tuple[dict[str, dict[str, tuple[int, bool]]], dict[str, set[str]], list[str]]:
    """Returns (module -> {project module it imports: (line, inside a function)}, module -> the
    other top-level packages it imports, the imports inside functions of LAZY_CHECKED that give no
    reason)."""
    known = modules(root)
    edges: dict[str, dict[str, tuple[int, bool]]] = {}
    outside: dict[str, set[str]] = {}
    unexplained = []
    for name, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = edges.setdefault(name, {})
        others = outside.setdefault(name, set())
        for node, in_function in _walk(tree, False):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                module = _resolve(target, known)
                if module is None:
                    others.add(target.split(".")[0])
                elif module != name:
                    out.setdefault(module, (node.lineno, in_function))
            if (in_function and name.split(".")[0] in LAZY_CHECKED
                    and "# lazy:" not in lines[node.lineno - 1]):
                unexplained.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    if "collectives" in known:  # its public names, imported on first use (collectives/__init__.py _FROM)
        tree = ast.parse(known["collectives"].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_FROM" for t in node.targets):
                for value in ast.walk(node.value):
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        module = f"collectives.{value.value}"
                        if module in known:
                            edges["collectives"].setdefault(module, (node.lineno, True))
    return edges, outside, unexplained


def _walk(node, in_function: bool):
    """(node, whether it sits inside a function) for every node below ``node``."""
    for child in ast.iter_child_nodes(node):
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, in_function
        yield from _walk(child, inside)


def cycles(edges: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # recursion depth: the longest import chain, a few dozen
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def violations(root: Path) -> list[str]:
    """Every broken rule of the module docstring, one line each (empty: all kept)."""
    edges, outside, unexplained = imports(root)
    problems = []
    for component in cycles(edges):
        ring = set(component)
        links = [f"{a} -> {b} (line {line}{', in a function' if inner else ''})"
                 for a in component for b, (line, inner) in sorted(edges[a].items()) if b in ring]
        problems.append(f"import cycle among {component}: " + "; ".join(links))
    for a, targets in sorted(edges.items()):
        for b, (line, inner) in sorted(targets.items()):
            layer_a, layer_b = a.split(".")[0], b.split(".")[0]
            if LAYERS.index(layer_b) > LAYERS.index(layer_a):
                problems.append(f"upward import: {a} (line {line}) imports {b}: {layer_a} comes before {layer_b}")
    for a, packages in sorted(outside.items()):
        if a.split(".")[0] == "runtime" and packages & ARRAY_PACKAGES:
            problems.append(f"{a} imports {sorted(packages & ARRAY_PACKAGES)}: runtime/ knows bytes, not arrays")
    problems += [f"an import inside a function without '# lazy: <reason>': {line}" for line in unexplained]
    return problems


def test_imports_point_down_and_never_go_round():
    problems = violations(ROOT)
    assert not problems, "\n".join(problems)


def test_the_checks_see_the_whole_tree():
    edges, _, _ = imports(ROOT)
    assert {"runtime.group", "collectives.api", "collectives.algorithms.shared_memory.all_reduce_shm",
            "trainer.loop", "tools.status", "bench.collectives"} <= set(edges)
    assert "collectives.registry" in edges["collectives.calls"]  # a top-level import
    assert edges["collectives.api"]["collectives.device"][1]  # an import inside a function, counted


# -- each check fails when its rule is broken -------------------------------------------------------

@pytest.mark.parametrize("files, expected", [
    ({"collectives/a.py": "from collectives import b\n",
      "collectives/b.py": "def f():\n    from collectives import a  # lazy: dodging the cycle\n"},
     "import cycle among ['collectives.a', 'collectives.b']"),
    ({"collectives/slots/__init__.py": "", "collectives/slots/x.py": "from ..registry import TABLE\n",
      "collectives/registry.py": "from collectives.slots import x\n"},
     "import cycle among ['collectives.registry', 'collectives.slots.x']"),
    ({"runtime/a.py": "def f():\n    from collectives import b  # lazy: upward\n", "collectives/b.py": ""},
     "upward import: runtime.a (line 2) imports collectives.b"),
    ({"collectives/a.py": "import trainer.loop\n", "trainer/loop.py": ""}, "upward import: collectives.a"),
    ({"trainer/a.py": "from tools import status\n", "tools/status.py": ""}, "upward import: trainer.a"),
    ({"runtime/a.py": "import numpy as np\n"}, "runtime.a imports ['numpy']"),
    ({"collectives/a.py": "def f():\n    from collectives import b\n", "collectives/b.py": ""},
     "an import inside a function without '# lazy: <reason>': collectives/a.py:2"),
])
def test_each_rule_fails_when_broken(tmp_path, files, expected):
    problems = violations(write_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems


def test_a_tree_that_keeps_the_rules_passes(tmp_path):
    root = write_tree(tmp_path, {
        "runtime/a.py": "import asyncio\n",
        "collectives/b.py": "import numpy as np\nfrom runtime import a\n",
        "collectives/c.py": "def f():\n    from collectives import b  # lazy: numba.cuda behind it\n",
        "trainer/d.py": "from collectives import b, c\n",
        "bench/e.py": "from trainer import d\nfrom tools import f\n", "tools/f.py": "import trainer.d\n",
    })
    assert violations(root) == []
