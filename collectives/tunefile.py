"""The tuner's rules file: where it lives, what it is keyed to, how it is checked and looked up.

``python -m collectives.tune -n N`` (collectives/tune.py) writes one JSON file per machine and
layout, ``$XDG_CACHE_HOME/ringweave/tune/w<N>-h<hosts>x<per host>-<digest>.json`` (``~/.cache``
without XDG_CACHE_HOME). Its ``key`` names the CPU model, the cores this process may run on, the
memory, the group size, the hosts and ranks per host, and the library version (the package's
version and a digest of the algorithm files): a different machine, layout or library looks for
another name, and a file whose key differs is refused. Besides the rules it holds each algorithm's
fitted line (``fits``, collectives/tunefit.py) and measured ``settings`` (:func:`stream_min`,
:func:`compiled`: a RINGWEAVE_* setting that is set wins). :func:`rules_for` gives
``registry.choose`` the rules of a group, or None, and is read at every call, cheaply (cached);
a group size with no file of its own takes the lines of the nearest size tuned here (:func:`derived`):

* ``RINGWEAVE_TUNE=0``: None (the built-in table chooses);
* ``RINGWEAVE_TUNE_FILE=path``: that file instead of the one in the cache (its key must match);
* a missing file: None, silently; a malformed one (not JSON, a schema error, an unknown
  algorithm), another user's, one others may write, a link, or one keyed to something else:
  None, with a one-line warning (once per file and group shape).

The file is parsed as untrusted input (JSON, never pickle; :func:`parse` checks every field) and
written with runtime/owndir.py's rules: a directory of this user's that nobody else may write in,
a new file (``O_EXCL | O_NOFOLLOW``, 0600) renamed into place.

Every rank of a group must load the same rules: ranks on one host read the same file; a rank
whose choice differs still gets a ``CollectiveMismatchError`` naming both, as with overrides.

Not here: measuring (collectives/tune.py), the model (collectives/costmodel.py), the built-in table
and what runs when a rule cannot (collectives/registry.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Mapping

from collectives.costmodel import FORMULAS, Machine
from runtime import env, owndir, private
from runtime.errors import PrivateDirError

__all__ = ["FORMAT", "TuneRules", "machine_key", "default_path", "parse", "load", "save", "holds", "rules_for",
           "for_group", "install", "stream_min", "compiled"]

log = logging.getLogger("ringweave.tune")

FORMAT = "ringweave-tune/1"
MAX_FILE_BYTES = 1 << 20  # a rules file is a few KiB; anything larger is not ours
STATES = ("shm", "tcp")
SETTINGS = {"shm_stream_min": int, "shm_compiled": bool}  # what the file may set besides algorithms
NEAREST = 64  # a group of a size not tuned takes the lines of the nearest size tuned up to this many ranks  # rules for shared memory on, and off (TCP only)
SHM_ONLY = ("shm", "hierarchical")  # algorithms that "tcp" rules may not name
_FILE_RULES = private.Rules("the tuner's rules file", private.NOT_WRITABLE, PrivateDirError,
                            owner_risk="its owner decides which algorithms run", fix="remove it and tune again",
                            mode_fix="chmod go-w it")


@dataclass(frozen=True, eq=False)  # hashed by identity: part of a key of registry._CHOSEN
class TuneRules:
    """A checked rules file: per state ("shm" on, "tcp" only) and collective, ``(upto, algorithm)``
    pairs in rising ``upto`` (bytes, inclusive; None: any size); algorithm None: the table's."""
    key: dict
    rules: dict  # {"shm": {"all_reduce": ((65536, "recursive_doubling"), (None, "ring")), ...}, ...}
    path: str = ""
    fits: dict = field(default_factory=dict)  # {"all_reduce": {"ring": (alpha, beta), ...}}: tunefit.py
    settings: dict = field(default_factory=dict)  # {"shm_stream_min": 4194304, "shm_compiled": True}
    model: Machine | None = None

    def pick(self, collective: str, shm: bool, nbytes: int) -> str | None:
        """The algorithm the file names for ``nbytes``, or None where it names none."""
        for upto, algorithm in self.rules.get("shm" if shm else "tcp", {}).get(collective, ()):
            if upto is None or nbytes <= upto:
                return algorithm
        return None


@functools.cache
def library_version() -> str:
    """The package's version and a digest of the files that decide what an algorithm does."""
    base = os.path.dirname(os.path.abspath(__file__))  # collectives/
    digest = hashlib.sha256()
    for top, dirs, files in sorted(os.walk(os.path.join(base, "algorithms"))):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(top, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    for name in ("tuning.py", "comm.py"):
        with open(os.path.join(base, name), "rb") as f:
            digest.update(f.read())
    try:
        pkg = version("ringweave")
    except PackageNotFoundError:  # not installed: run from a checkout
        pkg = "0+checkout"
    return f"{pkg}+{digest.hexdigest()[:12]}"


@functools.cache
def _host() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        memory = 0
    return {"cpu": cpu, "cores": cores, "memory_gib": round(memory / (1 << 30))}


def machine_key(world: int, hosts: int = 1, per_host: int | None = None) -> dict:
    """What a rules file is keyed to: this machine, a group of ``world`` ranks on ``hosts`` hosts
    with at most ``per_host`` on one, and this library."""
    return dict(_host(), world=world, hosts=hosts, per_host=world if per_host is None else per_host,
                version=library_version())


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ringweave", "tune")


def default_path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"w{key['world']}-h{key['hosts']}x{key['per_host']}-{digest}.json")


def parse(data: bytes, key: dict | None, algorithms: Mapping, path: str = "") -> TuneRules:
    """A checked :class:`TuneRules` from a file's bytes; ``key`` None accepts any key;
    ``algorithms``: the names a rule may give, by collective (registry.ALGORITHMS).

    Raises:
        ValueError: not JSON, not this format, a field of the wrong type, an unknown collective or
            algorithm, sizes not rising, or a key other than ``key`` (the message names the field).
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"format must be {FORMAT!r}")
    extra = set(doc) - {"format", "key", "model", "rules", "times", "written", "command", "fits", "settings"}
    if extra:
        raise ValueError(f"unknown fields {sorted(extra)}")
    if not isinstance(doc.get("key"), dict):
        raise ValueError("key must be an object")
    if key is not None and doc["key"] != key:
        differ = sorted(k for k in set(key) | set(doc["key"]) if key.get(k) != doc["key"].get(k))
        raise ValueError(f"keyed to another machine or layout ({', '.join(differ)} differ: file "
                         f"{ {k: doc['key'].get(k) for k in differ} }, here { {k: key.get(k) for k in differ} })")
    model = Machine.from_json(doc["model"]) if "model" in doc else None  # ValueError naming the term
    raw = doc.get("rules")
    if not isinstance(raw, dict) or not set(raw) <= set(STATES):
        raise ValueError(f"rules must be an object with keys among {STATES}")
    rules = {}
    for state, table in raw.items():
        if not isinstance(table, dict):
            raise ValueError(f"rules.{state} must be an object")
        rules[state] = {}
        for collective, entries in table.items():
            where = f"rules.{state}.{collective}"
            if collective not in algorithms:
                raise ValueError(f"{where}: unknown collective; known: {sorted(algorithms)}")
            rules[state][collective] = _entries(where, entries, algorithms[collective], state)
    return TuneRules(doc["key"], rules, path, _fits(doc.get("fits", {}), algorithms),
                     _settings(doc.get("settings", {})), model)


def _fits(raw, algorithms: Mapping) -> dict:
    if not isinstance(raw, dict):
        raise ValueError("fits must be an object")
    out = {}
    for collective, lines in raw.items():
        if collective not in algorithms or not isinstance(lines, dict):
            raise ValueError(f"fits.{collective}: unknown collective, or not an object")
        out[collective] = {}
        for name, line in lines.items():
            where = f"fits.{collective}.{name}"
            if name not in algorithms[collective]:
                raise ValueError(f"{where}: unknown algorithm; choose from {sorted(algorithms[collective])}")
            if not (isinstance(line, list) and len(line) == 2):
                raise ValueError(f"{where} must be [alpha, beta]")
            out[collective][name] = tuple(_term(f"{where}[{i}]", v) for i, v in enumerate(line))
    return out


def _term(where: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
        raise ValueError(f"{where} must be a finite number >= 0, got {v!r}")
    return float(v)


def _settings(raw) -> dict:
    if not isinstance(raw, dict) or not set(raw) <= set(SETTINGS):
        raise ValueError(f"settings must be an object with keys among {sorted(SETTINGS)}")
    for name, value in raw.items():
        kind = SETTINGS[name]
        if type(value) is not kind or (kind is int and value < 0):
            raise ValueError(f"settings.{name} must be {'a byte count' if kind is int else 'true or false'}, "
                             f"got {value!r}")
    return dict(raw)


def _entries(where: str, entries, algorithms, state: str) -> tuple:
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where} must be a non-empty list of [upto, algorithm]")
    out, last = [], -1
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 2):
            raise ValueError(f"{where}[{i}] must be [upto, algorithm], got {entry!r}")
        upto, algorithm = entry
        final = i == len(entries) - 1
        if final != (upto is None) or (upto is not None and (isinstance(upto, bool) or not isinstance(upto, int)
                                                           or upto <= last)):
            raise ValueError(f"{where}[{i}]: upto must be a rising byte count, and null in the last entry only")
        if algorithm is not None and (algorithm not in algorithms or (state == "tcp" and algorithm in SHM_ONLY)):
            raise ValueError(f"{where}[{i}]: {algorithm!r} is not a {state} algorithm; choose from {sorted(algorithms)}")
        out.append((upto, algorithm))
        last = upto if upto is not None else last
    return tuple(out)


def load(path: str, key: dict | None, algorithms: Mapping) -> TuneRules:
    """The checked rules of the file at ``path``, opened without following a link: a regular file
    of this user's that nobody else may write, in such a directory.

    Raises:
        FileNotFoundError: no such file (or directory).
        PrivateDirError: a link, not a regular file, another owner, writable by others.
        ValueError: see :func:`parse`.
    """
    return parse(_read_bytes(path), key, algorithms, path)


def _read_bytes(path: str) -> bytes:
    """A rules file's bytes, checked as :func:`load` says (the same errors, less ValueError's parse)."""
    where = os.path.dirname(os.path.abspath(path))
    dfd = owndir.open_dir(where, create=False, what="the tuner's directory")
    try:
        fd, st = private.open_file(os.path.basename(path), dfd, _FILE_RULES, label=path)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_FILE_BYTES:
            raise ValueError(f"{st.st_size} bytes, more than a rules file's {MAX_FILE_BYTES}")
        return f.read(MAX_FILE_BYTES + 1)


def _text(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def holds(path: str, doc: dict) -> bool:
    """Whether the file at ``path`` is ``doc`` as :func:`save` writes it (False: missing, or
    anything :func:`load` refuses)."""
    try:
        return _read_bytes(path) == _text(doc).encode()
    except (OSError, ValueError, PrivateDirError):
        return False


def save(doc: dict, algorithms: Mapping, path: str | None = None) -> str:
    """Writes ``doc`` (checked with :func:`parse` first) to ``path`` (default: its key's place in
    the cache), replacing what was there; returns the path. PrivateDirError: a directory that
    others may write in, or another user's."""
    text = _text(doc)
    parse(text.encode(), None, algorithms)
    path = path or default_path(doc["key"])
    where = os.path.dirname(os.path.abspath(path))
    dfd = owndir.open_dir(where, create=True, what="the tuner's directory")
    try:
        with owndir.replacing(dfd, os.path.basename(path), durable=True) as f:
            f.write(text)
    finally:
        os.close(dfd)
    return path


# (file setting, world, hosts, per_host) -> the rules or None; refusals warned once each
_LOADED: dict[tuple, TuneRules | None] = {}


def forget() -> None:
    """Forgets the rules files read and installed (registry.forget)."""
    _LOADED.clear()


def _algorithms() -> Mapping:
    return FORMULAS  # a formula per registered algorithm (tests/collectives/test_tune_model.py)


def rules_for(world: int, hosts: int, per_host: int, algorithms: Mapping | None = None) -> TuneRules | None:
    """The rules for a group of ``world`` ranks on ``hosts`` hosts (at most ``per_host`` on one),
    or None: off (``RINGWEAVE_TUNE=0``), no file, or a file refused (warned once). Without a file
    for this size on one host, the lines of the nearest size tuned on this machine, carried to
    this size (:func:`derived`). Cheap to call; ``algorithms`` as for :func:`parse` (default
    the names registry.ALGORITHMS has, as costmodel.FORMULAS holds them)."""
    if world <= 1 or not env.TUNE.get():
        return None
    named = env.TUNE_FILE.get()
    cached = (named, world, hosts, per_host)
    if cached in _LOADED:
        return _LOADED[cached]
    algorithms = _algorithms() if algorithms is None else algorithms
    rules = _read(named, machine_key(world, hosts, per_host), algorithms, warn_missing=bool(named))
    if rules is None and not named and hosts == 1:
        rules = derived(world, algorithms)
    if len(_LOADED) > 64:
        _LOADED.clear()
    _LOADED[cached] = rules
    return rules


def _read(named, key: dict, algorithms: Mapping, warn_missing: bool) -> TuneRules | None:
    path = named or default_path(key)
    try:
        return load(path, key, algorithms)
    except FileNotFoundError:
        if warn_missing:
            log.warning("RINGWEAVE_TUNE_FILE=%s: no such file; the built-in table chooses", named)
    except (ValueError, OSError, PrivateDirError) as exc:
        log.warning("tuning rules %s refused (%s); the built-in table chooses", path, str(exc).replace("\n", " "))
    return None


def derived(world: int, algorithms: Mapping) -> TuneRules | None:
    """Rules for ``world`` ranks on this host from the file of the nearest group size tuned here
    (up to :data:`NEAREST` ranks): its fitted lines rescaled (tunefit.rescale), the cheapest line
    per size, crossings as boundaries. None: no such file, or one without lines or model."""
    from collectives import tunefit  # lazy: only where a size was not tuned
    sizes = sorted(range(2, NEAREST + 1), key=lambda w: (abs(math.log(w / world)), w))
    for other in sizes:
        if other == world or not os.path.exists(default_path(machine_key(other, 1, other))):
            continue
        src = _read(None, machine_key(other, 1, other), algorithms, warn_missing=False)
        if src is None or src.model is None or not src.fits:
            return None
        rules: dict = {state: {} for state in src.rules}
        fits: dict = {}
        for collective, lines in src.fits.items():
            moved = fits[collective] = {a: tunefit.rescale(src.model, collective, a, line, other, world)
                                        for a, line in lines.items()}
            grid = (0,) if collective == "barrier" else tuple(4 << (2 * k) for k in range(13))
            for state in rules:
                allowed = [a for a in moved if state == "shm" or a not in SHM_ONLY]
                if allowed:
                    mine = {a: moved[a] for a in allowed}
                    winners = tunefit.winners_from_fits(mine, grid, allowed)
                    rules[state][collective] = tuple(
                        (u, a) for u, a in tunefit.thresholds(winners, mine, extrapolate=True))
        settings = {k: v for k, v in src.settings.items() if k != "shm_compiled"}  # cores per rank differ
        return TuneRules(machine_key(world), rules, f"{src.path} (carried from {other} ranks)", fits, settings,
                         src.model)
    return None


def install(doc: dict, world: int, algorithms: Mapping | None = None) -> TuneRules:
    """Checks ``doc`` (a rules file's content, e.g. from the probe at init) and makes it the rules
    of groups of ``world`` ranks on this host in this process, as if read from its file."""
    rules = parse(json.dumps(doc).encode(), None, _algorithms() if algorithms is None else algorithms)
    _LOADED[(env.TUNE_FILE.get(), world, 1, world)] = rules
    return rules


def shape(group, world: int) -> tuple[int, int]:
    """(hosts, most ranks on one host) of ``group`` (a ProcessGroup; None: one host)."""
    if group is None or group.topology.hosts == 1:
        return 1, world
    return group.topology.hosts, max(len(node) for node in group.topology.nodes)


def for_group(group) -> TuneRules | None:
    """:func:`rules_for` the group (a ProcessGroup)."""
    hosts, per_host = shape(group, group.size)
    return rules_for(group.size, hosts, per_host)


def stream_min(group) -> int:
    """Bytes per rank from which the shared-memory all_reduce's copies bypass the caches:
    RINGWEAVE_SHM_STREAM_MIN where set, else the rules file's ``shm_stream_min``, else the default."""
    forced = env.get(env.SHM_STREAM_MIN.name)
    if forced is None or not forced.strip():
        rules = for_group(group)
        if rules is not None and "shm_stream_min" in rules.settings:
            return rules.settings["shm_stream_min"]
    return env.SHM_STREAM_MIN.get()


def compiled(group, heuristic: bool) -> bool:
    """Whether the compiled small shared-memory path serves ``group`` under RINGWEAVE_SHM_COMPILED=auto:
    the rules file's measured ``shm_compiled`` where it has one, else ``heuristic``."""
    rules = for_group(group)
    return heuristic if rules is None else rules.settings.get("shm_compiled", heuristic)
