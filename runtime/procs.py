"""Rank processes for the launcher: spawn, prefix their output, stop whole trees.

- :func:`spawn` starts one rank with fork+exec (``loop.subprocess_exec``, never
  a multiprocessing fork of a process that has threads) as the leader of a new
  process group (``start_new_session=True``), so that group holds the rank and
  everything it starts, and one ``killpg`` reaches all of it.
- :class:`RankProtocol` splits the rank's stdout and stderr into lines, writes
  each line prefixed ``[rank R] `` to the launcher's stdout / stderr, keeps the
  last lines for a failure report, and says when the rank exited: as soon as the
  process is reaped, not when its pipes close (a grandchild that inherited them
  must not delay its rank's failure). A traceback that is the echo of another
  rank's failure (that rank aborted the job first) is written as its last line
  (:class:`TracebackFolder`): one rank's error makes one traceback, not N. A
  usage error (argparse's ``usage:`` block, then ``PROG: error: ...``) is
  written as its error line, once per attempt whichever ranks wrote it
  (:class:`UsageFolder`): a bad flag on N ranks makes one line.
- :func:`stop_all` signals every rank's group, waits a grace period, kills what
  is left, and reaps orphaned descendants (the launcher makes itself a child
  subreaper on Linux, so grandchildren whose rank died are reparented to it
  rather than to PID 1, which may never reap them).

Lifecycle of one rank: ``spawn -> RUNNING [-> output*] -> exited (returncode)
[-> output*] -> pipes closed -> close()``. Output may still arrive after the
exit (what the rank wrote just before dying) until the pipes close.

Not here: which exit code the launcher returns, when to restart or what to print
about a failure (pure functions in launch_outcome.py).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

MAX_LINE_NBYTES = 64 * 1024  # a longer run of bytes without a newline is written as its own line
POLL_S = 0.02  # how often stop_all looks whether the groups are empty

Sink = Callable[[int, bytes], None]  # (fd 1 or 2, bytes) -> writes them out


class LineSplitter:
    """Bytes in, complete lines (without their newline) out. No I/O.

    A run longer than ``max_line_nbytes`` without a newline is cut into pieces
    of that size, so a rank printing a progress bar with ``\\r`` forever cannot
    grow the launcher's memory.
    """

    def __init__(self, max_line_nbytes: int = MAX_LINE_NBYTES):
        self._max = max_line_nbytes
        self._partial = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._partial += data
        lines: list[bytes] = []
        if b"\n" in data:
            *lines, rest = bytes(self._partial).split(b"\n")
            self._partial = bytearray(rest)
        while len(self._partial) > self._max:
            lines.append(bytes(self._partial[:self._max]))
            del self._partial[:self._max]
        return lines

    def flush(self) -> list[bytes]:
        """The partial last line, if any (at EOF)."""
        if not self._partial:
            return []
        line, self._partial = bytes(self._partial), bytearray()
        return [line]


TRACEBACK_START = "Traceback (most recent call last):"
_CHAIN_HEADERS = ("During handling of the above exception, another exception occurred:",
                  "The above exception was the direct cause of the following exception:")
MAX_FOLDED_LINES = 2000  # a "traceback" longer than this is written out as it came


class TracebackFolder:
    """Finds Python tracebacks in a stream of lines and folds each into one line when ``fold()``
    says so at its first line. No I/O: ``feed(line)`` and ``flush()`` return the lines to write.

    A traceback runs from ``Traceback (most recent call last):`` through the frames (indented
    lines) to the exception line (the first line that is not indented), chained ones taken in
    (a blank line, "During handling of ..." or "The above exception ...", another traceback).
    Folded, it is written as that last exception line plus ``(traceback of N lines not shown:
    <why>)``; lines after it pass through. ``last_exception`` is the exception line of the
    last traceback seen, folded or not.
    """

    def __init__(self, fold: Callable[[], str | None]):
        self._fold = fold  # -> why (e.g. "rank 1's ValueError aborted the job"), or None: write in full
        self._state: str | None = None  # None: outside a traceback; "frames"; "after" its exception line
        self._folding = False
        self._why = ""
        self._held: list[bytes] = []
        self._exc_line: bytes | None = None
        self.last_exception: str | None = None

    def feed(self, line: bytes) -> list[bytes]:
        text = line.rstrip(b"\r").decode("utf-8", "replace")
        if self._state is None:
            if text != TRACEBACK_START:
                return [line]
            self._state, self._exc_line = "frames", None
            why = self._fold()
            self._folding, self._why = bool(why), why or ""
            return self._take(line)
        if self._state == "frames":
            if text and not text[0].isspace() and text != TRACEBACK_START and text not in _CHAIN_HEADERS:
                self._state, self._exc_line, self.last_exception = "after", line, text
            return self._take(line)
        if not text.strip() or text in _CHAIN_HEADERS or text == TRACEBACK_START:  # a chained one may follow
            if text.strip():
                self._state = "frames"
            return self._take(line)
        return self.flush() + [line]

    @property
    def in_frames(self) -> bool:
        """Whether the lines fed now are a traceback's, before its exception line."""
        return self._state == "frames"

    def flush(self) -> list[bytes]:
        """Ends the traceback (at EOF, or when a line after it arrives); returns its one line if folded."""
        self._state = None
        held, self._held = self._held, []
        if not self._folding or not held:
            return []
        self._folding = False
        last = (self._exc_line or held[-1]).rstrip(b"\r")
        return [last + f" (traceback of {len(held)} lines not shown: {self._why})".encode()]

    def _take(self, line: bytes) -> list[bytes]:
        if not self._folding:
            return [line]
        self._held.append(line)
        if len(self._held) > MAX_FOLDED_LINES:  # not a traceback after all: write it as it came
            held, self._held, self._folding = self._held, [], False
            return held
        return []


USAGE_START = "usage: "
ERROR_LINE = re.compile(r"^(\S[^:]*): error: \S")  # argparse's "PROG: error: MESSAGE"
MAX_USAGE_LINES = 400  # a "usage" longer than this is written out as it came


class UsageFolder:
    """Usage errors in a stream of lines, each written once per attempt. No I/O: ``feed(line)``
    and ``flush()`` return the lines to write.

    A ``usage:`` line and the indented lines after it are held until the error line
    (``PROG: error: MESSAGE``) that argparse writes after them: then the error line alone is
    written, with a pointer to ``PROG --help``; any other line writes the held ones as they
    came. An error line is written only if no rank of the attempt wrote the same one before
    (``written``, shared by the attempt's ranks). ``error`` is the last error line of this
    rank, written or not.
    """

    def __init__(self, written: set[str] | None = None):
        self._written = set() if written is None else written
        self._held: list[bytes] = []
        self.error: str | None = None

    def feed(self, line: bytes) -> list[bytes]:
        text = line.rstrip(b"\r").decode("utf-8", "replace")
        if self._held:
            if text[:1].isspace() and len(self._held) < MAX_USAGE_LINES:
                self._held.append(line)
                return []
            m = ERROR_LINE.match(text)
            if m:
                self._held = []
                return self._error(text, f" (usage: {m.group(1)} --help)")
            return self.flush() + self.feed(line)
        if text.startswith(USAGE_START):
            self._held = [line]
            return []
        return self._error(text, "") if ERROR_LINE.match(text) else [line]

    def flush(self) -> list[bytes]:
        """The held lines, as they came (at EOF, or when the block was no usage error)."""
        held, self._held = self._held, []
        return held

    def _error(self, text: str, hint: str) -> list[bytes]:
        self.error = text
        if text in self._written:
            return []
        self._written.add(text)
        return [(text + hint).encode()]


class RankProtocol(asyncio.SubprocessProtocol):
    """The pipes and the exit of one rank.

    Attributes:
        exited: resolves to the returncode as soon as the rank is reaped
            (negative: killed by that signal).
        exited_at: ``time.monotonic()`` when that happened.
        pipes_closed: resolves when both stdout and stderr reached EOF.
        tail: the last lines of its stdout and stderr, interleaved as they came.
    """

    def __init__(self, rank: int, sink: Sink, tail_lines: int, fold: Callable[[], str | None] = lambda: None,
                 usage_errors: set[str] | None = None):
        loop = asyncio.get_running_loop()
        self.rank = rank
        self._sink = sink
        self._prefix = f"[rank {rank}] ".encode()
        self._splitters = {1: LineSplitter(), 2: LineSplitter()}
        self._folder = TracebackFolder(fold)  # stderr's tracebacks that are another rank's failure's echo
        self._usage = UsageFolder(usage_errors)  # stderr's usage errors, once per attempt
        self._open_fds = {1, 2}
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited: asyncio.Future[int] = loop.create_future()
        self.exited_at: float | None = None
        self.pipes_closed: asyncio.Future[None] = loop.create_future()
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._emit(fd, self._splitters[fd].feed(data))

    def pipe_connection_lost(self, fd: int, exc) -> None:
        if fd not in self._open_fds:
            return
        self._emit(fd, self._splitters[fd].flush())
        if fd == 2:
            self._flush_folders()
        self._open_fds.discard(fd)
        if not self._open_fds and not self.pipes_closed.done():
            self.pipes_closed.set_result(None)

    def process_exited(self) -> None:
        self.exited_at = time.monotonic()
        if not self.exited.done():
            self.exited.set_result(self.transport.get_returncode())

    @property
    def last_exception(self) -> str | None:
        """The exception line of the last traceback the rank wrote to stderr, if any."""
        return self._folder.last_exception

    def flush_partial(self) -> None:
        """Writes partial last lines of pipes that are still open (held by a
        descendant that escaped its group), at the very end."""
        for fd in sorted(self._open_fds):
            self._emit(fd, self._splitters[fd].flush())
            if fd == 2:
                self._flush_folders()

    def _flush_folders(self) -> None:
        """Writes what the folders of stderr hold, at its end."""
        held = [out for line in self._usage.flush() for out in self._folder.feed(line)]
        self._emit(2, held + self._folder.flush(), folded=True)

    @property
    def usage_error(self) -> str | None:
        """The last usage error line the rank wrote to stderr (``PROG: error: ...``), if any."""
        return self._usage.error

    def _emit(self, fd: int, lines: list[bytes], folded: bool = False) -> None:
        if fd == 2 and not folded:
            lines = [out for line in lines for out in self._fold(line)]
        if not lines:
            return
        self._sink(fd, b"".join(self._prefix + line + b"\n" for line in lines))
        self.tail.extend(line.rstrip(b"\r").decode("utf-8", "replace") for line in lines)

    def _fold(self, line: bytes) -> list[bytes]:
        """One stderr line through the folders: a traceback's frames go to the traceback's alone."""
        if self._folder.in_frames:
            return self._folder.feed(line)
        return [out for kept in self._usage.feed(line) for out in self._folder.feed(kept)]


@dataclass
class RankProcess:
    """One spawned rank: its process group id equals its pid."""

    rank: int
    transport: asyncio.SubprocessTransport
    protocol: RankProtocol
    pid: int = field(init=False)

    def __post_init__(self):
        self.pid = self.transport.get_pid()

    @property
    def returncode(self) -> int | None:
        return self.protocol.exited.result() if self.protocol.exited.done() else None

    def signal_group(self, sig: int) -> bool:
        """Sends ``sig`` to every process of the rank's group. Returns False
        when the group is empty (or not ours to signal)."""
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def group_alive(self) -> bool:
        """Whether any process (zombies included) is left in the rank's group."""
        return self.signal_group(0)

    def close(self) -> None:
        self.protocol.flush_partial()
        self.transport.close()


async def spawn(rank: int, argv: list[str], env: dict[str, str], sink: Sink,
                tail_lines: int = 20, fold: Callable[[], str | None] = lambda: None,
                usage_errors: set[str] | None = None) -> RankProcess:
    """Starts one rank in its own process group (``start_new_session=True``). ``fold()``, asked at
    each traceback the rank writes to stderr, says why to write it as one line (or None);
    ``usage_errors``: the usage error lines the attempt's ranks wrote (:class:`UsageFolder`).

    Raises:
        OSError: the program could not be started.
    """
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(
        lambda: RankProtocol(rank, sink, tail_lines, fold, usage_errors), *argv,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, start_new_session=True)
    return RankProcess(rank, transport, protocol)


async def stop_all(ranks: Iterable[RankProcess], sig: int, grace_s: float,
                   hurry: Callable[[], bool] = lambda: False) -> list[int]:
    """Stops every rank's whole process group: ``sig`` now, SIGKILL to the
    groups still not empty after ``grace_s`` (or at once when ``hurry()``
    turns true), then waits for the ranks to be reaped and reaps their
    orphaned descendants.

    Groups that are already empty are skipped, so this is also the clean-up
    after a job in which every rank exited by itself.

    Returns:
        the ranks whose groups had to be killed with SIGKILL.
    """
    ranks = list(ranks)
    leaders = {r.pid for r in ranks}
    for r in ranks:
        r.signal_group(sig)
    deadline = time.monotonic() + grace_s
    killed: list[int] = []
    while True:
        reap_orphans(leaders)
        alive = [r for r in ranks if r.group_alive()]
        if not alive:
            break
        if time.monotonic() >= deadline or hurry():
            for r in alive:
                r.signal_group(signal.SIGKILL)
            killed = [r.rank for r in alive]
            break
        await asyncio.sleep(POLL_S)
    exits = [r.protocol.exited for r in ranks if not r.protocol.exited.done()]
    if exits:
        await asyncio.wait(exits, timeout=2.0)
    await kill_orphans(leaders)
    return killed


async def drain(ranks: Iterable[RankProcess], timeout_s: float) -> None:
    """Waits (bounded) until every rank's pipes reached EOF, so that the last
    lines a rank wrote are printed and in its tail."""
    pending = [r.protocol.pipes_closed for r in ranks if not r.protocol.pipes_closed.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)


# -- orphans ------------------------------------------------------------------

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Makes this process the reaper of its orphaned descendants (Linux
    ``prctl(PR_SET_CHILD_SUBREAPER)``; not inherited by children). Returns
    whether that worked; elsewhere orphans go to init as usual."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_pids(parent: int | None = None) -> list[int]:
    """Pids whose parent is ``parent`` (default: this process), from /proc."""
    parent = os.getpid() if parent is None else parent
    pids = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return pids
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # state ppid pgrp ...
        if len(fields) > 1 and int(fields[1]) == parent:
            pids.append(int(name))
    return pids


def reap_orphans(leaders: set[int]) -> None:
    """Reaps exited children of ours that are not rank leaders (the asyncio
    child watcher reaps those): orphans reparented to us as subreaper."""
    for pid in child_pids():
        if pid in leaders:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


async def kill_orphans(leaders: set[int], timeout_s: float = 2.0) -> list[int]:
    """SIGKILLs and reaps every child of ours that is not a rank leader: a
    descendant of a rank that outlived it (also one that left its group with
    setsid). Returns their pids."""
    found: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        strays = [pid for pid in child_pids() if pid not in leaders]
        if not strays:
            break
        for pid in strays:
            if pid not in found:
                found.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, os.WNOHANG)
            except (ProcessLookupError, ChildProcessError, PermissionError):
                pass
        await asyncio.sleep(POLL_S)
    return found
