"""bench/collectives.py across emulated machines: one network namespace per host, a rate limit on every link.

    sudo python bench/netem.py -n 4 --rate 1gbit -- --ops broadcast --algorithm all --sizes 64K,1M,16M --iters 5
    sudo python bench/netem.py -n 2 --per-node 2 --shm on -- --ops all_reduce --algorithm all --sizes 1M,16M

Loopback on one box is bound by the CPU of the kernel's copies, so it cannot show what a
network-bound job sees: there, moving fewer bytes over the busiest link matters more than
the number of copies. This builds that network and runs the benchmark on it:

* n namespaces ``rwnN-<i>``, each with its own host name (``unshare --uts``: the runtime tells
  machines apart by name, so no two ranks share memory) and one veth into a bridge in the
  root namespace (addresses 10.<a>.<b>.<i+1>/24);
* every link shaped in both directions with ``tc``: a token bucket at ``--rate`` (and
  ``--delay`` of netem latency when given) on the namespace's end (its sends) and on the
  bridge's end (its receives);
* in each namespace ``python -m runtime.launch -n K --nnodes n --node-rank i`` of
  bench/collectives.py with the arguments after ``--``: K = ``--per-node`` ranks per host
  (default 1), which reach each other over the namespace's loopback, or over shared memory with
  ``--shm on`` (default off: TCP only, RINGWEAVE_SHM=0). Rank 0's table and comparison are printed;
  its JSON and plot go where bench/collectives.py puts them.

Needs root, ``ip`` (iproute2), ``tc`` and ``unshare``. Every namespace and link it made is
deleted at the end, whatever happens. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SETUP_TIMEOUT_S = 60  # one ip / tc command (each takes milliseconds)
ROOT = os.path.dirname(HERE)


def sh(*cmd: str) -> None:
    """Runs a set-up command; a failure stops the run with the command and its error."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"netem: `{' '.join(cmd)}` had not finished after {SETUP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise SystemExit(f"netem: `{' '.join(cmd)}` failed: {done.stderr.strip()}")


def why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (ip netns add, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` on PATH (iproute2, util-linux)"
    return None


def shape(ns: str | None, dev: str, rate: str, delay: str | None) -> None:
    """A token bucket at ``rate`` on ``dev``'s sends (inside ``ns`` when given), behind netem's delay."""
    where = ["ip", "netns", "exec", ns] if ns else []
    if delay:
        sh(*where, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay)
        sh(*where, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf", "rate", rate,
           "burst", "256kb", "latency", "50ms")
    else:
        sh(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")


def build(n: int, tag: str, subnet: str, rate: str, delay: str | None, made: list) -> list[str]:
    """The namespaces, bridge and shaped links; appends what it made to ``made`` (for teardown)."""
    bridge = f"rwbr{tag}"
    sh("ip", "link", "add", bridge, "type", "bridge")
    made.append(("link", bridge))
    sh("ip", "link", "set", bridge, "up")
    names = []
    for i in range(n):
        ns, inner, outer = f"rwn{tag}-{i}", f"rwi{tag}x{i}", f"rwo{tag}x{i}"
        sh("ip", "netns", "add", ns)
        made.append(("netns", ns))
        sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        made.append(("link", outer))
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "link", "set", outer, "master", bridge)
        sh("ip", "link", "set", outer, "up")
        sh("ip", "-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", inner)
        sh("ip", "-n", ns, "link", "set", inner, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        shape(ns, inner, rate, delay)   # what rank i sends
        shape(None, outer, rate, delay)  # what rank i receives
        names.append(ns)
    return names


def teardown(made: list) -> None:
    for kind, name in reversed(made):
        cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
        try:
            subprocess.run(cmd, capture_output=True, timeout=SETUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # go on: delete the rest; say what is left behind
            print(f"netem: `{' '.join(cmd)}` had not finished after {SETUP_TIMEOUT_S} s; it may be left",
                  file=sys.stderr)


def run(args, bench_args: list[str]) -> int:
    tag = f"{os.getpid() % 1000}"
    subnet = f"10.{random.randrange(100, 200)}.{random.randrange(1, 250)}"
    master, port = f"{subnet}.1", str(random.randrange(20000, 30000))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RINGWEAVE_SHM="1" if args.shm == "on" else "0", RINGWEAVE_SECRET="netem-" + os.urandom(8).hex())
    made: list = []
    procs = []
    logs = []  # every node but 0 writes into a file (a pipe nobody reads while we wait could fill and stall it)
    try:
        names = build(args.nproc, tag, subnet, args.rate, args.delay, made)
        label = (f"netem {args.nproc} namespaces" + (f" x {args.per_node} ranks" if args.per_node > 1 else "")
                 + f", {args.rate}" + (f", +{args.delay}" if args.delay else ""))
        for i, ns in enumerate(names):
            job = [sys.executable, "-m", "runtime.launch", "-n", str(args.per_node), "--nnodes", str(args.nproc),
                   "--node-rank", str(i), "--master-addr", master, "--master-port", port,
                   "--max-time-s", str(args.max_time_s), os.path.join(HERE, "collectives.py"), *bench_args,
                   "--shm", args.shm, "--launched-by", label]
            inner = f"hostname rw-netem-{i} && exec {shlex.join(job)}"
            log = None if i == 0 else tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", inner],
                                          cwd=os.getcwd(), env=env, stdout=log, stderr=log, text=True))
        codes = []
        for i, p in enumerate(procs):
            try:
                codes.append(p.wait(timeout=args.max_time_s + 60))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"netem: node {i} had not finished {args.max_time_s + 60} s after it started") from None
        for i, (code, log) in enumerate(zip(codes, logs)):
            if code and log is not None:
                log.seek(0)
                print(f"netem: node {i} exited {code}: {log.read()[-2000:]}", file=sys.stderr)
        return max(codes)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            if log is not None:
                log.close()
        teardown(made)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="arguments after -- go to bench/collectives.py")
    p.add_argument("-n", "--nproc", type=int, default=4, help="namespaces, the emulated hosts (default 4)")
    p.add_argument("--per-node", type=int, default=1,
                   help="ranks in each namespace (default 1); with more, ranks of one host share it")
    p.add_argument("--shm", choices=("on", "off"), default="off",
                   help="the shared-memory path among the ranks of one namespace (default off: TCP only)")
    p.add_argument("--rate", default="1gbit", help="every link's rate, each way, as tc spells it (default 1gbit)")
    p.add_argument("--delay", default=None,
                   help="netem latency added on every link end, e.g. 100us (needs the kernel's sch_netem)")
    p.add_argument("--max-time-s", type=int, default=1800, help="the job's limit (runtime.launch --max-time-s)")
    args = p.parse_args(argv[:split])
    if args.nproc < 1 or args.per_node < 1:
        p.error("need -n >= 1 and --per-node >= 1")
    why = why_not()
    if why:
        raise SystemExit(f"netem: {why}")
    raise SystemExit(run(args, argv[split + 1:]))


if __name__ == "__main__":
    main()
