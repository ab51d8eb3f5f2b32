"""Running a fault through the real launcher and reading what every rank saw.

A fault test writes a small rank script (``PRELUDE`` + its own body) to
``tmp_path``, runs ``python -m runtime.launch -n 4 job.py OUT`` in a
subprocess and gets back a :class:`JobResult`: the launcher's exit code and
output, and one :class:`Report` per rank parsed from lines the ranks print::

    rank R: <ErrorType> after X.XXX s: <message>

X is the time from the fault to the error on that rank, on the system-wide
monotonic clock (``time.monotonic()`` is CLOCK_MONOTONIC on Linux, the same in
every process): the faulty rank writes the instant of the fault to
``OUT/fault`` just before it happens (a self-SIGKILL, a self-SIGSTOP, a raise).

The survivors catch SIGTERM and go on (the launcher sends it as soon as it
sees the first rank die, and waits ``--grace-s`` before SIGKILL): otherwise the
launcher would stop them before the runtime had a chance to show that it
surfaces the fault by itself. Every rank writes its pid to ``OUT/pid.R`` so
the test can check that no process of the job is left.

Not here: what each fault must produce (the test files say that).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

PRELUDE = r'''
import asyncio, os, signal, sys, time
import numpy as np
import runtime
import collectives as C
from runtime.errors import RingweaveError

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
OUT = sys.argv[1]
with open(os.path.join(OUT, f"pid.{RANK}"), "w") as _f:
    _f.write(str(os.getpid()))
SIGTERM_AT = []
REPORTED = []
signal.signal(signal.SIGTERM, lambda s, f: SIGTERM_AT.append(time.monotonic()))  # report first (harness.py)


def mark_fault(what):
    """Writes the instant of the fault (monotonic, system-wide) for the other ranks."""
    path = os.path.join(OUT, "fault")
    with open(path + ".tmp", "w") as f:
        f.write(f"{time.monotonic()!r} {RANK} {what}")
    os.replace(path + ".tmp", path)


def since_fault():
    try:
        with open(os.path.join(OUT, "fault")) as f:
            return f"{time.monotonic() - float(f.read().split()[0]):.3f}"
    except (FileNotFoundError, ValueError, IndexError):
        return "?"


def report(exc):
    dt = since_fault()
    msg = " | ".join(str(exc).splitlines())
    term = f" (SIGTERM from the launcher came first)" if SIGTERM_AT else ""
    REPORTED.append(exc)
    print(f"rank {RANK}: {type(exc).__name__} after {dt} s: {msg}{term}", flush=True)


def die(sig=signal.SIGKILL, what="SIGKILL"):
    mark_fault(what)
    os.kill(os.getpid(), sig)


def linger(reporters, timeout_s=6.0):
    """Waits (bounded) until ``reporters`` ranks have reported: a survivor that left at
    once would be a second lost peer, and a rank whose event loop was busy when the
    fault happened could name that one instead of the rank the test killed."""
    open(os.path.join(OUT, f"reported.{RANK}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(n.startswith("reported.") for n in os.listdir(OUT)) >= reporters:
            return
        time.sleep(0.01)


def run(body, reporters=None):
    """Runs ``await body(rt)`` after init; a RingweaveError is reported and the
    rank exits 1 once ``reporters`` ranks (default WORLD - 1) have reported."""
    async def main():
        rt = await runtime.init()
        try:
            await body(rt)
        except RingweaveError as exc:
            report(exc)
            linger(WORLD - 1 if reporters is None else reporters)
            # Leave as a program whose exception escaped does (no shutdown rendezvous: the
            # job is broken). Not os._exit: a survivor that skipped the interpreter's
            # teardown (numba's alone takes ~0.4 s) would exit before the rank that raised
            # in user code, and the launcher, which names the first rank to exit non-zero,
            # would name the survivor.
            raise SystemExit(1)
        await runtime.shutdown(rt)
    asyncio.run(main())
'''

REPORT_RE = re.compile(r"^\[rank (\d+)\] rank (\d+): (\w+) after ([\d.?]+) s: (.*)$", re.M)


@dataclass
class Report:
    rank: int
    error: str        # e.g. "PeerLostError"
    after_s: float    # from the fault to the error on this rank
    message: str


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    pids: dict[int, int]
    reports: dict[int, Report] = field(default_factory=dict)  # rank -> its last report
    all_reports: list[Report] = field(default_factory=list)  # in the order printed

    def show(self, title: str) -> None:
        """Prints the per-rank figures (pytest -s shows them)."""
        print(f"\n== {title}: launcher exit {self.returncode} after {self.wall_s:.2f} s")
        for r in sorted(self.reports):
            rep = self.reports[r]
            print(f"   rank {r}: {rep.error} after {rep.after_s:.3f} s: {rep.message[:300]}")

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"


def write_script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(PRELUDE + "\n" + body)
    return path


def launch(tmp_path: Path, body: str, *, n: int = 4, launcher_args: tuple = ("--grace-s", "8"),
           env: dict | None = None, timeout_s: float = 60.0, during=None) -> JobResult:
    """Runs the rank script ``body`` under the real launcher; ``during(proc, out)``
    (optional) runs while the job does (e.g. to ask tools.status)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    script = write_script(tmp_path, body)
    cmd = [PYTHON, "-m", "runtime.launch", "-n", str(n), *launcher_args, str(script), str(out)]
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        if during is not None:
            during(proc, out)
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    pids = {int(p.name.split(".")[1]): int(p.read_text()) for p in out.glob("pid.*")}
    result = JobResult(proc.returncode, stdout, stderr, time.monotonic() - t0, pids)
    for m in REPORT_RE.finditer(stdout):
        rank = int(m.group(2))
        after = float(m.group(4)) if m.group(4) != "?" else float("nan")
        result.reports[rank] = Report(rank, m.group(3), after, m.group(5))
        result.all_reports.append(result.reports[rank])
    return result


def wait_for_file(path: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def assert_no_process_left(result: JobResult, expected_ranks: int = 4, timeout_s: float = 3.0) -> None:
    assert len(result.pids) == expected_ranks, f"pids of ranks {sorted(result.pids)}: {result.explain()}"
    deadline = time.monotonic() + timeout_s
    while True:
        left = {r: p for r, p in result.pids.items() if alive(p)}
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of the job left after the launcher exited: {left}")
        time.sleep(0.05)
