"""Fuzzing the checkpoint loader: every mutation of the newest checkpoint ends as a fallback to the
one before or a clean CheckpointError; never another exception, never a hang, never an allocation
beyond the files' size (SECURITY.md, "Checkpoints").

Hypothesis (derandomized: the same 200 examples every run, a few seconds) draws one mutation of the
newest of two checkpoints (tests/security/ckptutil.py: zero3 at 2 ranks, 2 units x 3 arrays x 2
pieces):

* a value of metadata.json replaced: null, booleans, negative and huge numbers, NaN, strings,
  path tricks (absolute, ``../``, another rank's file), lists and maps, the value's own type
  swapped (a number as a string, in a list, scaled by 2**20);
* a key renamed, deleted or added;
* bytes of metadata.json or of a piece's .npy flipped, inserted or cut (header and data);
* the file system: a piece, a rank directory or metadata.json replaced by a FIFO, a directory,
  an empty file or a link to a real file elsewhere.

Then both readers run on the copy: ``read_full_params`` of the mutated checkpoint (must return or
raise CheckpointError) and ``load_newest_valid`` of the root (must load step 2 or fall back to
step 1), each example under a 5 s alarm, and no array the loader makes (``np.empty`` /
``np.zeros`` in trainer.checkpoint, counted) larger than the checkpoint's files. The test prints how the examples ended, and asserts each ending was reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from runtime.testing import run_ranks
from tests.security.ckptutil import config, model, save_steps
from trainer import checkpoint
from trainer.sharding import make_strategy

pytestmark = pytest.mark.timeout(120)
EXAMPLES = 200
ALARM_S = 5

HOSTILE = [None, True, False, -1, 0, 1, 2**31, 2**53 + 1, 2**64, 10**30, -(2**53), 1.5, 1e308, float("nan"),
           float("inf"), "", "x", "/etc/passwd", "../../etc/passwd", "rank00000/../../x.npy",
           "rank00001/unit0.param.npy", "rank00000/unit0.param.npy/..", "a" * 5000, [], {}, [0], {"a": 1},
           [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]


def _nodes(value, path=()):
    """Every (path, value) of a JSON tree, the root excluded."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return []
    out = []
    for k, v in items:
        out.append((path + (k,), v))
        out += _nodes(v, path + (k,))
    return out


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _swaps(value) -> list:
    """The value with its type changed, or scaled past any file."""
    out = [str(value), [value], {"v": value}]
    if type(value) in (int, float):
        out += [value + 1, -value, value * 2**20, float(value)]
    return out


@st.composite
def mutations(draw, meta: dict, files: list[str]):
    """One mutation: (kind, arguments), applied by ``apply``."""
    kind = draw(st.sampled_from(["value", "value", "key", "meta_bytes", "npy_bytes", "file_system"]))
    if kind == "value":
        path, old = draw(st.sampled_from(_nodes(meta)))
        return kind, (path, draw(st.sampled_from(HOSTILE + _swaps(old))))
    if kind == "key":
        maps = [p for p, v in [((), meta), *_nodes(meta)] if isinstance(v, dict) and v]
        path = draw(st.sampled_from(maps))
        key = draw(st.sampled_from(sorted(_at(meta, path))))
        return kind, (path, key, draw(st.sampled_from(["rename", "delete", "add"])))
    if kind in ("meta_bytes", "npy_bytes"):
        file = "metadata.json" if kind == "meta_bytes" else draw(st.sampled_from(files))
        edits = draw(st.lists(st.tuples(st.sampled_from(["flip", "insert", "cut"]), st.integers(0, 10**6),
                                        st.integers(1, 255)), min_size=1, max_size=4))
        return kind, (file, edits)
    target = draw(st.sampled_from(files + ["metadata.json", "rank00000", "rank00001"]))
    return kind, (target, draw(st.sampled_from(["fifo", "directory", "empty", "link"])))


def apply(ckpt: Path, outside: Path, kind: str, args) -> None:
    meta_path = ckpt / checkpoint.METADATA
    if kind in ("value", "key"):
        meta = json.loads(meta_path.read_text())
        if kind == "value":
            path, new = args
            _at(meta, path[:-1])[path[-1]] = new
        else:
            path, key, how = args
            node = _at(meta, path)
            value = node.pop(key) if how != "add" else None
            if how == "rename":
                node[key + "x"] = value
            elif how == "add":
                node["unknown_" + str(key)] = 1
        meta_path.write_text(json.dumps(meta))
    elif kind in ("meta_bytes", "npy_bytes"):
        file, edits = args
        data = bytearray((ckpt / file).read_bytes())
        for how, at, byte in edits:
            at %= len(data) + 1
            if how == "flip" and at < len(data):
                data[at] ^= byte
            elif how == "insert":
                data[at:at] = bytes([byte]) * byte
            else:
                del data[at:]
        (ckpt / file).write_bytes(bytes(data))
    else:
        target, how = args
        path = ckpt / target
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        if how == "fifo":
            os.mkfifo(path, 0o600)
        elif how == "directory":
            path.mkdir(0o700)
        elif how == "empty":
            path.write_bytes(b"")
        else:
            path.symlink_to(outside / target)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    asyncio.run(save_steps(root, 2))
    return root


@pytest.fixture(scope="module")
def strategy():
    """A set-up ddp strategy at world size 1 (its loads are local: no collective runs)."""
    async def make(group):
        s = make_strategy("ddp", model(), config(), group)
        await s.setup()
        return s

    [s] = asyncio.run(run_ranks(1, make))
    yield s
    s.close()


def _alarm(*_):
    raise TimeoutError(f"a mutation made the loader wait more than {ALARM_S} s")


class CountingNumpy:
    """NumPy as trainer.checkpoint sees it, but every array it makes with ``empty`` / ``zeros``
    records its size: the loader's allocations, whose bytes come from the metadata."""

    def __init__(self) -> None:
        self.largest = 0

    def __getattr__(self, name):
        return getattr(np, name)

    def _note(self, shape, dtype) -> None:
        self.largest = max(self.largest, int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize)

    def empty(self, shape, dtype=float, **kw):
        self._note(shape, dtype)
        return np.empty(shape, dtype, **kw)

    def zeros(self, shape, dtype=float, **kw):
        self._note(shape, dtype)
        return np.zeros(shape, dtype, **kw)


def test_every_mutation_ends_as_a_fallback_or_a_clean_error(pristine, strategy, tmp_path, monkeypatch):
    step2 = pristine / "step-00000002"
    meta = json.loads((step2 / checkpoint.METADATA).read_text())
    files = sorted(str(p.relative_to(step2)) for p in step2.rglob("*.npy"))
    nbytes = sum(p.stat().st_size for p in step2.rglob("*") if p.is_file())
    outside = tmp_path / "outside"
    shutil.copytree(step2, outside)  # the targets of links: real files, outside the checkpoint
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)  # step 1 stays intact; step 2 is copied afresh for every mutation
    target = root / "step-00000002"
    counting = CountingNumpy()
    monkeypatch.setattr(checkpoint, "np", counting)
    ended: Counter = Counter()
    loop = asyncio.new_event_loop()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(mutation=mutations(meta, files))
    def one(mutation):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(step2, target)
        apply(target, outside, *mutation)
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(ALARM_S)
        counting.largest = 0
        try:
            try:
                checkpoint.read_full_params(target)
                read = "read"
            except checkpoint.CheckpointError:
                read = "refused"
            loaded = loop.run_until_complete(checkpoint.load_newest_valid(strategy, root))
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        assert loaded is not None and loaded["step"] in (1, 2), mutation
        assert counting.largest <= nbytes, (mutation, counting.largest)
        ended[(read, "loaded step 2" if loaded["step"] == 2 else "fell back to step 1")] += 1

    try:
        one()
    finally:
        loop.close()
    print(f"\n{EXAMPLES} mutations of a {nbytes}-byte checkpoint: {dict(ended)}")
    assert ended[("refused", "fell back to step 1")] > EXAMPLES // 2, ended
    assert ended[("read", "loaded step 2")] > 0, ended  # harmless ones (e.g. a timestamp) still load
    assert counting.largest > 0  # the count saw the loader's arrays
