"""Every ``RINGWEAVE_*`` setting, declared once: name, parser, default, when it is read, what it does.

Code reads a setting only through its object here (``env.SHM_SPIN.get()``), never through
``os.environ``: a bad value is then a :class:`~runtime.errors.SettingError` naming the variable
and its value wherever it is read, and the README's settings table is generated from this one
(``tests/runtime/test_settings.py`` fails when the two differ)::

    python -m runtime.env                  # every setting: its effective value, and whether it was set
    python -m runtime.env --readme         # rewrite README.md's settings table from the declarations
    python -m runtime.env --markdown       # print that table

Adding a setting is one declaration in the table below (``_`` is :func:`declare`),
``NAME = _("RINGWEAVE_NAME", parser, "default", "when", "what it does")``, then
``python -m runtime.env --readme``. The default is written as the variable's text would be (None:
unset), and parsed like it. An empty or blank value counts as unset.

Reading fast. Some settings are read at every call, so that changing them between calls takes
effect (``RINGWEAVE_SHM``, ``RINGWEAVE_ALGO_<COLLECTIVE>``, ``RINGWEAVE_KERNELS``).
``os.environ.get`` encodes the name and, when it is absent (the usual case), raises and catches
a KeyError inside; :func:`get` looks in the dict behind ``os.environ`` (kept by CPython's ``os``
module on POSIX) with the name encoded once, and :meth:`Setting.get` parses a value once and
keeps it while the text stays the same (bench/results/runtime.md#reading-a-setting). Both see
what ``os.environ[...] = ...`` (and pytest's monkeypatch) set; neither sees a bare ``os.putenv``.

Not here: the launchers' and schedulers' own variables (RANK, MASTER_ADDR, SLURM_*: runtime/scheduler.py,
runtime/rendezvous.py).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import warnings
from typing import Any, Callable, Mapping

from runtime.errors import SettingError

if sys.argv[:1] == ["-m"] and "runtime.env" in getattr(sys, "orig_argv", ()):
    # python -m runtime.env: runpy would warn that the package's __init__ imported this module first
    warnings.filterwarnings("ignore", "'runtime.env' found in sys.modules", RuntimeWarning)

_data = getattr(os.environ, "_data", None)
_encode = getattr(os.environ, "encodekey", None)
_decode = getattr(os.environ, "decodevalue", None)
_keys: dict[str, object] = {}


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, faster: the raw text (for a declared setting, use its
    :class:`Setting`)."""
    if _data is None or _encode is None or _decode is None:  # pragma: no cover - not CPython/POSIX
        return os.environ.get(name, default)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = _encode(name)
    value = _data.get(key)
    return default if value is None else _decode(value)


# -- parsers: text -> value; ValueError saying what the value must be ---------------------------------


def text(raw: str) -> str:
    """The text as it is."""
    return raw


def switch(raw: str) -> bool:
    """``1``/``0`` (also ``true``/``false``, ``on``/``off``, ``yes``/``no``)."""
    word = raw.strip().lower()
    if word in ("1", "true", "on", "yes"):
        return True
    if word in ("0", "false", "off", "no"):
        return False
    raise ValueError("must be 1 or 0 (true/false, on/off, yes/no)")


def nbytes(raw: str) -> int:
    """A byte count >= 0: an integer, or with a K/M/G suffix (binary: ``4M`` is 4 MiB)."""
    word = raw.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(word[-1:], 1)
    try:
        value = int(word[:-1] if scale > 1 else word) * scale
    except ValueError:
        raise ValueError("is not a byte count (e.g. 4194304 or 4M)") from None
    if value < 0:
        raise ValueError("must be 0 or more bytes")
    return value


def number(unit: str, ok: Callable[[float], bool], must: str) -> Callable[[str], float]:
    """A parser of a finite float in ``unit`` (``""``: a plain number) for which ``ok`` holds, else
    ``must``. NaN and the infinities never pass (nor ``1e309``, which reads as infinity): no deadline,
    size or rate is meant by them, and each would fail later, far from the text that caused it."""
    what = f"a number of {unit}" if unit else "a number"

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"is not {what}") from None
        if not math.isfinite(value) or not ok(value):
            raise ValueError(must)
        return value
    parse.__doc__ = f"{what[:1].upper()}{what[1:]}: {must}."
    return parse


def integer(what: str, ok: Callable[[int], bool], must: str) -> Callable[[str], int]:
    """A parser of ``what`` (an integer) for which ``ok`` holds, else ``must``."""
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"is not {what}") from None
        if not ok(value):
            raise ValueError(must)
        return value
    parse.__doc__ = f"{what[:1].upper()}{what[1:]}: {must}."
    return parse


def choice(*words: str) -> Callable[[str], str]:
    """A parser that takes one of ``words``."""
    def parse(raw: str) -> str:
        if raw not in words:
            raise ValueError(f"must be one of {', '.join(words)}")
        return raw
    parse.__doc__ = f"One of {', '.join(words)}."
    return parse


def signal_names(raw: str) -> tuple[str, ...]:
    """Signals, comma-separated, by name (``TERM``, ``SIGUSR1``) or number; ``none``: none."""
    if raw.strip().lower() == "none":
        return ()
    names = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        word = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        try:
            sig = signal.Signals(int(item)) if item.isdigit() else signal.Signals[word]
        except (KeyError, ValueError):
            raise ValueError(f"names no signal ({item!r}): give names like TERM,USR1, numbers, or none") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"names {sig.name}, which cannot be caught")
        names.append(sig.name)
    return tuple(names)


count = integer("an integer", lambda v: v >= 0, "must be 0 or more")
exit_code = integer("an integer exit code", lambda v: 1 <= v <= 255,
                    "must be an exit code in 1..255 (0 would read as success)")
positive_seconds = number("seconds", lambda v: v > 0, "must be a positive, finite number of seconds")
check_seconds = number("seconds", lambda v: v >= 0, "must be 0 (off) or a positive, finite number of seconds")
microseconds = number("microseconds", lambda v: v >= 0, "must be 0 or more microseconds, finite")
mebibytes = number("MiB", lambda v: v >= 0, "must be 0 or more MiB, finite")
kibibytes = number("KiB", lambda v: v >= 0, "must be 0 or more KiB, finite")


def raw_reader(*settings: "Setting") -> Callable[[], tuple]:
    """A function returning the raw values of ``settings`` now (bytes or text as the OS holds
    them, None where unset), for code that memoizes on them: one call reads several variables
    for about the cost of one :meth:`Setting.get`."""
    if _data is None or any(s._key is None for s in settings):  # pragma: no cover - not CPython/POSIX
        names = [s.name for s in settings]
        return lambda: tuple(os.environ.get(n) for n in names)
    get, keys = _data.get, [s._key for s in settings]
    if len(keys) == 3:
        k0, k1, k2 = keys
        return lambda: (get(k0), get(k1), get(k2))
    return lambda: tuple(get(k) for k in keys)


# -- the declarations ----------------------------------------------------------------------------------


class Setting:
    """One ``RINGWEAVE_*`` variable. :meth:`get` is its value now: the variable's text parsed,
    the default's when it is unset or blank. The last text read and its value are kept, so
    a setting read at every call costs a dict look-up and a string compare."""

    __slots__ = ("name", "parse", "default", "when", "doc", "_key", "_default_value", "_last")

    def __init__(self, name: str, parse: Callable[[str], Any], default: str | None, when: str, doc: str):
        self.name, self.parse, self.default, self.when, self.doc = name, parse, default, when, doc
        self._key = _encode(name) if _encode is not None else None
        self._default_value = None if default is None else self._parse(default)
        self._last: tuple = (None, None)  # (raw text or bytes, value): one tuple, so threads see a matching pair

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value now (from ``environ`` when given, else the process's environment).

        Raises:
            SettingError: the text does not parse; the message names the variable and its value.
        """
        if environ is not None:
            raw = environ.get(self.name)
        elif self._key is not None and _data is not None:
            raw = _data.get(self._key)  # bytes as the OS holds them: decoded only when they change
        else:  # pragma: no cover - not CPython/POSIX
            raw = os.environ.get(self.name)
        if raw is None:
            return self._default_value
        last = self._last
        if raw == last[0]:
            return last[1]
        text = raw if isinstance(raw, str) else _decode(raw)
        value = self._default_value if not text.strip() else self._parse(text)
        self._last = (raw, value)
        return value

    def given(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value when the variable is set (not blank), else None (whatever the default)."""
        raw = (os.environ if environ is None else environ).get(self.name)
        return self.get(environ) if raw is not None and raw.strip() else None

    def pop(self, environ: dict | None = None) -> Any:
        """:meth:`given`, and the variable taken out of ``environ`` (the process's by default)."""
        environ = os.environ if environ is None else environ
        value = self.given(environ)
        environ.pop(self.name, None)
        return value

    def _parse(self, raw: str) -> Any:
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise SettingError(f"{self.name}={raw!r} {exc}") from None

    def __repr__(self) -> str:
        return f"Setting({self.name}, default={self.default!r}, read at {self.when})"


class SettingFamily:
    """Settings named by a pattern, ``RINGWEAVE_ALGO_<COLLECTIVE>``: one :class:`Setting` per key,
    made on first use (``env.ALGO.get("all_reduce")`` reads ``RINGWEAVE_ALGO_ALL_REDUCE``)."""

    def __init__(self, name: str, parse: Callable[[str], Any], default: str | None, when: str, doc: str):
        self.name, self.parse, self.default, self.when, self.doc = name, parse, default, when, doc
        self.prefix = name.split("<")[0]
        self._members: dict[str, Setting] = {}

    def __getitem__(self, key: str) -> Setting:
        member = self._members.get(key)
        if member is None:
            member = self._members[key] = Setting(self.prefix + key.upper(), self.parse, self.default,
                                                  self.when, self.doc)
        return member

    def get(self, key: str, environ: Mapping[str, str] | None = None) -> Any:
        return self[key].get(environ)

    def set_names(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """The family's variables set in ``environ`` (the process's by default)."""
        return sorted(k for k in (os.environ if environ is None else environ) if k.startswith(self.prefix))


SETTINGS: dict[str, Setting | SettingFamily] = {}


def declare(name: str, parse: Callable[[str], Any], default: str | None, when: str, doc: str):
    """Declares the setting ``name`` (a ``<KEY>`` in it makes a :class:`SettingFamily`) and returns it."""
    if name in SETTINGS:
        raise ValueError(f"{name} is declared twice")
    SETTINGS[name] = (SettingFamily if "<" in name else Setting)(name, parse, default, when, doc)
    return SETTINGS[name]


# When read: "init" (when a runtime, actor or store is made), "launch" (by the launcher), "each call"
# (every collective), "each wait" (on shared memory), "each connection", "each socket". Nothing is
# read at import, so a bad value is an error where it is used, and `python -m runtime.env` shows it.
# Variables the launcher sets for its ranks are marked so in their doc.
_ = declare
SECRET = _("RINGWEAVE_SECRET", text, None, "init, launch",
           "the job's secret (the launcher makes one; ranks on one host started without it share one made "
           "for the job in a file of this user's alone); required beyond one host (SECURITY.md)")
HANDSHAKE_TIMEOUT = _("RINGWEAVE_HANDSHAKE_TIMEOUT_S", positive_seconds, "10", "init, each connection",
                      "how long a new connection has to finish the authentication handshake; a rank's or the "
                      "store's listener drops one that takes longer (a client that connects and says nothing)")
TIMEOUT = _("RINGWEAVE_TIMEOUT_S", positive_seconds, "300", "init",
            "the deadline of every wait, in seconds; a collective timeout names the ranks that never arrived")
MISMATCH_CHECK = _("RINGWEAVE_MISMATCH_CHECK_S", check_seconds, "1", "init",
                   "a call in flight this long (then 2, 4, ... s more) asks the ranks it waits on which call "
                   "they are in, so ranks that disagree get a CollectiveMismatchError before the timeout; the "
                   "5th check also logs the ranks that have not arrived (0: never ask)")
INLINE_WAIT = _("RINGWEAVE_INLINE_WAIT_US", microseconds, "2000", "init",
                "how long a collective message of up to 1 MiB is waited for on its socket before the event "
                "loop takes over (0: never); only while one call is in flight and the process has one runtime")
SPIN = _("RINGWEAVE_SPIN_US", microseconds, "50", "init",
         "of that wait, how long the socket is re-read (sched_yield between reads) before the rank sleeps "
         "in poll() (0: sleep at once)")
SHM = _("RINGWEAVE_SHM", switch, "1", "init, each call",
        "0: no same-host shared memory, TCP only (also Communicator(shm=False)); where ranks differ at "
        "init, all take TCP")
SHM_SPIN = _("RINGWEAVE_SHM_SPIN", count, "5", "each wait",
             "sched_yield spins before a rank waiting on shared memory sleeps")
SHM_COMPILED = _("RINGWEAVE_SHM_COMPILED", choice("auto", "1", "0"), "auto", "each domain",
                  "the compiled small shared-memory all_reduce and barrier: auto (when every rank on the node "
                  "has a core of its own), 1 (always), 0 (never)")
SHM_STREAM_MIN = _("RINGWEAVE_SHM_STREAM_MIN", nbytes, "4M", "each call",
                   "the shared-memory all_reduce size from which copies bypass the caches")
RCVLOWAT = _("RINGWEAVE_RCVLOWAT", switch, "1", "each connection",
             "0: TCP wakes per packet while a large payload arrives, not per few MiB (SO_RCVLOWAT)")
SOCKET_BUFFER = _("RINGWEAVE_SOCKET_BUFFER", nbytes, "4M", "each socket",
                  "send and receive buffer of every TCP socket (SO_SNDBUF, SO_RCVBUF; 0: the kernel's)")
KERNELS = _("RINGWEAVE_KERNELS", choice("numpy", "numba"), None, "each call",
            "numpy: the NumPy reference reduction kernels instead of Numba")
ALGO = _("RINGWEAVE_ALGO_<COLLECTIVE>", text, None, "each call",
         "force an algorithm, e.g. RINGWEAVE_ALGO_ALL_REDUCE=ring (the same on every rank)")
# -- the tuner's rules file (collectives/tunefile.py, written by python -m collectives.tune) --
TUNE = _("RINGWEAVE_TUNE", switch, "1", "each call",
         "0: ignore the rules file python -m collectives.tune wrote for this machine and layout; the built-in "
         "table chooses")
TUNE_FILE = _("RINGWEAVE_TUNE_FILE", text, None, "each call",
              "a rules file to load instead of $XDG_CACHE_HOME/ringweave/tune/<machine key>.json (its key must "
              "still match the machine and layout)")
TUNE_PROBE = _("RINGWEAVE_TUNE_PROBE_S", number("seconds", lambda v: 0 <= v <= 10, "must be 0 (off) to 10 seconds"),
                "0", "init", "the same on every rank: where no rules file exists for this machine and group size, "
                "runtime.init() measures the job's all_reduce for about this long and writes one (0: never)")
# -- end of the tuner's settings --
WARMUP = _("RINGWEAVE_WARMUP", switch, "1", "init",
            "0: runtime.init() runs no warm-up (runtime/warmup.py): the first collective imports and compiles "
            "what it needs on the loop's thread, as short jobs and the test suite may prefer")
REQUIRE_PTX = _("RINGWEAVE_REQUIRE_PTX", switch, "0", "the PTX test",
                "1 (make test sets it): tests/kernels/test_kernels_ptx.py fails, instead of skipping, where no "
                "libNVVM / NVRTC compiles PTX")
TRACE = _("RINGWEAVE_TRACE", text, None, "init",
          "directory for per-rank collective traces (python -m tools.trace DIR merges them)")
HOST = _("RINGWEAVE_HOST", text, None, "init",
         "the address this host advertises to its peers (default: the one that routes to MASTER_ADDR)")
JOB = _("RINGWEAVE_JOB", text, "ringweave", "init",
        "the job's name, the same on every rank; names its shared-memory segments (the launcher sets it)")
STORE_HOSTED = _("RINGWEAVE_STORE_HOSTED", switch, "0", "init",
                 "1: the launcher hosts the rendezvous store, so rank 0 does not (the launcher sets it)")
ELASTIC = _("RINGWEAVE_ELASTIC", text, None, "init",
            "MIN:MAX: the job is elastic (python -m runtime.launch --elastic MIN:MAX sets it): generations of "
            "members decided in the store, runtime.elastic.reform re-forms the job after a loss")
ELASTIC_JOIN = _("RINGWEAVE_ELASTIC_JOIN", switch, "0", "init",
                 "1: this process replaces a lost rank and joins the running job (the launcher sets it)")
MEMBER = _("RINGWEAVE_MEMBER", text, None, "init",
           "this process's member id in an elastic job, e.g. job/r2/j1 (the launcher sets it; under srun "
           "without it, derived from SLURM's variables: slurm-<job>.<step>/r<task>/a<restart>)")
RESTART = _("RINGWEAVE_RESTART", count, "0", "init",
            "how many times the job has restarted; store keys go under restart/N (the launcher sets it)")
STORE_PORT = _("RINGWEAVE_STORE_PORT", integer("a port", lambda v: 1 <= v <= 65535, "must be a port in 1..65535"),
                None, "init", "under torchrun: the port rank 0 hosts the rendezvous store on, the same for every rank "
                "(default: derived from TORCHELASTIC_RUN_ID, MASTER_ADDR and MASTER_PORT, which torchrun's own store "
                "holds)")
LAUNCHER_PID = _("RINGWEAVE_LAUNCHER_PID", count, None, "init",
                 "the launcher's pid: the rank dies with it, and takes the variable out (the launcher sets it)")
PINNED_POOL = _("RINGWEAVE_PINNED_POOL_MIB", mebibytes, "256", "each pool",
                "page-locked host memory the device collectives keep for staging, in MiB; "
                "beyond it a call stages through temporary pageable memory")
DEVICE_SEGMENT = _("RINGWEAVE_DEVICE_SEGMENT_KIB", number("KiB", lambda v: v >= 4, "must be 4 KiB or more, finite"),
                   "4096", "each call", "bytes per pipelined segment of a device collective, in KiB")
DEVICE_HOST_REDUCE = _("RINGWEAVE_DEVICE_HOST_REDUCE_KIB", kibibytes, "256", "each call",
                       "a device collective whose larger array is up to this size is staged whole and run by the "
                       "host collectives; larger ones are pipelined in segments, reduced on the device (0: always "
                       "pipelined)")
WATCH_PARENT = _("RINGWEAVE_WATCH_PARENT", switch, "1", "init",
                 "0: a rank of a multi-rank job does not exit when its launcher (its parent process) dies "
                 "(runtime/lifeline.py)")
PREEMPT_SIGNALS = _("RINGWEAVE_PREEMPT_SIGNALS", signal_names, "TERM,USR1", "each training run",
                    "the signals on which a training run with --checkpoint-dir saves a checkpoint at a step every "
                    "rank agrees on and exits (none: none; trainer/preempt.py)")
PREEMPT_CHECK = _("RINGWEAVE_PREEMPT_CHECK_S", check_seconds, "1", "each training run",
                  "about how often the ranks agree on whether such a signal came: it is acted on within about "
                  "this and a step (0: at every step, an all_reduce per step)")
PREEMPT_EXIT_CODE = _("RINGWEAVE_PREEMPT_EXIT_CODE", exit_code, None, "each training run",
                      "the exit code after such a stop (unset: 128 + the signal, 143 for TERM, 138 for USR1), "
                      "e.g. one that slurm.conf's RequeueExit lists")
del _

DEFAULT_TIMEOUT_S: float = TIMEOUT.get({})
DEFAULT_MISMATCH_CHECK_S: float = MISMATCH_CHECK.get({})
DEFAULT_INLINE_WAIT_US: float = INLINE_WAIT.get({})
DEFAULT_SPIN_US: float = SPIN.get({})


def timeout_s() -> float:
    """``RINGWEAVE_TIMEOUT_S`` as it is now, in seconds (not when a module was imported)."""
    return TIMEOUT.get()


def mismatch_check_s() -> float:
    """``RINGWEAVE_MISMATCH_CHECK_S`` as it is now, in seconds (0: off; ProcessGroup.check_stalled)."""
    return MISMATCH_CHECK.get()


def inline_wait_s() -> float:
    """``RINGWEAVE_INLINE_WAIT_US`` as it is now, in seconds (Call.sendrecv)."""
    return INLINE_WAIT.get() / 1e6


def spin_s() -> float:
    """``RINGWEAVE_SPIN_US`` as it is now, in seconds (TCPConnection.recv_now)."""
    return SPIN.get() / 1e6


def pinned_pool_bytes() -> int:
    """``RINGWEAVE_PINNED_POOL_MIB`` in bytes: the device collectives' staging pool (collectives/device_pool.py)."""
    return int(PINNED_POOL.get() * (1 << 20))


def device_segment_bytes() -> int:
    """``RINGWEAVE_DEVICE_SEGMENT_KIB`` in bytes: one pipelined segment of a device collective (collectives/device.py)."""
    return int(DEVICE_SEGMENT.get() * 1024)


def device_host_reduce_bytes() -> int:
    """``RINGWEAVE_DEVICE_HOST_REDUCE_KIB`` in bytes: the largest device collective staged whole through the host."""
    return int(DEVICE_HOST_REDUCE.get() * 1024)


def preempt_exit_code(signum: int) -> int:
    """The exit code of a run stopped by signal ``signum``: RINGWEAVE_PREEMPT_EXIT_CODE, else 128 + signum."""
    code = PREEMPT_EXIT_CODE.get()
    return 128 + signum if code is None else code


# -- python -m runtime.env -----------------------------------------------------------------------------

README_BEGIN = "<!-- settings: generated by `python -m runtime.env --readme` from runtime/env.py; edit there -->"
README_END = "<!-- /settings -->"


def markdown_table() -> str:
    """The README's settings table."""
    lines = ["| variable | default | read | what it does |", "| --- | --- | --- | --- |"]
    for s in SETTINGS.values():
        default = "unset" if s.default is None else f"`{s.default}`"
        lines.append(f"| `{s.name}` | {default} | {s.when} | {s.doc} |")
    return "\n".join(lines)


def readme_block() -> str:
    return f"{README_BEGIN}\n{markdown_table()}\n{README_END}"


def update_readme(path: str) -> bool:
    """Rewrites the block between the markers in ``path``; True when it changed."""
    with open(path, encoding="utf-8") as f:
        old = f.read()
    start, end = old.index(README_BEGIN), old.index(README_END) + len(README_END)
    new = old[:start] + readme_block() + old[end:]
    if new != old:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != old


def effective(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(variable, value, where from) for every setting, and any unknown ``RINGWEAVE_*`` variable."""
    environ = os.environ if environ is None else environ
    rows = []
    for s in SETTINGS.values():
        if isinstance(s, SettingFamily):
            members = [s[n[len(s.prefix):].lower()] for n in s.set_names(environ)]
            if not members:
                rows.append((s.name, "unset", "default"))
        else:
            members = [s]
        for m in members:
            try:
                value = m.get(environ)
                shown = "unset" if value is None else "(set, not shown)" if m is SECRET else repr(value)
            except SettingError as exc:
                shown = f"ERROR: {exc}"
            raw = environ.get(m.name)
            rows.append((m.name, shown, "environment" if raw is not None and raw.strip() else "default"))
    families = tuple(s.prefix for s in SETTINGS.values() if isinstance(s, SettingFamily))
    for name in sorted(environ):
        if name.startswith("RINGWEAVE_") and name not in SETTINGS and not name.startswith(families):
            rows.append((name, repr(environ[name]), "not a setting: ignored"))
    return rows


README_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def main(argv: list[str] | None = None) -> int:
    """``python -m runtime.env``: exit status 1 when a setting's value does not parse."""
    import argparse  # lazy: only python -m runtime.env parses arguments; every process imports this module
    p = argparse.ArgumentParser(prog="python -m runtime.env", description=__doc__.splitlines()[0])
    p.add_argument("--readme", nargs="?", const=README_PATH, metavar="PATH",
                   help="rewrite the settings table in PATH (default: the project's README.md)")
    p.add_argument("--markdown", action="store_true", help="print the README's settings table")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown_table())
        return 0
    if args.readme:
        print(f"{args.readme}: {'updated' if update_readme(args.readme) else 'already up to date'}")
        return 0
    rows = effective()
    width = max(len(r[0]) for r in rows)
    for name, value, source in rows:
        print(f"{name:<{width}s}  {value:<20s}  {source}")
    return 1 if any(value.startswith("ERROR") for _, value, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
