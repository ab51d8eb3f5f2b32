"""The layout of the library stays as docs/design.md draws it:

* every algorithm lives under collectives/algorithms/, in ``tcp/`` or, when it needs shared memory
  (``registry.NEEDS``), ``shared_memory/``, as ``<collective>_<key>.py`` exporting ``run``, where
  ``key`` is its name in ``registry.ALGORITHMS`` (the ``algorithm=`` word, the bench flag, the test
  id); every file there is one, and no module outside defines an algorithm's ``async def run(comm``;
* no algorithm asks the event loop for a turn itself (that is the Comm's reduce step,
  collectives/comm.py);
* no module docstring of the library (runtime/, collectives/, trainer/, tools/, ringweave_torch/)
  is over 30 lines (the depth lives in docs/design.md), and no file there over 600 lines.

Read from the source with ``ast`` (the registry's table is imported), and run on small made-up
trees to show that each check fails when its rule is broken.
"""

from __future__ import annotations

import ast
import functools
import types
from pathlib import Path

import pytest

from tests.tree.treeutil import write_tree

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS_DIR = Path("collectives", "algorithms")
FOLDERS = ("tcp", "shared_memory")  # shared_memory: the algorithms registry.NEEDS names
SIZED = ("runtime", "collectives", "trainer", "tools", "ringweave_torch")  # the library: held to the two limits below
DOCSTRING_MAX_LINES = 30
FILE_MAX_LINES = 600


def _module_of(fn) -> str:
    while isinstance(fn, functools.partial):  # the hierarchical all_reduce is bound to its `across`
        fn = fn.func
    return f"{fn.__module__}.{fn.__name__}"


def registry_violations(algorithms: dict, needs: dict, root: Path) -> list[str]:
    """Every registered algorithm that is not ``run`` of its own file in its folder, and every file
    under collectives/algorithms/<folder>/ that no registry key names."""
    problems, expected = [], set()
    for collective, table in algorithms.items():
        for key, fn in table.items():
            folder = "shared_memory" if key in needs else "tcp"
            module = f"collectives.algorithms.{folder}.{collective}_{key}"
            expected.add(ALGORITHMS_DIR / folder / f"{collective}_{key}.py")
            if _module_of(fn) != f"{module}.run":
                problems.append(f"{collective}/{key} is {_module_of(fn)}, not {module}.run")
    for folder in FOLDERS:
        for path in sorted((root / ALGORITHMS_DIR / folder).glob("*.py")):
            rel = path.relative_to(root)
            if path.name != "__init__.py" and rel not in expected:
                problems.append(f"{rel} is no registered algorithm (registry.ALGORITHMS, stem <collective>_<key>)")
    return problems


def _library(root: Path, folders=("collectives",)) -> list[Path]:
    return [p for folder in folders for p in sorted((root / folder).rglob("*.py")) if "__pycache__" not in p.parts]


def stray_algorithms(root: Path) -> list[str]:
    """Modules outside collectives/algorithms/ that define an algorithm (``async def run(comm, ...)``)."""
    found = []
    for path in _library(root):
        rel = path.relative_to(root)
        if rel.is_relative_to(ALGORITHMS_DIR):
            continue
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.AsyncFunctionDef) and node.name == "run" and node.args.args
                    and node.args.args[0].arg == "comm"):
                found.append(f"{rel}:{node.lineno}: an algorithm outside collectives/algorithms/")
    return found


def loop_turns_in_algorithms(root: Path) -> list[str]:
    """Algorithms that import runtime.turns or call asyncio.sleep: the loop's turns are the Comm's."""
    found = []
    for path in sorted((root / ALGORITHMS_DIR).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and node.attr == "sleep":
                names = ["asyncio.sleep"]
            if any(n in ("runtime.turns", "asyncio.sleep") for n in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {names[0]} (use collectives.comm.reduce_step "
                             f"or give_turn)")
    return found


def oversized(root: Path) -> list[str]:
    """Module docstrings over DOCSTRING_MAX_LINES source lines and files over FILE_MAX_LINES."""
    found = []
    for path in _library(root, SIZED):
        text = path.read_text()
        rel = path.relative_to(root)
        lines = len(text.splitlines())
        if lines > FILE_MAX_LINES:
            found.append(f"{rel}: {lines} lines (at most {FILE_MAX_LINES}: split it)")
        body = ast.parse(text).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
                body[0].value.value, str):
            doc = body[0].end_lineno - body[0].lineno + 1
            if doc > DOCSTRING_MAX_LINES:
                found.append(f"{rel}: a module docstring of {doc} lines (at most {DOCSTRING_MAX_LINES}: what the "
                             f"module is and is not; the depth goes to docs/design.md)")
    return found


def test_every_algorithm_is_a_file_of_collectives_algorithms():
    from collectives import registry
    problems = registry_violations(registry.ALGORITHMS, registry.NEEDS, ROOT) + stray_algorithms(ROOT)
    assert not problems, "\n".join(problems)
    assert sum(len(t) for t in registry.ALGORITHMS.values()) >= 29  # the check has something to check


def test_no_algorithm_asks_the_loop_for_a_turn():
    problems = loop_turns_in_algorithms(ROOT)
    assert not problems, "\n".join(problems)


def test_library_files_and_docstrings_are_small():
    problems = oversized(ROOT)
    assert not problems, "\n".join(problems)


# -- each check fails when its rule is broken -------------------------------------------------------

def _run_of(module: str):
    return types.FunctionType((lambda: None).__code__, {"__name__": module}, "run")


def test_the_registry_rule_fails_when_broken(tmp_path):
    root = write_tree(tmp_path, {"collectives/algorithms/tcp/all_reduce_ring.py": "",
                            "collectives/algorithms/tcp/helpers.py": "",
                            "collectives/algorithms/shared_memory/all_reduce_shm.py": ""})
    ring = _run_of("collectives.algorithms.tcp.all_reduce_ring")
    shm = _run_of("collectives.algorithms.shared_memory.all_reduce_shm")
    assert registry_violations({"all_reduce": {"ring": ring, "shm": shm}}, {"shm": None}, root) == [
        "collectives/algorithms/tcp/helpers.py is no registered algorithm (registry.ALGORITHMS, stem "
        "<collective>_<key>)"]
    elsewhere = _run_of("collectives.ring_all_reduce")
    problems = registry_violations({"all_reduce": {"ring": functools.partial(elsewhere, across=None),
                                                   "shm": ring}}, {"shm": None}, root)
    assert "all_reduce/ring is collectives.ring_all_reduce.run, not collectives.algorithms.tcp.all_reduce_ring.run" \
        in problems
    assert any(p.startswith("all_reduce/shm is collectives.algorithms.tcp.all_reduce_ring.run") for p in problems)


@pytest.mark.parametrize("files, check, expected", [
    ({"collectives/compressed.py": "async def run(comm, x, op):\n    pass\n"}, stray_algorithms,
     "collectives/compressed.py:1: an algorithm outside collectives/algorithms/"),
    ({"collectives/algorithms/tcp/a_b.py": "from runtime import turns\n"}, loop_turns_in_algorithms,
     "collectives/algorithms/tcp/a_b.py:1: runtime.turns"),
    ({"collectives/algorithms/tcp/a_b.py": "import asyncio\nasync def run(comm):\n    await asyncio.sleep(0)\n"},
     loop_turns_in_algorithms, "collectives/algorithms/tcp/a_b.py:3: asyncio.sleep"),
    ({"collectives/a.py": '"""' + "\n" * 30 + '"""\n'}, oversized, "collectives/a.py: a module docstring of 31 lines"),
    ({"collectives/a.py": "x = 1\n" * 601}, oversized, "collectives/a.py: 601 lines"),
    ({"runtime/a.py": '"""' + "\n" * 30 + '"""\n'}, oversized, "runtime/a.py: a module docstring of 31 lines"),
    ({"trainer/nn/a.py": "x = 1\n" * 601}, oversized, "trainer/nn/a.py: 601 lines"),
    ({"tools/a.py": "x = 1\n" * 601}, oversized, "tools/a.py: 601 lines"),
])
def test_each_layout_rule_fails_when_broken(tmp_path, files, check, expected):
    problems = check(write_tree(tmp_path, files))
    assert any(p.startswith(expected) for p in problems), problems


def test_a_tree_that_keeps_the_layout_passes(tmp_path):
    root = write_tree(tmp_path, {
        "collectives/algorithms/tcp/a_b.py": '"""' + "\n" * 29 + '"""\nasync def run(comm):\n    pass\n',
        "collectives/calls.py": "async def run(call, fn):\n    pass\n" + "x = 1\n" * 590,  # not an algorithm's run
        "bench/big.py": "x = 1\n" * 700,  # outside the library
    })
    assert stray_algorithms(root) == loop_turns_in_algorithms(root) == oversized(root) == []
