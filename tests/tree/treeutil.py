"""A made-up tree for the tests that show each rule of tests/tree fails when it is broken."""

from __future__ import annotations

from pathlib import Path


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Writes ``files`` (relative path -> text) under ``root``, folders made; returns ``root``."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
