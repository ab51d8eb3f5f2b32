"""Any launcher job across emulated machines: one network namespace per host, tc on every link.

    sudo python bench/netem.py -n 4 --rate 1gbit -- --ops broadcast --algorithm all --sizes 64K,1M,16M --iters 5
    sudo python bench/netem.py -n 2 --per-node 2 --shm on -- --ops all_reduce --algorithm all --sizes 1M,16M
    sudo python bench/netem.py -n 2 -- --compare gloo,mpi --mpi-btl tcp --ops all_reduce --sizes 4,1M,16M
    sudo python bench/netem.py -n 2 --per-node 2 --rate 100mbit --delay 1ms --loss 0.1% -- -m trainer --epochs 1
    sudo python bench/netem.py -n 2 --rate 1gbit,100mbit -- bench/compression.py --steps 20
    sudo python bench/netem.py --cleanup        # what a run killed with SIGKILL left behind

Loopback on one box is bound by the CPU of the kernel's copies, so it cannot show what a
network-bound job sees: there, moving fewer bytes over the busiest link matters more than
the number of copies. This builds that network and runs a job on it:

* n namespaces ``rwnetem-<pid>-<i>`` (pid: this process's), each with its own host name
  (``unshare --uts``: the runtime tells machines apart by name, so no two hosts share memory) and
  one veth ``rwe<pid>o<i>`` into a bridge ``rwe<pid>b`` in the root namespace (10.<a>.<b>.<i+1>/24);
* every link shaped in both directions with ``tc``: a token bucket at the link's ``--rate``
  behind ``--delay`` and ``--loss`` (when given) on the namespace's end (its sends) and on the
  bridge's end (its receives), so one hop between hosts is twice the delay. Each of the three is
  one value for every link or a comma list with one per host (the link of host i). The delay and
  loss are netem's qdisc where the kernel has sch_netem; else (``--delay-by``) a delay line in
  user space, bench/_delayline.py: iptables' NFQUEUE on the host's link (sends and receives) in
  each namespace, whose verdicts it holds. The run's label names which one ran (``by netem``,
  ``by nfqueue``);
* the job after ``--``: a script path or ``-m module`` with its arguments (the trainer,
  bench/trainer.py, bench/compression.py, ...), or, when the arguments start with an option,
  bench/collectives.py with them. In each namespace ``python -m runtime.launch -n K --nnodes n
  --node-rank i`` starts it, K = ``--per-node`` ranks per host (default 1), which reach each other
  over the namespace's loopback, or over shared memory with ``--shm on`` (default off: TCP only,
  RINGWEAVE_SHM=0). Node 0's output is printed, the others' when they fail.
* bench/collectives.py with ``--compare ...mpi``: one mpirun in namespace 0 instead, which starts
  its daemons in the other namespaces through a small agent script in place of ssh
  (plm_rsh_agent: ``ip netns exec``), with MPI's tcp on the namespaces' subnet; Gloo's store is
  on rank 0's address either way, so every row has its peers between hosts.

Clean-up: whatever happens (the job ends or fails, a set-up command fails, SIGTERM, SIGINT, SIGHUP,
``--max-time-s`` passed), every process in the namespaces is stopped (SIGTERM, then SIGKILL) and
every namespace and link of this run is deleted, found by name, so the clean-up can run twice.
SIGKILL cannot be caught: ``--cleanup`` removes what such runs left, only names of this tool's
pattern whose pid is no longer a running netem.py. The delay lines and their iptables rules live in
the namespaces and go with them. Needs root, ``ip`` (iproute2), ``tc`` and ``unshare`` (and
``iptables`` for the delay line). Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETUP_TIMEOUT_S = 60  # one ip / tc command (each takes milliseconds)
STOP_GRACE_S = 5      # from SIGTERM to SIGKILL for what runs in the namespaces
NS_PREFIX, LINK_PREFIX = "rwnetem-", "rwe"  # rwnetem-<pid>-<i>; rwe<pid>b, rwe<pid>i<i>, rwe<pid>o<i> (<= 15 chars)
NS_NAME = re.compile(r"^rwnetem-(\d+)-\d+$")
LINK_NAME = re.compile(r"^rwe(\d+)[bio]\d*$")


class Stopped(SystemExit):
    """A signal asked this run to stop; the exit status is 128 + the signal's number."""


def sh(*cmd: str) -> None:
    """Runs a set-up command; a failure stops the run with the command and its error."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"netem: `{' '.join(cmd)}` had not finished after {SETUP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise SystemExit(f"netem: `{' '.join(cmd)}` failed: {done.stderr.strip()}")


def out(*cmd: str) -> str:
    """The output of a query (ip netns list, ip link, ...); empty when it fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S).stdout
    except (subprocess.TimeoutExpired, OSError):
        return ""


def why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (ip netns add, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` on PATH (iproute2, util-linux)"
    return None


def shape(ns: str | None, dev: str, rate: str, delay: str | None, loss: str | None) -> None:
    """A token bucket at ``rate`` on ``dev``'s sends (inside ``ns`` when given), behind netem's
    delay and loss (none: the delay line's, or nothing)."""
    where = ["ip", "netns", "exec", ns] if ns else []
    tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    if delay or loss:
        em = (["delay", delay] if delay else []) + (["loss", loss] if loss else [])
        sh(*where, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", *em)
        sh(*where, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
    else:
        sh(*where, "tc", "qdisc", "add", "dev", dev, "root", *tbf)


def namespaces(owner: int) -> list[str]:
    return [ns for ns in (line.split()[0] for line in out("ip", "netns", "list").splitlines() if line.split())
            if (m := NS_NAME.match(ns)) and int(m.group(1)) == owner]


def links(owner: int) -> list[str]:
    names = [line.split(":")[1].strip().split("@")[0] for line in out("ip", "-o", "link").splitlines()
             if line.count(":") >= 2]
    return [name for name in names if (m := LINK_NAME.match(name)) and int(m.group(1)) == owner]


def has_netem(ns: str) -> bool:
    """Whether the kernel has netem's qdisc (tried on ``ns``'s loopback, then removed)."""
    try:
        tried = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                                "1us"], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"netem: `tc qdisc add ... netem` had not finished after {SETUP_TIMEOUT_S} s") from None
    out("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root")
    return tried.returncode == 0


def delay_mechanism(choice: str, ns: str) -> str:
    """``netem`` or ``nfqueue``: --delay-by's choice, ``auto`` netem's qdisc where the kernel has it."""
    if choice == "auto":
        choice = "netem" if has_netem(ns) else "nfqueue"
    if choice == "nfqueue" and shutil.which("iptables") is None:
        raise SystemExit("netem: this kernel has no sch_netem, and the delay line needs `iptables` "
                         "(apt-get install iptables)")
    return choice


class Delays:
    """How run's delay and loss are made: ``by`` (``auto`` until the first namespace settles it:
    ``netem`` or ``nfqueue``) and the delay lines started (their processes, reaped by clean())."""

    def __init__(self, by: str = "auto", log=None):
        self.by, self.log, self.lines = by, log, []


def build(owner: int, subnet: str, rates: list[str], delays: list, losses: list,
          how: Delays | None = None) -> list[str]:
    """The namespaces, bridge and shaped links of run ``owner``; teardown(owner) removes them.
    With ``how.by`` ``nfqueue``, a delay line runs in each namespace with a delay or loss."""
    how = how or Delays()
    bridge = f"{LINK_PREFIX}{owner}b"
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "link", "set", bridge, "up")
    names = []
    for i, (rate, delay, loss) in enumerate(zip(rates, delays, losses)):
        ns, inner, outer = f"{NS_PREFIX}{owner}-{i}", f"{LINK_PREFIX}{owner}i{i}", f"{LINK_PREFIX}{owner}o{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "link", "set", outer, "master", bridge)
        sh("ip", "link", "set", outer, "up")
        sh("ip", "-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", inner)
        sh("ip", "-n", ns, "link", "set", inner, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        names.append(ns)
        if i == 0 and how.by != "netem" and any(delays + losses):
            how.by = delay_mechanism(how.by, ns)
        queued = how.by == "nfqueue" and bool(delay or loss)
        em = (None, None) if queued else (delay, loss)
        shape(ns, inner, rate, *em)   # what host i sends
        shape(None, outer, rate, *em)  # what host i receives
        if queued:
            sys.path.insert(0, ROOT)
            from bench import _delayline
            _delayline.start(ns, inner, delay, loss, SETUP_TIMEOUT_S, how.log, how.lines)
    return names


def stop_processes(names: list[str]) -> None:
    """SIGTERM to every process in the namespaces, SIGKILL to those left after STOP_GRACE_S."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        pids = [int(p) for ns in names for p in out("ip", "netns", "pids", ns).split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            if not any(out("ip", "netns", "pids", ns).split() for ns in names):
                return
            time.sleep(0.05)


def teardown(owner: int) -> list[str]:
    """Stops the processes of run ``owner``'s namespaces, deletes them and its links (by name:
    running it again finds nothing more to do). Returns what could not be deleted."""
    names = namespaces(owner)
    stop_processes(names)
    for ns in names:
        out("ip", "netns", "del", ns)   # deletes the veth ends inside, and with them their peers
    for link in links(owner):           # the bridge, and veths of a run stopped halfway through its set-up
        out("ip", "link", "del", link)
    return namespaces(owner) + links(owner)


def alive_netem(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"netem" in f.read()
    except OSError:
        return False


def cleanup_leftovers() -> int:
    """Tears down every run whose names are in this tool's pattern and whose netem.py is gone."""
    owners = {int(m.group(1)) for ns in out("ip", "netns", "list").split() if (m := NS_NAME.match(ns))}
    owners |= {int(m.group(1)) for line in out("ip", "-o", "link").splitlines() if line.count(":") >= 2
               if (m := LINK_NAME.match(line.split(":")[1].strip().split("@")[0]))}
    left = []
    for owner in sorted(owners):
        if alive_netem(owner):
            print(f"netem: run {owner} is still running; its namespaces stay")
            continue
        left += teardown(owner)
        print(f"netem: removed what run {owner} left")
    if left:
        print(f"netem: could not delete {left}", file=sys.stderr)
    return 1 if left else 0


def on_signal(signum, frame) -> None:
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # one clean-up: later signals wait for it
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(128 + signum)


def per_host(value: str | None, n: int, what: str) -> list:
    """One value per host from ``a`` (every link) or ``a,b,...`` (n values, host i's link)."""
    if value is None:
        return [None] * n
    values = value.split(",")
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise SystemExit(f"netem: {what} {value!r} has {len(values)} values for {n} hosts; give 1 or {n}")
    return values


def job_command(job: list[str], args) -> tuple[list[str], bool]:
    """The launcher's target and arguments, and whether it is bench/collectives.py."""
    if not job or (job[0].startswith("-") and job[0] != "-m"):
        return [os.path.join(HERE, "collectives.py"), *job, "--shm", args.shm], True
    return job, os.path.basename(job[0]) == "collectives.py"


def compares_mpi(job: list[str]) -> bool:
    for i, a in enumerate(job):
        value = job[i + 1] if a == "--compare" and i + 1 < len(job) else a[len("--compare="):] \
            if a.startswith("--compare=") else None
        if value is not None and "mpi" in value.split(","):
            return True
    return False


AGENT = """#!/bin/sh
# Open MPI's launch agent in place of ssh: AGENT [options] HOST COMMAND..., run in HOST's namespace
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
%s
*) echo "netem agent: unknown host $host" >&2; exit 1;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $name && $*"
"""


def mpirun_job(job: list[str], args, names: list[str], subnet: str, label: str, agent_dir: str) -> list[str]:
    """One mpirun of bench/collectives.py for every namespace (see bench/collectives.py mpirun_command)."""
    sys.path.insert(0, ROOT)
    from bench.collectives import mpirun_command
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("netem: --compare mpi needs mpirun (apt-get install openmpi-bin)")
    try:
        import mpi4py  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"netem: --compare mpi needs mpi4py ({e}); pip install mpi4py") from None
    cases = "\n".join(f"{subnet}.{i + 1}) ns={ns}; name=rw-netem-{i};;" for i, ns in enumerate(names))
    agent = os.path.join(agent_dir, "agent.sh")
    with open(agent, "w") as f:
        f.write(AGENT % cases)
    os.chmod(agent, 0o755)
    btl = "tcp"
    for i, a in enumerate(job):
        if a == "--mpi-btl" and i + 1 < len(job):
            btl = job[i + 1]
        elif a.startswith("--mpi-btl="):
            btl = a.split("=", 1)[1]
    return mpirun_command(mpirun, args.nproc * args.per_node, btl, job[1:], master_addr=f"{subnet}.1",
                          master_port=random.randrange(20000, 30000),
                          hosts=[f"{subnet}.{i + 1}:{args.per_node}" for i in range(args.nproc)], agent=agent,
                          subnet=f"{subnet}.0/24", timeout_s=args.max_time_s, label=label)


def run(args, job: list[str]) -> int:
    owner = os.getpid()
    subnet = f"10.{random.randrange(100, 200)}.{random.randrange(1, 250)}"
    master, port = f"{subnet}.1", str(random.randrange(20000, 30000))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RINGWEAVE_SHM="1" if args.shm == "on" else "0", RINGWEAVE_SECRET="netem-" + os.urandom(8).hex())
    rates, delays, losses = (per_host(args.rate, args.nproc, "--rate"), per_host(args.delay, args.nproc, "--delay"),
                             per_host(args.loss, args.nproc, "--loss"))
    target, is_bench = job_command(job, args)
    procs, logs = [], []  # every node but 0 writes into a file (a pipe nobody reads while we wait could fill and stall it)
    scratch = tempfile.TemporaryDirectory(prefix="rwnetem")
    how = Delays(args.delay_by, tempfile.TemporaryFile("w+", dir=scratch.name))  # the delay lines' errors
    try:
        names = build(owner, subnet, rates, delays, losses, how)
        label = (f"netem {args.nproc} namespaces" + (f" x {args.per_node} ranks" if args.per_node > 1 else "")
                 + f", {args.rate}" + (f", +{args.delay}" if args.delay else "")
                 + (f", loss {args.loss}" if args.loss else "") + (f" by {how.by}" if args.delay or args.loss else ""))
        if is_bench and compares_mpi(target):
            os.environ.update({k: v for k, v in env.items() if k.startswith("RINGWEAVE_")})  # mpirun -x passes them
            starts = [mpirun_job(target, args, names, subnet, label, scratch.name)]
        else:
            extra = ["--launched-by", label] if is_bench else []
            starts = [[sys.executable, "-m", "runtime.launch", "-n", str(args.per_node), "--nnodes", str(args.nproc),
                       "--node-rank", str(i), "--master-addr", master, "--master-port", port,
                       "--max-time-s", str(args.max_time_s), *target, *extra] for i in range(args.nproc)]
        for i, cmd in enumerate(starts):
            inner = f"hostname rw-netem-{i} && exec {shlex.join(cmd)}"
            log = None if i == 0 else tempfile.TemporaryFile("w+", dir=scratch.name)
            logs.append(log)
            procs.append(subprocess.Popen(["ip", "netns", "exec", names[i], "unshare", "--uts", "sh", "-c", inner],
                                          cwd=os.getcwd(), env=env, stdout=log, stderr=log, text=True))
        codes, deadline = [], time.monotonic() + args.max_time_s + 60
        for i, p in enumerate(procs):
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"netem: node {i} had not finished {args.max_time_s + 60} s after it started") from None
        for i, (code, log) in enumerate(zip(codes, logs)):
            if code and log is not None:
                log.seek(0)
                print(f"netem: node {i} exited {code}: {log.read()[-2000:]}", file=sys.stderr)
        if any(line.poll() is not None for line in how.lines):
            how.log.seek(0)
            print(f"netem: a delay line stopped during the run: {how.log.read()[-2000:]}", file=sys.stderr)
        return max(codes)
    finally:
        try:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the clean-up runs to its end
                signal.signal(s, signal.SIG_IGN)
        finally:  # also when a signal came just before the lines above
            clean(owner, procs + how.lines, logs + [how.log], scratch)


def clean(owner: int, procs: list, logs: list, scratch) -> None:
    left = teardown(owner)
    for p in procs:  # each ran in a namespace, so it is stopped by now: this reaps it
        if p.poll() is None:
            p.kill()
        p.wait()
    for log in logs:
        if log is not None:
            log.close()
    scratch.cleanup()
    if left:
        print(f"netem: could not delete {left}; `netem.py --cleanup` tries again", file=sys.stderr)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="after --: the job (a script or -m module, with its arguments), or "
                                       "arguments of bench/collectives.py")
    p.add_argument("-n", "--nproc", type=int, default=4, help="namespaces, the emulated hosts (default 4)")
    p.add_argument("--per-node", type=int, default=1,
                   help="ranks in each namespace (default 1); with more, ranks of one host share it")
    p.add_argument("--shm", choices=("on", "off"), default="off",
                   help="the shared-memory path among the ranks of one namespace (default off: TCP only)")
    p.add_argument("--rate", default="1gbit",
                   help="each link's rate, each way, as tc spells it; a comma list gives one per host (default 1gbit)")
    p.add_argument("--delay", default=None,
                   help="latency added on every link end (a hop between hosts: twice it), e.g. 1ms; one or one per host")
    p.add_argument("--loss", default=None, help="random loss on every link end, e.g. 0.1%%; one or one per host")
    p.add_argument("--delay-by", choices=("auto", "netem", "nfqueue"), default="auto",
                   help="what makes --delay and --loss: netem's qdisc, or a delay line in user space on iptables' "
                        "NFQUEUE (bench/_delayline.py); default auto: netem where the kernel has it")
    p.add_argument("--max-time-s", type=int, default=1800, help="the job's limit (runtime.launch --max-time-s)")
    p.add_argument("--cleanup", action="store_true",
                   help="remove the namespaces and links of runs that were killed (SIGKILL), then exit")
    args = p.parse_args(argv[:split])
    if args.nproc < 1 or args.per_node < 1:
        p.error("need -n >= 1 and --per-node >= 1")
    why = why_not()
    if why:
        raise SystemExit(f"netem: {why}")
    if args.cleanup:
        raise SystemExit(cleanup_leftovers())
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    raise SystemExit(run(args, argv[split + 1:]))


if __name__ == "__main__":
    main()
