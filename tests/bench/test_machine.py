"""bench/machine.py: one file keyed by the machine, every goal row measured or skipped with a reason,
the plan shrinking the grid before the goals, the median over runs. No speed is asserted."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "machine.py"
sys.path.insert(0, str(ROOT))
from bench import _machine, machine  # noqa: E402

REASONED = machine.VERDICTS[2:]  # a verdict that is no figure gives its reason


def run_machine(tmp_path, *args, timeout_s=120):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and re.fullmatch(r"machine-c\d+-m\d+g-[a-z0-9-]+\.md", files[0].name), files
    assert files[0].name == f"machine-{_machine.describe().key()}.md"
    return proc.stdout, files[0].read_text()


def rows_of(text: str) -> dict[str, list[str]]:
    """The table's rows by goal and layout: [median, runs, goal, verdict] (the timing cell checked)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| goal | layout | median | timing | runs | goal value | verdict |"
    assert lines[1].startswith("| --- |")
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split(" | ")]
        assert len(cells) == 7, ln
        assert re.fullmatch(r"-|call|last|(call \(last|last \(call) (-|[\d.]+( us|x))\)", cells[3]), ln
        rows[f"{cells[0]} / {cells[1]}"] = cells[2:3] + cells[4:]
    return rows


def check_entry(text: str) -> None:
    """One entry as bench/results wants it (tests/tree): a heading with command, machine and date."""
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) == 1
    for field in (r"^- Command: `python bench/machine.py [^`]*`", r"^- Machine: \d+ cores, \d+ GiB, ",
                  r"^- Date: 20\d\d-\d\d-\d\d", r"^- Load average \(1 / 5 / 15 min\): before [\d.]+ [\d.]+ [\d.]+, "
                  r"after [\d.]+ [\d.]+ [\d.]+$"):
        assert re.search(field, sections[0], re.M), field


def accounted(rows: dict[str, list[str]]) -> None:
    for goal, (median, runs, target, verdict) in rows.items():
        assert re.fullmatch(r"(>=|<=) [\d.]+( us| ms|x)", target), (goal, target)
        if verdict.startswith(("met", "not met")):
            assert median != "-" and runs != "-", goal
        else:
            assert verdict.startswith(REASONED) and len(verdict.split(": ", 1)[1]) > 5, (goal, verdict)


@pytest.mark.timeout(180)
def test_a_quick_run_measures_what_it_selects_and_gives_a_reason_for_the_rest(tmp_path):
    """The TCP loop gap alone: its job runs without Gloo (no goal selected needs it)."""
    stdout, text = run_machine(tmp_path, "--quick", "--only", "gap-tcp")
    check_entry(text)
    assert "- Quick run (`--quick`)" in text
    rows = rows_of(text)
    accounted(rows)
    gap = "largest loop gap during TCP all_reduce 64 MiB, beyond nothing running / " + \
        _machine.layout(2, _machine.describe().cores)
    median, runs, target, verdict = rows.pop(gap)
    assert verdict in ("met", "not met") and target == "<= 5.0 ms", (median, runs, verdict)
    assert re.fullmatch(r"-?[\d.]+ ms \(gap [\d.]+ ms, idle [\d.]+ ms\)", runs), runs
    assert rows and all(r[3] == "skipped: not selected (--only gap-tcp)" for r in rows.values()), rows
    [command] = re.findall(r"^- tcp-2 run 1 \([\d.]+ s\): `(.*)`$", text, re.M)
    assert command.startswith("python bench/collectives.py -n 2 ") and "--shm off" in command
    assert "--compare" not in command and re.search(r"--sizes \S*67108864", command), command
    assert "# wrote " in stdout


@pytest.mark.timeout(60)
def test_a_budget_too_small_runs_nothing_and_says_what_it_did_not_run(tmp_path):
    _, text = run_machine(tmp_path, "--budget", "1", "--only", "tcp,shm,gpt-1")
    check_entry(text)
    rows = rows_of(text)
    accounted(rows)
    assert not [g for g, r in rows.items() if r[3].startswith(("met", "not met"))]
    assert any(r[3].startswith("not run: would take about") for r in rows.values())
    assert "### Not run or not finished" in text and "tcp-2 run 3: not run: would take about" in text


def fake_machine(cores=2):
    return _machine.Machine("AMD EPYC 9B14 96-Core Processor", cores, 24, [])


def everything(m):
    peers = {k: _machine.Peer(True, k) for k in ("torch", "mpi", "gpu")}
    return _machine.plan_goals(m, peers)


def test_the_key_is_a_slug_of_cores_memory_cpu_and_gpu():
    assert fake_machine().key() == "c2-m24g-amd-epyc-9b14-nogpu"
    m = _machine.Machine("Intel(R) Xeon(R) Platinum 8480C", 16, 128, ["NVIDIA H100 80GB HBM3"] * 2)
    assert m.key() == "c16-m128g-intel-xeon-platinum-8480c-2xh100-80gb"
    assert _machine.cpu_slug("Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz") == "intel-core-i7-8700"


def test_the_layouts_follow_the_cores():
    two, _ = everything(fake_machine(2))
    where = {g.where for g in two}
    assert {"2 ranks, a core each", "4 ranks on 2 cores", "1 rank"} <= where and not any("8 ranks" in w for w in where)
    assert {g.id for g in two if g.where == "4 ranks on 2 cores"} >= {"tcp-4-4B", "tcp-4-64MiB", "shm-4-1MiB-mpi",
                                                                      "grid-4"}
    sixteen, _ = everything(fake_machine(16))
    ids = {g.id for g in sixteen}
    assert {"tcp-8-1MiB", "shm-8-4B-mpi", "shm-8-barrier-mpi", "gpt-4-ddp", "tcp-4-16MiB"} <= ids
    assert {g.where for g in sixteen if g.id.startswith("tcp-4")} == {"4 ranks, a core each"}


def test_the_plan_shrinks_the_grid_before_the_goals():
    m = fake_machine(2)
    _, jobs = everything(m)
    plan = machine.schedule(list(jobs.values()), 3)
    pending = [(j, w) for j, _, w in plan]
    goal_jobs = [j for j, _, _ in plan if j.kind != "grid"]
    grids = [j for j, _, _ in plan if j.kind == "grid"]
    full = {j.name: j.params(1.0, False) for j in jobs.values()}
    assert machine.fit(pending, 1e9, 1.0, m.cores, False) == 1 / machine.GRID_WEIGHT  # everything at full
    assert machine.fit(pending, 1.0, 1.0, m.cores, False) == 0.0                      # nothing fits
    # room for the goals at full and the grid at its share of that scale, and a little more
    room = (sum(j.cost(full[j.name], m.cores) for j in goal_jobs)
            + sum(j.cost(j.params(machine.GRID_WEIGHT, False), m.cores) for j in grids)) * 1.05 / machine.SAFETY
    f = machine.fit(pending, room, 1.0, m.cores, False)
    assert 1.0 <= f < 1 / machine.GRID_WEIGHT
    assert all(j.params(min(1.0, f), False) == full[j.name] for j in goal_jobs)
    assert all(j.params(machine.GRID_WEIGHT * f, False)["iters"] < full[j.name]["iters"] for j in grids)
    assert [j.kind for j, r, _ in plan if r == 1][-2:] == ["grid", "grid"]  # the grid after the goals, each round


def test_a_goal_is_the_median_of_its_runs():
    job = _machine.Job("j", "collectives", 2, {})
    goal = _machine.Goal("g", "g", "2 ranks", "j", ">=", 1.5, "x", lambda d: d["v"])
    records = [machine.Record(job, r, state="ok", data={"v": v}) for r, v in ((1, 1.2), (2, 1.6), (3, 1.7))]
    assert machine.verdict(goal, records, None, 3) == ("1.60x", "1.20x, 1.60x, 1.70x", "met")
    records[1].data, records[1].state, records[1].why = None, "stopped", "stopped at the budget after 9 s"
    assert machine.verdict(goal, records, None, 3) == ("1.45x", "1.20x, 1.70x", "not met (2 of 3 runs)")
    for r in records:
        r.data, r.state, r.why = None, "skipped", "would take about 9 s, 2 s of the budget left"
    assert machine.verdict(goal, records, None, 3)[2] == "not run: would take about 9 s, 2 s of the budget left"
    assert machine.verdict(goal, records, "torch is not installed", 3)[2] == "skipped: torch is not installed"


def test_each_job_compares_with_the_peers_its_goals_need_where_they_are():
    m = fake_machine(2)
    _, jobs = everything(m)
    out = "/tmp/x.json"
    tcp, shm, shm4 = (jobs[name].argv(jobs[name].params(1.0, False), out) for name in ("tcp-2", "shm-2", "shm-4"))
    assert tcp[tcp.index("--compare") + 1] == "gloo" and "--no-ticker" not in tcp
    assert tcp[tcp.index("--iters") + 1] == "20"
    assert shm[shm.index("--compare") + 1] == "mpi" and "--no-ticker" in shm and "--shm" in shm
    assert shm4[shm4.index("--sizes") + 1] == "1048576" and shm4[shm4.index("-n") + 1] == "4"
    nothing = {k: _machine.Peer(False, f"no {k}") for k in ("torch", "mpi", "gpu")}
    goals, jobs = _machine.plan_goals(m, nothing)
    assert all(not j.peers for j in jobs.values())
    assert _machine.missing(next(g for g in goals if g.id == "tcp-2-64MiB"), nothing) == "no torch"
    assert _machine.missing(next(g for g in goals if g.id == "gap-tcp-2"), nothing) is None
    grid = jobs["grid-2"].argv(jobs["grid-2"].params(1.0, False), out)
    assert grid[grid.index("--algorithm") + 1] == "all" and "--shuffle" in grid and "--timing" not in grid
    gpt = jobs["gpt-2"].argv(jobs["gpt-2"].params(0.0, False), out)
    assert gpt[gpt.index("--steps") + 1] == "3" and gpt[gpt.index("--ranks") + 1] == "2" and "--compare" in gpt


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"  # a zombie has ended
    except FileNotFoundError:
        return True


def test_a_job_past_its_limit_is_stopped_with_its_process_group(tmp_path):
    spawn = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "print(p.pid, flush=True); time.sleep(60)")
    rec = machine.Record(_machine.Job("j", "collectives", 2, {}), 1, cmd=[sys.executable, "-c", spawn])
    machine.execute(rec, str(tmp_path / "log"), 2.0, "at the budget")
    assert rec.state == "stopped" and re.fullmatch(r"stopped after \d s, at the budget", rec.why), rec.why
    assert 2.0 <= rec.elapsed_s < 2.0 + machine.STOP_GRACE_S
    child = int((tmp_path / "log").read_text().split()[0])
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), "the job's own child outlived it"


def test_a_job_that_fails_is_reported_with_its_last_lines(tmp_path):
    rec = machine.Record(_machine.Job("j", "collectives", 2, {}), 1,
                         cmd=[sys.executable, "-c", "import sys; print('a\\nb'); sys.exit('--compare mpi: no mpirun')"])
    machine.execute(rec, str(tmp_path / "log"), 30.0, "at the budget")
    assert (rec.state, rec.why) == ("failed", "exit 1: b / --compare mpi: no mpirun")
    goal = _machine.Goal("g", "g", "2 ranks", "j", ">=", 1.0, "x", lambda d: d["v"])
    assert machine.verdict(goal, [rec], None, 3)[2] == "not measured: exit 1: b / --compare mpi: no mpirun"


def test_a_trainer_job_that_fails_names_the_configuration_that_failed(tmp_path):
    # bench/trainer.py prints one row per configuration, the failed one "FAILED (exit N)", then goes on
    rows = ("       ddp     2   27248.6", " torch-ddp     2  FAILED (exit 134)  (load 1.7)",
            "torch-fsdp     2   17162.3", "", "wrote out.json")
    code = f"import sys; print({chr(10).join(rows)!r}); sys.exit(1)"
    rec = machine.Record(_machine.Job("j", "trainer", 2, {}), 1, cmd=[sys.executable, "-c", code])
    machine.execute(rec, str(tmp_path / "log"), 30.0, "at the budget")
    assert (rec.state, rec.why) == ("failed", "exit 1: torch-ddp     2  FAILED (exit 134)  (load 1.7)")
