"""The collective traces are written where the user says, and only there: another local user
cannot make a rank or ``tools.trace`` write through a link they planted (runtime/owndir.py,
runtime/trace.py, tools/trace.py; SECURITY.md, "The trace directory").

The attacker is uid nobody (tests/security/stranger.py). It makes a directory in a shared
temporary directory (mode 1777, like /tmp), opens it to everyone, and plants symbolic links under
the names the job would write, pointing at a file of the job's owner. Before, the owner's file
was overwritten with trace JSON (the ranks wrote ``trace-rank<R>.json.tmp<pid>`` with a plain
``open``; ``tools.trace -o`` too). Now such a directory is refused with a one-line error, and
the owner's file is untouched.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

import runtime
from runtime.errors import RingweaveError
from runtime.trace import Tracer
from tests.security.stranger import as_stranger, needs_root
from tools import trace as trace_tool

pytestmark = pytest.mark.timeout(60)
PRECIOUS = "the job owner's file\n"


@pytest.fixture
def precious(tmp_path) -> Path:
    """A file of the job's owner, in a directory of its own that nobody else may enter."""
    path = tmp_path / "precious.txt"
    path.write_text(PRECIOUS)
    return path


def _plant(d: str, names: list[str], target: str) -> list[str]:
    """As the stranger: a directory open to all, with links to ``target`` under ``names``."""
    os.mkdir(d)
    os.chmod(d, 0o777)
    for name in names:
        os.symlink(target, os.path.join(d, name))
    return sorted(os.listdir(d))


def _rank_names(rank: int) -> list[str]:
    """The names main's Tracer.write would open, for a writer of this process: the file and its
    temporary name."""
    name = f"trace-rank{rank}.json"
    return [name, f"{name}.tmp{os.getpid()}"]


def _one_event_tracer(rank: int, out_dir: str | None) -> Tracer:
    t = Tracer(rank, out_dir)
    t.complete("all_reduce", 1.0, 3.0, 0, {"outcome": "ok", "bytes_sent": 8})
    return t


@needs_root
def test_a_rank_refuses_a_trace_directory_a_stranger_made(shared_dir, precious):
    d = str(shared_dir / "traces")
    as_stranger(_plant, d, _rank_names(0), str(precious))
    refused = None
    try:
        _one_event_tracer(0, d).write()
    except RingweaveError as exc:
        refused = exc
    assert precious.read_text() == PRECIOUS  # before: the trace's JSON
    assert type(refused).__name__ == "PrivateDirError", refused
    assert re.search(r"trace directory \(RINGWEAVE_TRACE\) .* belongs to uid \d+, not to this user.*use a directory "
                     r"of your own", str(refused)), refused


@needs_root
async def test_init_refuses_it_before_joining_and_writes_nothing(shared_dir, precious, monkeypatch):
    """RINGWEAVE_TRACE naming the stranger's directory: ``runtime.init`` raises at once, one line
    naming the variable, and no runtime is made that would write there at shutdown. (Before:
    the job ran, and its shutdown overwrote the owner's file.)"""
    d = str(shared_dir / "traces")
    as_stranger(_plant, d, _rank_names(0), str(precious))
    monkeypatch.setenv("RINGWEAVE_TRACE", d)
    refused = None
    try:
        await runtime.shutdown(await runtime.init(0, 1))
    except RingweaveError as exc:
        refused = exc
    assert precious.read_text() == PRECIOUS  # before: the trace's JSON
    assert refused is not None and "RINGWEAVE_TRACE" in str(refused) and "\n" not in str(refused), refused


@needs_root
def test_tools_trace_does_not_write_through_a_planted_link(shared_dir, precious, tmp_path):
    """``tools.trace DIR -o <the stranger's directory>/job.json``, and the default output into a
    trace directory the stranger made: refused, exit 1, one line; the owner's file untouched."""
    mine = tmp_path / "traces"
    for r in range(2):
        _one_event_tracer(r, str(mine)).write()
    theirs = str(shared_dir / "out")
    as_stranger(_plant, theirs, ["job.json"], str(precious))
    assert trace_tool.main([str(mine), "-o", os.path.join(theirs, "job.json")]) == 1
    assert precious.read_text() == PRECIOUS
    # their directory as the input, with the default output beside the ranks' files
    shared_traces = str(shared_dir / "their-traces")
    texts = [json.dumps(_one_event_tracer(r, None).to_json()) for r in range(2)]
    as_stranger(_traces_and_a_link, shared_traces, texts, str(precious))
    assert trace_tool.main([shared_traces]) == 1
    assert precious.read_text() == PRECIOUS
    # read from there, written into a directory of our own: merged
    assert trace_tool.main([shared_traces, "-o", str(tmp_path / "merged.json")]) == 0
    assert len(json.loads((tmp_path / "merged.json").read_text())["traceEvents"]) == 2 * 3


def _traces_and_a_link(d: str, texts: list[str], target: str) -> None:
    """As the stranger: a trace directory open to all, with the ranks' files and a link in the
    merged file's default name."""
    os.mkdir(d)
    os.chmod(d, 0o777)
    for r, text in enumerate(texts):
        with open(os.path.join(d, f"trace-rank{r}.json"), "w") as f:
            f.write(text)
    os.symlink(target, os.path.join(d, "job.trace.json"))


def test_the_trace_directory_and_files_are_ours_alone(tmp_path, monkeypatch):
    """Made 0700 (files 0600) whatever the umask; a link we left in a file's place is replaced,
    not followed."""
    old = os.umask(0o022)
    try:
        d = tmp_path / "a" / "traces"
        t = _one_event_tracer(3, str(d))
        (tmp_path / "elsewhere.txt").write_text(PRECIOUS)
        d.mkdir(parents=True, mode=0o700)
        os.symlink(tmp_path / "elsewhere.txt", d / "trace-rank3.json")
        path = t.write()
    finally:
        os.umask(old)
    assert (tmp_path / "elsewhere.txt").read_text() == PRECIOUS
    assert path == str(d / "trace-rank3.json") and not os.path.islink(path)
    assert json.loads(Path(path).read_text())["otherData"]["rank"] == 3
    fresh = tmp_path / "fresh"
    _one_event_tracer(0, str(fresh)).write()
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(fresh / "trace-rank0.json").st_mode) == 0o600
    assert os.listdir(fresh) == ["trace-rank0.json"]  # no temporary file left behind
    assert trace_tool.main([str(fresh)]) == 0
    assert stat.S_IMODE(os.stat(fresh / "job.trace.json").st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_directory_others_may_write_in_or_a_link_is_refused(tmp_path, mode, capsys):
    d = tmp_path / "traces"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(RingweaveError, match=f"has mode {mode:04o}; group and others must not write in it: chmod go-w"):
        _one_event_tracer(0, str(d)).write()
    assert os.listdir(d) == []
    src = tmp_path / "src"
    _one_event_tracer(0, str(src)).write()
    assert trace_tool.main([str(src), "-o", str(d / "job.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"has mode {mode:04o}" in err, err
    link = tmp_path / "link"
    os.chmod(d, 0o700)
    link.symlink_to(d)
    with pytest.raises(RingweaveError, match="is a symbolic link"):
        _one_event_tracer(0, str(link)).write()
    assert os.listdir(d) == []


def test_tools_trace_reads_the_ranks_files_as_untrusted_input(tmp_path, capsys):
    """A FIFO in a rank file's name does not hang the merge, a link is not followed, and a file
    that is not a trace is an error naming it: exit 1, one line, nothing written."""
    d = tmp_path / "traces"
    _one_event_tracer(0, str(d)).write()
    os.mkfifo(d / "trace-rank1.json")
    assert trace_tool.main([str(d)]) == 1
    assert "trace-rank1.json is not a regular file" in capsys.readouterr().err
    os.unlink(d / "trace-rank1.json")
    os.symlink(d / "trace-rank0.json", d / "trace-rank1.json")
    assert trace_tool.main([str(d)]) == 1
    assert "trace-rank1.json cannot be opened safely" in capsys.readouterr().err
    os.unlink(d / "trace-rank1.json")
    for bad in ('{"traceEvents": 5}', "[1, 2]", '{"traceEvents": [1]}', "not json"):
        (d / "trace-rank1.json").write_text(bad)
        assert trace_tool.main([str(d)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "trace-rank1.json is not" in err, (bad, err)
    assert sorted(os.listdir(d)) == ["trace-rank0.json", "trace-rank1.json"]
