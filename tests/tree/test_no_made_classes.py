"""No class in trainer/ is made at run time: no three-argument ``type(name, bases, namespace)`` and no
``types.new_class``. A strategy holds its parts as objects (trainer/sharding/parts.py) instead of
being assembled from mixins by a class factory, so every class a reader meets is written out where
it is defined.

Read from the source with ``ast``, and run on small made-up trees to show that the check fails when
its rule is broken.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.tree.treeutil import write_tree

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("trainer",)


def made_classes(root: Path) -> list[str]:
    """``path:line: what`` of every class made by a call in the CHECKED folders."""
    found = []
    for folder in CHECKED:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == "type" and len(node.args) + len(node.keywords) >= 3:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: a class made with type(name, bases, "
                                 f"namespace): write the class, or hold the part as an object")
                elif name == "new_class":
                    found.append(f"{path.relative_to(root)}:{node.lineno}: a class made with types.new_class")
    return found


def test_no_class_in_trainer_is_made_with_type():
    problems = made_classes(ROOT)
    assert not problems, "\n".join(problems)
    assert len(list((ROOT / "trainer").rglob("*.py"))) > 30  # the check has something to check


@pytest.mark.parametrize("files, expected", [
    ({"trainer/parallel/bases.py": "def make(base, mixins):\n    return type('M' + base.__name__, (*mixins, base), {})\n"},
     "trainer/parallel/bases.py:2: a class made with type(name, bases, namespace)"),
    ({"trainer/a.py": "import types\nX = types.new_class('X', (object,))\n"},
     "trainer/a.py:2: a class made with types.new_class"),
    ({"trainer/nn/b.py": "Y = type('Y', (), dict(a=1))\n"}, "trainer/nn/b.py:1: a class made with type("),
])
def test_the_rule_fails_when_broken(tmp_path, files, expected):
    problems = made_classes(write_tree(tmp_path, files))
    assert any(p.startswith(expected) for p in problems), problems


def test_a_tree_without_made_classes_passes(tmp_path):
    root = write_tree(tmp_path, {
        "trainer/a.py": "class Base:\n    pass\n\n\nclass Made(Base):\n    pass\n\n\nkind = type(Made())\n",
        "trainer/b.py": "import numpy as np\nz = np.zeros(3).astype(np.float32)\n",
        "bench/c.py": "X = type('X', (), {})\n",  # outside trainer/
    })
    assert made_classes(root) == []
