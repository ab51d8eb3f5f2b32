"""One command for any machine: ringweave's speed goals, each against Gloo, OpenMPI or torch
measured in the same run, three runs each, within a time budget, into one file keyed by the machine.

    python bench/machine.py                          # 8 minutes -> bench/results/machine-<key>.md
    python bench/machine.py --budget 900 --runs 5    # longer, more runs per goal
    python bench/machine.py --only tcp-2,gap         # the goals whose id contains tcp-2 or gap
    python bench/machine.py --quick --out /tmp/m     # a smoke run: tiny iterations, one run
    python bench/machine.py --grid a.json b.json     # measures nothing: the rows of these
                                                     # collectives.py --algorithm all runs over 1.10x
    python bench/machine.py --grid a.json --table    # ... as this checkout's table would choose

It measures nothing itself: it runs bench/collectives.py and bench/trainer.py as subprocesses and
reads their JSON. The layouts are those the machine allows: 2 ranks; 4 ranks, a core each where
there are 4 cores, else sharing them; 8 ranks where there are 8 cores; the GPT at 1 and 2 ranks
(and 4 with a core each); the default grid's algorithm choice (``collectives.py --algorithm all``)
at 2 and 4 ranks; the device all_reduce where nvidia-smi lists a GPU. The goals per layout are
in bench/_machine.py (plan_goals). A peer that is missing (torch, mpirun or mpi4py, a GPU) skips
the goals that need it, with the reason in the table; what runs without it still runs.

Rounds: every job once (the grid last), then again, ``--runs`` times, so a goal's runs are minutes
apart and a slow spell of the machine lands on one run of each rather than on all runs of one.
A goal's figure is the median over its runs.

Budget: before each job the remaining jobs are planned to fit the time left (bench/_machine.py
estimates each from its iterations; the estimates are scaled by measured / estimated time of the
jobs so far, by 1.5 before the first): the grid's iterations shrink first, then every job's, down
to the fewest that still give a median (3-5 iterations). A job that cannot fit even so is not run,
and one still running at the budget or at 4x its estimate (a hang) is stopped (SIGTERM to its
process group, SIGKILL 10 s later); the file says which.

Output: ``--out`` (default bench/results; with ``--quick`` bench/out) gets machine-<key>.md, the key
a slug of cores, memory, CPU model and GPU: the command, the machine, the date, the load average
before and after, one table (goal, layout, median, its timing with the other timing's median beside
it, each run, the goal, met or not), the grid's rows over 10%, what was not run, and every job's
command. Timing: the goals against peers are judged on bench/collectives.py's ``call`` time (the
slowest rank's own t1 - t0, as they were set), the grid on ``last`` (max t1 - max t0 over the
ranks: by call, the barrier's order of release decides the small rows), its algorithms in a new
order each round (``--shuffle``: in one order, a variant can be timed mostly in one release order).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Run as a script, bench/ is sys.path[0] and bench/collectives.py would shadow the package
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (HERE, ROOT)]

from bench._machine import (OTHER, TIMED, Goal, Job, _grid_details, describe, find_peers, missing,  # noqa: E402
                            plan_goals)

SAFETY = 0.9          # plan to this share of the time left
STOP_GRACE_S = 10.0   # SIGTERM to SIGKILL
GRID_WEIGHT = 0.25    # the grid's iterations shrink four times sooner than the goals'
K_FIRST = 1.5         # measured / estimated time before any job has run: plan the first round on the safe side
HANG_FACTOR, HANG_MIN_S = 4.0, 60.0  # a job past both is stopped, so that one hang does not take the budget
VERDICTS = ("met", "not met", "skipped: ", "not run: ", "not measured: ")
PEER_NAMES = {"torch": "Gloo and torch DDP / FSDP2", "mpi": "OpenMPI", "gpu": "GPU"}


@dataclass
class Record:
    """One run of one job: what ran and what came of it."""
    job: Job
    round: int
    state: str = "pending"   # "ok" | "failed" | "stopped" | "skipped"
    why: str = ""
    params: dict = field(default_factory=dict)
    cmd: list = field(default_factory=list)
    estimate_s: float = 0.0
    elapsed_s: float = 0.0
    data: dict | None = None


# --- planning ----------------------------------------------------------------------------------

def fit(pending: list[tuple[Job, float]], left_s: float, k: float, cores: int, quick: bool) -> float:
    """The largest f such that every pending (job, weight) at scale min(1, weight x f) fits
    SAFETY x ``left_s`` with estimates times ``k``; 0 where not even the fewest iterations fit."""
    def total(f):
        return sum(k * job.cost(job.params(min(1.0, w * f), quick), cores) for job, w in pending)
    room = SAFETY * left_s
    hi = 1.0 / min(w for _, w in pending)
    if total(hi) <= room:
        return hi
    if total(0.0) > room:
        return 0.0
    lo = 0.0
    for _ in range(24):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= room else (lo, mid)
    return lo


def schedule(jobs: list[Job], runs: int) -> list[tuple[Job, int, float]]:
    """(job, round, weight): every job once per round, the grid after the goals' jobs."""
    order = sorted(jobs, key=lambda j: j.kind == "grid")
    return [(j, r, GRID_WEIGHT if j.kind == "grid" else 1.0) for r in range(1, runs + 1) for j in order]


# --- running -----------------------------------------------------------------------------------

def child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the job's process group (the launcher and mpirun stop their ranks), SIGKILL later."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def execute(rec: Record, log_path: str, timeout_s: float, why_limit: str) -> None:
    """Runs ``rec.cmd`` in its own process group with its output in ``log_path``, for at most
    ``timeout_s`` (``why_limit`` says what that limit is); fills in state, why and elapsed."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(rec.cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            stop(proc)
            rec.state, rec.why = "stopped", f"stopped after {time.monotonic() - t0:.0f} s, {why_limit}"
            rc = None
        except BaseException:  # Ctrl-C: the job goes with us
            stop(proc)
            raise
    rec.elapsed_s = time.monotonic() - t0
    if rc is not None:
        rec.state = "ok" if rc == 0 else "failed"
        if rc != 0:
            with open(log_path, errors="replace") as f:
                lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
            failed = [ln for ln in lines if "FAILED" in ln]  # bench/trainer.py's row of the configuration that failed
            rec.why = f"exit {rc}: " + " / ".join(failed or lines[-2:])[-300:]


def run_all(plan: list[tuple[Job, int, float]], budget_s: float, cores: int, quick: bool, tmp: str,
            say=print) -> list[Record]:
    """Runs the plan within ``budget_s``; a Record for every entry, run or not."""
    deadline = time.monotonic() + budget_s
    records = [Record(job, rnd) for job, rnd, _ in plan]
    spent = estimated = 0.0
    try:
        for i, ((job, rnd, weight), rec) in enumerate(zip(plan, records)):
            left = deadline - time.monotonic()
            k = min(5.0, max(0.3, spent / estimated)) if estimated else K_FIRST
            f = fit([(j, w) for j, _, w in plan[i:]], left, k, cores, quick)
            rec.params = job.params(min(1.0, weight * f), quick)
            rec.estimate_s = job.cost(rec.params, cores)
            out = os.path.join(tmp, f"{job.name}-{rnd}.json")
            rec.cmd = job.argv(rec.params, out)
            if k * rec.estimate_s > left:
                rec.state = "skipped"
                rec.why = f"would take about {k * rec.estimate_s:.0f} s, {max(0.0, left):.0f} s of the budget left"
                say(f"# {job.name} run {rnd}: not run ({rec.why})")
                continue
            say(f"# {job.name} run {rnd}: {_params(rec.params)} (about {k * rec.estimate_s:.0f} s; "
                f"{left:.0f} s left)", flush=True)
            # at the budget (3 s to stop it), or at HANG_FACTOR x its estimate: a hung job leaves the rest their time
            hang_s = max(HANG_MIN_S, HANG_FACTOR * k * rec.estimate_s)
            limit, why_limit = ((left - 3.0, "at the budget") if left - 3.0 <= hang_s else
                                (hang_s, f"{HANG_FACTOR:.0f}x its estimate (a hang?)"))
            execute(rec, os.path.join(tmp, f"{job.name}-{rnd}.log"), limit, why_limit)
            spent, estimated = spent + rec.elapsed_s, estimated + rec.estimate_s
            if os.path.exists(out):  # a trainer run that failed in one configuration still wrote the rest
                try:
                    rec.data = job.load(out)
                except (OSError, ValueError) as e:
                    rec.state, rec.why = "failed", f"unreadable output ({e})"
            elif rec.state == "ok":
                rec.state, rec.why = "failed", "exited 0 without writing its JSON"
            say(f"#   {rec.state} in {rec.elapsed_s:.1f} s" + (f": {rec.why}" if rec.why else ""), flush=True)
    except KeyboardInterrupt:
        for rec in records:
            if rec.state == "pending":
                rec.state, rec.why = "skipped", "interrupted (Ctrl-C)"
        say("# interrupted: writing what was measured")
    return records


def dry_run(plan: list[tuple[Job, int, float]], budget_s: float, cores: int, quick: bool) -> None:
    """Prints what would run: each job's iterations and estimate at the plan's scale, and the full scale's total."""
    if not plan:
        print("# nothing to run")
        return
    f = fit([(j, w) for j, _, w in plan], budget_s, 1.0, cores, quick)
    full = sum(j.cost(j.params(1.0, quick), cores) for j, _, _ in plan)
    total = 0.0
    for job, rnd, w in plan:
        p = job.params(min(1.0, w * f), quick)
        total += job.cost(p, cores)
        print(f"{job.name:>10} run {rnd}: {_params(p):<40} about {job.cost(p, cores):6.1f} s")
    print(f"# planned {total:.0f} s of {budget_s:.0f} (at full iterations {full:.0f} s); scale {f:.2f}")
    if total > SAFETY * budget_s:
        print(f"# more than {SAFETY:.0%} of the budget at the fewest iterations: the last runs will not fit "
              "(--budget gives more)")


def _params(p: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in p.items() if k != "quick") + (" (quick)" if p.get("quick") else "")


# --- the report --------------------------------------------------------------------------------

def _reading(read, data: dict) -> float | None:
    """A goal's figure from one run's JSON (``read``: Goal.read or Goal.other), None where the run
    lacks it."""
    try:
        return read(data)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def verdict(goal: Goal, records: list[Record], why_not: str | None, runs: int) -> tuple[str, str, str]:
    """(median, each run, verdict) of one goal row."""
    if why_not:
        return "-", "-", f"skipped: {why_not}"
    mine = [r for r in records if r.job.name == goal.job]
    ran = [r for r in mine if r.data is not None]
    if not ran:
        reasons = sorted({r.why for r in mine if r.why}) or ["no run"]
        state = "not run: " if all(r.state == "skipped" for r in mine) else "not measured: "
        return "-", "-", state + "; ".join(reasons)
    values, shown = [], []
    for r in ran:
        v = _reading(goal.read, r.data)
        extra = goal.beside(r.data) if goal.beside and v is not None else None
        shown.append(goal.show(v) + (f" ({extra})" if extra else ""))
        if v is not None:
            values.append(v)
    if not values:
        return "-", ", ".join(shown), "not measured: the row is missing from every run's output"
    med = statistics.median(values)
    note = f" ({len(values)} of {runs} runs)" if len(values) < runs else ""
    return goal.show(med), ", ".join(shown), ("met" if goal.met(med) else "not met") + note


def timing_cell(goal: Goal, records: list[Record], why_not: str | None) -> str:
    """The timing a goal is judged by and, beside it, the median of its runs by the other timing:
    e.g. ``last (call 2.31x)``; the timing alone for a goal not measured here; ``-`` for a figure
    that is no collective's time."""
    if not goal.timing or why_not:
        return goal.timing or "-"
    values = [v for r in records if r.job.name == goal.job and r.data is not None
              for v in [_reading(goal.other, r.data)] if v is not None]
    other = goal.show(statistics.median(values)) if values else "-"
    return f"{goal.timing} ({OTHER[goal.timing]} {other})"


def _shown_cmd(cmd: list[str]) -> str:
    out = []
    for a in cmd:
        if a == sys.executable:
            a = "python"
        elif os.path.isabs(a) and a.startswith(ROOT + os.sep):
            a = os.path.relpath(a, ROOT)
        elif os.path.isabs(a):
            a = os.path.basename(a)
        out.append(a)
    return " ".join(shlex.quote(a) for a in out)


def _git() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "not a git checkout"
    return (head or "unknown") + (", with uncommitted changes" if dirty else "")


def report(meta: dict, goals: list[Goal], records: list[Record], why_not: dict[str, str | None], runs: int) -> str:
    m = meta["machine"]
    lines = [f"# ringweave's goals on {m.describe()}", "",
             "Written by bench/machine.py: each goal the median of its runs, every peer measured in the same run "
             "(bench/README.md).", "",
             f"## {m.key()}, {meta['date']}", "",
             f"- Command: `{meta['command']}` (every job's command: under Commands below)",
             f"- Machine: {m.describe()}; {platform.system()} {platform.release()}, Python "
             f"{platform.python_version()}",
             f"- Date: {meta['date']}, {meta['start']} - {meta['end']} UTC ({meta['used_s']:.0f} s of a "
             f"{meta['budget_s']:.0f} s budget)",
             f"- Load average (1 / 5 / 15 min): before {meta['load_before']}, after {meta['load_after']}",
             f"- Code: ringweave {meta['version']}, git {meta['git']}",
             "- Peers: " + "; ".join(f"{PEER_NAMES[name]}: {p.what}" for name, p in meta["peers"].items()),
             f"- Runs: {runs} per goal, the median shown; layouts: {', '.join(meta['layouts'])}"]
    if meta["quick"]:
        lines.append("- Quick run (`--quick`): the fewest iterations, to check the command runs; its figures decide "
                     "nothing")
    lines += ["", "| goal | layout | median | timing | runs | goal value | verdict |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    details = []
    for g in goals:
        med, each, result = verdict(g, records, why_not[g.id], runs)
        cells = [g.title, g.where, med, timing_cell(g, records, why_not[g.id]), each, f"{g.better} {g.show(g.target)}",
                 result]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        ran = [r.data for r in records if r.job.name == g.job and r.data is not None]
        if g.details and ran and not why_not[g.id]:
            details.append((g, g.details(ran)))
    if any(g.timing for g in goals):
        lines += ["", "Timing: bench/collectives.py records two times of each iteration, and the median above is of "
                  "the one named (the other's median in brackets): " + "; ".join(f"{t}, {TIMED[t]}" for t in OTHER)
                  + ". The goals against a peer are judged on call, as they were set; the grid on last, because by call "
                  "the order in which the barrier lets the ranks out decides a small row (a rank let out first is "
                  "charged its wait for the others)."]
    for g, text in details:
        lines += ["", f"### {g.title}, {g.where}", ""] + [f"- {t}" for t in text]
    skipped = [r for r in records if r.state in ("skipped", "stopped", "failed")]
    if skipped:
        lines += ["", "### Not run or not finished", ""]
        lines += [f"- {r.job.name} run {r.round}: " + ("not run: " if r.state == "skipped" else "") + r.why for r in skipped]
    lines += ["", "### Commands", ""]
    for r in records:
        if r.state != "skipped":
            lines.append(f"- {r.job.name} run {r.round} ({r.elapsed_s:.1f} s): `{_shown_cmd(r.cmd)}`")
    return "\n".join(lines) + "\n"


# --- command line ------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 480: 8 minutes)")
    p.add_argument("--runs", type=int, default=None, help="runs per goal, the median reported (default 3; --quick 1)")
    p.add_argument("--only", default="", help="comma list: the goals whose id contains one of these (default all)")
    p.add_argument("--quick", action="store_true", help="the fewest iterations and one run: a check that it runs")
    p.add_argument("--out", default=None, help="directory of the file (default bench/results; --quick: bench/out)")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="keep every job's JSON there (e.g. the grids, for --grid --table later); default: dropped")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (iterations and estimated seconds per job); run nothing")
    p.add_argument("--grid", nargs="+", metavar="JSON", default=None,
                   help="run nothing: read these --json files of `collectives.py --algorithm all` (one layout) and "
                        "print the (op, size) rows whose default algorithm's time over the fastest's, median over "
                        "the files, is above --target")
    p.add_argument("--target", type=float, default=1.10, help="with --grid: the ratio a row may reach (default 1.10)")
    p.add_argument("--timing", default="last", choices=sorted(TIMED),
                   help="with --grid: the rows' time, as the grid goal judges it (default last: " + TIMED["last"]
                        + "; call: " + TIMED["call"] + ", the only one of runs from before both were recorded)")
    p.add_argument("--table", action="store_true",
                   help="with --grid: each row's default is what this checkout's table chooses on one host with "
                        "shared memory on, not what the run marked (a table change judged on the same runs)")
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    if args.runs < 1 or args.budget <= 0:
        p.error("need --runs >= 1 and --budget > 0")
    args.only = [t.strip() for t in args.only.split(",") if t.strip()]
    args.out = args.out or os.path.join(HERE, "out" if args.quick else "results")
    return args


def grid(paths: list[str], target: float, table: bool = False, timing: str = "last") -> list[str]:
    """The grid goal's lines for these runs of one layout: how many (op, size) rows are within
    ``target`` by ``timing``, then each row over it, worst first. ``table``: the default of each
    row is re-marked as :func:`table_choice` says."""
    import json
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    if table:
        for d in runs:
            for r in d["rows"]:
                r["default"] = r["algorithm"] == table_choice(r)
    return _grid_details(target, timing)(runs)


# collectives.py's rows whose size is the whole output, not the block a rank passes to the table
_BLOCKED = ("all_gather", "gather", "scatter")


def table_choice(row: dict) -> str:
    """The algorithm this checkout's table (collectives/registry.py, rules files off) chooses for a
    row of collectives.py's JSON: its op, the bytes a rank passes, its world; one host, shared memory on."""
    from unittest import mock

    import numpy as np

    from collectives import registry
    from runtime import env
    nbytes = row["count"] * np.dtype(row["dtype"]).itemsize if row["op"] in _BLOCKED else row["bytes"]
    with mock.patch.dict(os.environ, {env.SHM.name: "1", env.TUNE.name: "0"}):  # restored after
        return registry.choose(row["op"], nbytes, row["world"])[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.grid:
        print("\n".join(grid(args.grid, args.target, args.table, args.timing)))
        return 0
    given = sys.argv[1:] if argv is None else argv
    command = "python bench/machine.py" + "".join(f" {shlex.quote(a)}" for a in given)
    started, load_before = time.time(), "%.2f %.2f %.2f" % os.getloadavg()
    machine = describe()
    peers = find_peers(machine)
    goals, jobs = plan_goals(machine, peers)
    why_not = {}
    for g in goals:
        chosen = not args.only or any(t in g.id for t in args.only)
        why_not[g.id] = missing(g, peers) if chosen else f"not selected (--only {','.join(args.only)})"
    for j in jobs.values():  # a peer only where a goal measured here needs it
        wanted = {need for g in goals if g.job == j.name and why_not[g.id] is None for need in g.needs}
        j.peers = [p for p in j.peers if p in wanted]
    needed = [j for j in jobs.values() if any(g.job == j.name and why_not[g.id] is None for g in goals)]
    plan = schedule(needed, args.runs)
    print(f"# {machine.describe()}; key {machine.key()}; load {load_before}")
    for name, peer in peers.items():
        print(f"# {name}: {peer.what}")
    print(f"# {len(needed)} jobs x {args.runs} runs within {args.budget:.0f} s", flush=True)
    if args.dry_run:
        dry_run(plan, args.budget, machine.cores, args.quick)
        return 0
    with tempfile.TemporaryDirectory(prefix="rw-machine-") as tmp:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
        records = run_all(plan, args.budget - (time.time() - started), machine.cores, args.quick, args.keep or tmp)
    ended = time.time()
    from collectives import tunefile
    layouts = sorted({g.where for g in goals if why_not[g.id] is None},
                     key=lambda s: int(s.split()[0]) if s[0].isdigit() else 99)
    meta = {"machine": machine, "peers": peers, "command": command, "quick": args.quick, "budget_s": args.budget,
            "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
            "start": time.strftime("%H:%M:%S", time.gmtime(started)),
            "end": time.strftime("%H:%M:%S", time.gmtime(ended)), "used_s": ended - started,
            "load_before": load_before, "load_after": "%.2f %.2f %.2f" % os.getloadavg(),
            "version": tunefile.library_version(), "git": _git(), "layouts": layouts}
    text = report(meta, goals, records, why_not, args.runs)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.abspath(os.path.join(args.out, f"machine-{machine.key()}.md"))
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    print("\n".join(table))
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
