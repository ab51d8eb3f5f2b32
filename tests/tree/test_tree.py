"""The tree itself: every pointer into bench/results resolves, every entry there says how it was
measured, every rule of the selection table that chooses by size points at its measurement, and
the tree speaks of the project alone (no work diary: no issue numbers, sessions or engineers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "out", "node_modules"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".txt", ".sh", ".yml", ".yaml"}


def tree_files() -> list[Path]:
    """The project's text files (not the virtual environment, caches, build or benchmark output)."""
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in ("Makefile", "run")):
            files.append(path)
    return files


def slug(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub makes it."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(), re.M)}


POINTER = re.compile(r"(?:bench/)?results/([\w.-]+\.md)(?:#([\w-]+))?")
LOCAL = re.compile(r"(?<![\w/.#])([a-z_]+\.md)#([\w-]+)|\(#([\w-]+)\)")


def pointers() -> list[tuple[str, Path, str | None]]:
    """(where, file pointed at, anchor) for every pointer into bench/results in the tree."""
    found = []
    for path in tree_files():
        text = path.read_text(errors="replace")
        rel = str(path.relative_to(ROOT))
        for m in POINTER.finditer(text):
            found.append((rel, RESULTS / m.group(1), m.group(2)))
        if path.parent in (RESULTS, ROOT / "docs"):  # links between pages: "transport.md#...", "(#...)"
            for m in LOCAL.finditer(text):
                target = path.parent / m.group(1) if m.group(1) else path
                found.append((rel, target, m.group(2) or m.group(3)))
    return found


def test_every_pointer_into_bench_results_resolves():
    found = pointers()
    assert len(found) > 50, "the code should point at its measurements"
    known: dict[Path, set[str]] = {}
    broken = []
    for where, target, anchor in found:
        if not target.is_file():
            broken.append(f"{where}: {target.relative_to(ROOT)} does not exist")
            continue
        if anchor is not None and anchor not in known.setdefault(target, anchors(target)):
            broken.append(f"{where}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, "\n".join(sorted(set(broken)))


def test_a_broken_pointer_is_caught(tmp_path):
    """The check itself: a missing file and a missing anchor are both reported."""
    page = tmp_path / "x.md"
    page.write_text("# x\n\n## Segments and SO_RCVLOWAT\n")
    assert "segments-and-so_rcvlowat" in anchors(page)
    assert "segments" not in anchors(page)
    assert slug("Under 1 Gbit/s links at 4 ranks") == "under-1-gbits-links-at-4-ranks"
    assert POINTER.search("# bench/results/all_reduce.md#rings-across-hosts").groups() == ("all_reduce.md",
                                                                                        "rings-across-hosts")


def test_every_entry_says_command_machine_and_date():
    missing = []
    pages = sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md")
    assert len(pages) >= 9, "one page per collective or topic"
    for page in pages:
        sections = re.split(r"^## ", page.read_text(), flags=re.M)[1:]
        assert sections, f"{page.name} has no entries"
        for section in sections:
            heading = section.splitlines()[0]
            for field in (r"^- Command:\s*\S", r"^- Machine: \S", r"^- Date: 20\d\d-\d\d-\d\d"):
                if not re.search(field, section, re.M):
                    missing.append(f"{page.name} ## {heading}: no {field}")
    assert not missing, "\n".join(missing)


def test_every_size_rule_of_the_table_points_at_its_measurement():
    from collectives import registry
    bare = [f"{collective}: {rule.algorithm}" for collective, rules in registry.TABLES.items() for rule in rules
            if rule.applies is not registry.always and "bench/results/" not in rule.why]
    assert not bare, bare


# The work diary's words: an issue number, a numbered or ordinal session, an engineer. The other
# "session"s are the project's own: a POSIX session (start_new_session).
DIARY = re.compile(
    r"\bissues? ?#?\d+|\bissue's|\(\w+ issue\)|\bthe issue\b|\bengineers?\b|\bsessions? \d+|\bsessions\b|"
    r"\b(?:this|last|next|previous|earlier|later|that|same|first|second|third|fourth|fifth|sixth|seventh|"
    r"eighth|ninth|tenth|\d+(?:st|nd|rd|th)) session\b", re.I)


def test_the_tree_speaks_of_the_project_alone():
    me = Path(__file__).resolve()
    hits = []
    for path in tree_files():
        if path.resolve() == me:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DIARY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("line, diary", [
    ("in issue 3's command", True), ("(session 8; bench/netem.py)", True), ("the sixth session", True),
    ("added by the shared-memory engineer", True), ("Issue #12", True), ("(compression issue)", True),
    ("the compression issue's codecs", True), ("Goals from the issue", True),
    ("as long as every rank issues them in the same order", False), ("rather than a public issue", False),
    ("async with common.session(comm, members) as dom", False), ("start_new_session=True", False),
    ("its own session (``start_new_session``)", False), ("the per-call session on a domain", False),
])
def test_the_diary_pattern(line, diary):
    assert bool(DIARY.search(line)) is diary
