"""Dying with the launcher, whatever it is: a rank whose parent process is gone exits.

A launcher that is killed with SIGKILL (mpirun, our launcher, a test harness) cannot
stop the ranks it started: they are re-parented to init (or a subreaper) and would train
on alone. ``runtime.init`` calls :func:`watch_parent` in every rank of a multi-rank job;
a daemon thread then reads ``getppid()`` every :data:`POLL_S` seconds, and when it
changes (the parent has died) it says so on stderr and sends this process SIGTERM, then
SIGKILL if the process is still there :data:`GRACE_S` seconds later (user code that
catches SIGTERM and carries on). An exit hook ends the thread when the interpreter exits.

Why a thread and not only PR_SET_PDEATHSIG (runtime/init.die_with_launcher arms that
for our own launcher): the kernel sends that signal when the *thread* that forked us
exits, which in a multi-threaded launcher (mpirun forks from its event thread) need not
be when the launcher dies; ``getppid()`` changes exactly then. The cost is one system
call per poll.

Not watched: a process whose parent is already pid 1 when it starts (started by init,
or a container's entry point: the launcher cannot be told apart), and jobs with
``RINGWEAVE_WATCH_PARENT=0``. SLURM needs no help but gets it anyway: slurmstepd ends
a step's tasks itself when srun dies.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

POLL_S = 0.5  # a dead launcher is noticed within this long (a getppid() per poll)
GRACE_S = 5.0  # after SIGTERM, the process has this long before SIGKILL

_lock = threading.Lock()
_watched: int | None = None  # the parent pid being watched
_gone = threading.Event()
_stop = threading.Event()  # set at interpreter exit: the watcher ends before the interpreter does
_thread: threading.Thread | None = None


def launcher_gone() -> bool:
    """Whether the watched parent has died (then a SIGTERM is on its way or was sent)."""
    return _gone.is_set()


def parent_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def watch_parent(who: str, poll_s: float = POLL_S) -> bool:
    """Starts the watcher once per process (later calls do nothing); ``who`` names this
    process in the message, e.g. "rank 3". Returns whether the parent is watched."""
    global _watched, _thread
    ppid = os.getppid()
    with _lock:
        if _watched is not None:
            return _watched == ppid
        if ppid <= 1:
            return False
        _watched = ppid
        _thread = threading.Thread(target=_watch, args=(ppid, parent_name(ppid), who, poll_s),
                                   name="ringweave-lifeline", daemon=True)
        _thread.start()
        atexit.register(_stop_watching)
    return True


def _stop_watching() -> None:
    """At exit: the watcher ends (within a poll), so no thread of ours outlives the interpreter's hooks."""
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2 * POLL_S)


def _watch(ppid: int, name: str, who: str, poll_s: float) -> None:
    while os.getppid() == ppid:
        if _stop.wait(poll_s):
            return
    _gone.set()
    try:
        sys.stderr.write(f"ringweave: {who}: its launcher (pid {ppid}, {name}) is gone; exiting\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or broken with the launcher
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    if not _stop.wait(GRACE_S):  # still running: user code caught SIGTERM and carried on
        os.kill(os.getpid(), signal.SIGKILL)
