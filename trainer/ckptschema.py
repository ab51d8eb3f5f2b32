"""What a checkpoint's metadata.json may hold: one table of fields, checked before anything is read.

What it is. ``metadata.json`` is untrusted input (another copy of the run, a bad disk, a
crafted file): :func:`validate` checks it against :data:`SCHEMA` (every key, its type, its
range, names from strict patterns) and then against the rules that tie fields together
(:data:`RULES`: units numbered in order, parameters inside their unit, every array's pieces
tiling ``[0, numel)`` in files ``rankNNNNN/<array>.npy`` of this checkpoint and of a rank
below its world size). Any violation is one :class:`CheckpointError` naming the field, e.g.
``arrays['unit0.param'].pieces[1].file: '../x.npy' is not rank<NNNNN>/unit0.param.npy``.
Readers (trainer/checkpoint.py) call it before they open a piece; ``save`` calls it on what it
is about to write, so nothing is written that could not be read back.

Unknown keys are refused, at the top and inside every record: a newer writer that adds a key
adds it here (and bumps VERSION when older readers must refuse it). Optional keys: "extra"
(the caller's JSON, e.g. the loop's position), "model", "mesh", "created_unix_s" and "run"
(the run's identity: a 32-hex-digit id and a map of scalar settings).

What it is not: the file-size checks (a piece file must hold what the metadata says: the
reader compares them with fstat before allocating) and the CRCs (checked as pieces are read).
"""

from __future__ import annotations

import math
import re

from trainer.precision import DTYPES

__all__ = ["CheckpointError", "FORMAT", "VERSION", "METADATA", "SCHEMA", "RULES", "validate", "array_unit"]

FORMAT, VERSION = "ringweave-checkpoint", 1
METADATA = "metadata.json"


class CheckpointError(RuntimeError):
    """A save that failed (naming the ranks) or a checkpoint that cannot be loaded (naming the file)."""


# ---- limits: generous for real checkpoints, small enough that nothing here runs away ----------------

MAX_INDEX = 2**53  # steps, sizes, offsets: exact in a float64, as JSON readers elsewhere need
MAX_WORLD = 2**20  # ranks
MAX_ITEMS = 2**20  # entries of any list or map
MAX_STR = 4096  # characters of a string in "extra" (names have their own patterns)
MAX_DEPTH = 16  # nesting of "extra"
MAX_DIMS = 8  # dimensions of a parameter's shape

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")  # config keys, optimizer state names
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.+-]{0,63}\Z")  # strategy, optimizer, model kind
PARAM = re.compile(r"[A-Za-z0-9_]{1,64}(\.[A-Za-z0-9_]{1,64}){0,15}\Z")  # "0.weight", "attn.qkv.weight"
ARRAY = re.compile(r"unit(\d{1,6})\.([A-Za-z_][A-Za-z0-9_]{0,63})\Z")  # "unit0.param", "unit3.exp_avg"
PIECE = re.compile(r"rank(\d{5,7})/(.+)\.npy\Z")  # "rank00001/unit0.param.npy"
RUN_ID = re.compile(r"[0-9a-f]{32}\Z")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(where: str, problem: str):
    raise CheckpointError(f"{where}: {problem}")


# ---- checks: each is check(value, where) and raises CheckpointError ----------------------------------


def integer(lo: int, hi: int):
    def check(v, where):
        if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
            _fail(where, f"expected an integer in [{lo}, {hi}], got {_show(v)}")
    return check


def number(lo: float, hi: float, *, open_lo: bool = False, finite: bool = True):
    """An int or float in [lo, hi] (``(lo, hi]`` when ``open_lo``); NaN and infinities only where
    ``finite`` is false (a diverged run's losses are data too)."""
    def check(v, where):
        if type(v) is float and not math.isfinite(v):
            if finite:
                _fail(where, f"expected a finite number, got {_show(v)}")
            return
        if type(v) not in (int, float) or not lo <= v <= hi or (open_lo and v == lo):
            _fail(where, f"expected a number in {'(' if open_lo else '['}{lo}, {hi}], got {_show(v)}")
    return check


def string(pattern: re.Pattern | None = None, max_len: int = MAX_STR):
    def check(v, where):
        if type(v) is not str or len(v) > max_len or (pattern is not None and not pattern.match(v)):
            want = f"a string matching {pattern.pattern!r}" if pattern else f"a string of at most {max_len} characters"
            _fail(where, f"expected {want}, got {_show(v)}")
    return check


def const(value):
    def check(v, where):
        if type(v) is not type(value) or v != value:
            _fail(where, f"expected {value!r}, got {_show(v)}")
    return check


def one_of(values):
    def check(v, where):
        if type(v) is not str or v not in values:
            _fail(where, f"expected one of {sorted(values)}, got {_show(v)}")
    return check


def nullable(inner):
    def check(v, where):
        if v is not None:
            inner(v, where)
    return check


def either(*checks, what: str):
    def check(v, where):
        for c in checks:
            try:
                c(v, where)
                return
            except CheckpointError:
                continue
        _fail(where, f"expected {what}, got {_show(v)}")
    return check


def array(item, max_items: int = MAX_ITEMS):
    def check(v, where):
        if type(v) is not list or len(v) > max_items:
            _fail(where, f"expected a list of at most {max_items} items, got {_show(v)}")
        for i, x in enumerate(v):
            item(x, f"{where}[{i}]")
    return check


def mapping(key: re.Pattern, value, max_items: int = MAX_ITEMS):
    def check(v, where):
        if type(v) is not dict or len(v) > max_items:
            _fail(where, f"expected a map of at most {max_items} entries, got {_show(v)}")
        for k, x in v.items():
            if not key.match(k):
                _fail(where, f"key {_show(k)} does not match {key.pattern!r}")
            value(x, f"{where}[{k!r}]")
    return check


def record(fields: dict, *, open_: bool = False):
    """A map with these keys: ``{name: (required, check)}``; others are refused unless ``open_``
    (then checked as free JSON)."""
    def check(v, where):
        if type(v) is not dict:
            _fail(where, f"expected a map, got {_show(v)}")
        for name, (required, inner) in fields.items():
            if name in v:
                inner(v[name], f"{where}.{name}")
            elif required:
                _fail(where, f"the key {name!r} is missing")
        for name in v:
            if name not in fields:
                if not open_:
                    _fail(where, f"unknown key {_show(name)} (known: {', '.join(fields)}); written by another "
                                 f"version of ringweave?")
                free_json(v[name], f"{where}.{name}")
    return check


def free_json(v, where, depth: int = 0) -> None:
    """Any JSON value, bounded: numbers up to 2**63 in size (NaN and infinities pass: they are
    data), strings up to MAX_STR, at most MAX_ITEMS per list or map, nesting up to MAX_DEPTH."""
    if depth > MAX_DEPTH:
        _fail(where, f"nested deeper than {MAX_DEPTH}")
    if v is None or type(v) in (bool, str, int, float):
        if type(v) is str:
            string(max_len=MAX_STR)(v, where)
        elif type(v) in (int, float):
            number(-(2.0**63), 2.0**63, finite=False)(v, where)
        return
    if type(v) is list:
        array(lambda x, w: free_json(x, w, depth + 1))(v, where)
    elif type(v) is dict:
        if len(v) > MAX_ITEMS:
            _fail(where, f"more than {MAX_ITEMS} entries")
        for k, x in v.items():
            string(max_len=256)(k, f"{where} (a key)")
            free_json(x, f"{where}[{k!r}]", depth + 1)
    else:
        _fail(where, f"not a JSON value: {_show(v)}")


# a scalar setting: what "run" and "model" configs hold
SCALAR = either(const(None), const(True), const(False), integer(-MAX_INDEX, MAX_INDEX), number(-1e308, 1e308),
                string(max_len=256), what="a JSON scalar (null, bool, integer, finite number, string <= 256 chars)")
COUNT = integer(0, MAX_INDEX)
DTYPE = one_of(set(DTYPES))

def piece_file(v, where) -> None:
    if type(v) is not str or len(v) > 256 or not PIECE.match(v):
        _fail(where, f"{_show(v)} is not rank<NNNNN>/<array>.npy (a file inside the checkpoint's directory)")


PIECE_RECORD = record({"file": (True, piece_file), "start": (True, COUNT), "stop": (True, COUNT),
                       "crc32": (True, integer(0, 2**32 - 1))})
ARRAY_RECORD = record({"numel": (True, COUNT), "dtype": (True, DTYPE), "pieces": (True, array(PIECE_RECORD))})
PARAM_RECORD = record({"name": (True, string(PARAM, 1100)),
                       "shape": (True, array(COUNT, MAX_DIMS)), "offset": (True, COUNT)})
UNIT_RECORD = record({"index": (True, integer(0, 2**16)), "numel": (True, COUNT),
                      "params": (True, array(PARAM_RECORD, 2**16))})
# trainer/loop.py's position in the data ("extra"["loop"]): the keys it reads back are typed, others are free JSON
LOOP_RECORD = record({"epoch": (True, COUNT), "step_in_epoch": (True, COUNT), "step": (True, COUNT),
                      "carried": (True, mapping(IDENT, number(-1e308, 1e308, finite=False), 256)),
                      "run": (True, mapping(IDENT, SCALAR, 256)),
                      "history": (True, array(mapping(IDENT, free_json, 256)))}, open_=True)

# The whole file: {key: (required, check)}.
SCHEMA = record({
    "format": (True, const(FORMAT)),
    "version": (True, const(VERSION)),
    "step": (True, COUNT),  # train_step calls: keys dropout and the schedule
    "optim_step": (True, COUNT),
    "strategy": (True, string(NAME)),  # e.g. "zero3"
    "world_size": (True, integer(1, MAX_WORLD)),
    "optimizer": (True, string(NAME)),  # e.g. "adamw"
    "master_dtype": (True, DTYPE),
    "scaler": (True, record({"scale": (True, number(0, 1e308, open_lo=True)), "good_steps": (True, COUNT)})),
    "extra": (False, record({"loop": (False, LOOP_RECORD)}, open_=True)),  # the caller's JSON
    "created_unix_s": (False, number(0, 1e12)),
    "units": (True, array(UNIT_RECORD, 2**16)),
    "arrays": (True, mapping(ARRAY, ARRAY_RECORD)),
    "model": (False, nullable(record({"kind": (True, string(NAME)),
                                      "config": (True, mapping(IDENT, SCALAR, 256))}))),
    "mesh": (False, nullable(mapping(IDENT, integer(1, MAX_WORLD), 8))),
    "run": (False, record({"id": (True, string(RUN_ID, 32)),
                           "config": (True, mapping(IDENT, either(SCALAR, array(SCALAR, 4096),
                                                                  what="a scalar or a list of <= 4096 scalars"),
                                                    1024))})),
})


# ---- rules that tie fields together ------------------------------------------------------------------


def array_unit(name: str) -> int:
    """The unit an array belongs to: ``array_unit("unit3.exp_avg") == 3`` (a name SCHEMA passed)."""
    return int(ARRAY.match(name).group(1))


def _units_in_order(meta) -> None:
    for i, unit in enumerate(meta["units"]):
        if unit["index"] != i:
            _fail(f"units[{i}].index", f"expected {i}, got {unit['index']}")
        for j, p in enumerate(unit["params"]):
            size = math.prod(p["shape"])
            if p["offset"] + size > unit["numel"]:
                _fail(f"units[{i}].params[{j}]", f"{p['name']!r} at offset {p['offset']} with shape {p['shape']} "
                                                 f"ends past the unit's {unit['numel']} elements")


def _arrays_match_units(meta) -> None:
    units = meta["units"]
    for name, entry in meta["arrays"].items():
        u = array_unit(name)
        if u >= len(units):
            _fail(f"arrays[{name!r}]", f"names unit {u}, but there are {len(units)} units")
        if entry["numel"] != units[u]["numel"]:
            _fail(f"arrays[{name!r}].numel", f"{entry['numel']} differs from unit {u}'s {units[u]['numel']}")
    for i in range(len(units)):
        if f"unit{i}.param" not in meta["arrays"]:
            _fail("arrays", f"no 'unit{i}.param' for unit {i}")


def _pieces_tile(meta) -> None:
    """Each array's pieces are sorted, non-empty and tile [0, numel) exactly, each in its own
    file ``rankNNNNN/<array>.npy`` of a rank below the world size."""
    for name, entry in meta["arrays"].items():
        at, files = 0, set()
        for k, piece in enumerate(entry["pieces"]):
            where = f"arrays[{name!r}].pieces[{k}]"
            if piece["start"] != at or piece["stop"] <= piece["start"]:
                _fail(where, f"[{piece['start']}, {piece['stop']}) does not continue the pieces before it at {at}")
            m = PIECE.match(piece["file"])
            rank = int(m.group(1))
            if m.group(2) != name or m.group(1) != f"{rank:05d}" or rank >= meta["world_size"] or piece["file"] in files:
                _fail(f"{where}.file", f"{_show(piece['file'])} is not rank<NNNNN>/{name}.npy of a rank below the "
                                       f"world size {meta['world_size']}, once")
            files.add(piece["file"])
            at = piece["stop"]
        if at != entry["numel"]:
            _fail(f"arrays[{name!r}].pieces", f"cover [0, {at}), not the {entry['numel']} elements of the array")


RULES = (_units_in_order, _arrays_match_units, _pieces_tile)


def validate(meta) -> dict:
    """Checks parsed metadata against SCHEMA, then RULES; returns it unchanged.

    Raises:
        CheckpointError: the first violation, naming the field and what was expected.
    """
    SCHEMA(meta, "metadata")
    for rule in RULES:
        rule(meta)
    return meta
