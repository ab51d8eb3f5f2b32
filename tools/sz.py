"""Lines and tokens per line for every Python file, and the change against a base.

    python -m tools.sz                 # every tracked .py file under runtime/ collectives/ trainer/ tools/ bench/
    python -m tools.sz --base HEAD~10  # plus the lines each file gained or lost since that revision
    python -m tools.sz --all           # tests too

Lines count non-blank, non-comment lines (docstrings count: they are the
contract). Tokens come from Python's own tokenizer, without comments,
newlines and indentation; tokens per line is a rough measure of density.
Files past ``--split`` code lines (default 800: a module that long wants splitting in two) are
flagged; the limits the tree keeps (600 source lines a file, 30 lines a module docstring) are
tests/tree/test_layout.py's.

Not a linter: it prints, it never fails.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tokenize

from runtime import args as types

SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENCODING, tokenize.ENDMARKER}
DEFAULT_DIRS = ("runtime", "collectives", "trainer", "tools", "bench")


def measure(source: str) -> tuple[int, int]:
    """(code lines, tokens) of one file's source."""
    lines = sum(1 for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#"))
    try:
        tokens = sum(1 for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in SKIP)
    except (tokenize.TokenError, SyntaxError):
        tokens = 0
    return lines, tokens


def tracked(dirs: tuple[str, ...]) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", *[f"{d}/*.py" for d in dirs]], capture_output=True, text=True,
                         check=True).stdout
    return sorted(p for p in out.splitlines() if p)


def changes(base: str) -> dict[str, int]:
    out = subprocess.run(["git", "diff", "--numstat", base, "--", "*.py"], capture_output=True, text=True).stdout
    delta = {}
    for row in out.splitlines():
        added, removed, path = row.split("\t", 2)
        if added != "-":
            delta[path] = int(added) - int(removed)
    return delta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="a git revision: show the line change of each file since it")
    p.add_argument("--all", action="store_true", help="include tests/")
    p.add_argument("--split", type=types.positive_int, default=800, help="flag files with more code lines than this")
    args = p.parse_args(argv)
    dirs = DEFAULT_DIRS + (("tests",) if args.all else ())
    delta = changes(args.base) if args.base else {}
    rows, total_lines, total_tokens = [], 0, 0
    for path in tracked(dirs):
        with open(path, encoding="utf-8") as f:
            lines, tokens = measure(f.read())
        total_lines += lines
        total_tokens += tokens
        rows.append((path, lines, tokens))
    print(f"{'file':60s} {'lines':>6s} {'tok/line':>8s}" + (f" {'change':>7s}" if args.base else ""))
    for path, lines, tokens in sorted(rows, key=lambda r: -r[1]):
        flag = "  <- past --split" if lines > args.split else ""
        change = f" {delta.get(path, 0):+7d}" if args.base else ""
        print(f"{path:60s} {lines:6d} {tokens / max(lines, 1):8.1f}{change}{flag}")
    print(f"{'total':60s} {total_lines:6d} {total_tokens / max(total_lines, 1):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
