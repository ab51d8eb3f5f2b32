"""What one node's launcher is asked to do, and what each of its ranks is given: pure functions of
the command line and the launcher's environment, no processes and no sockets.

- :func:`parse_args` (over :func:`build_parser`, the one description of every flag: ``--help``)
  and :func:`check_config` turn a command line into a :class:`LaunchConfig`, refusing options that
  do not make a job with a ``ValueError`` that names the option;
- :func:`choose_secret`, :func:`choose_job_id` and :func:`store_listen_host` decide the job's
  secret, its id and where node 0's store listens;
- :func:`rank_env` and :func:`rank_argv` are one rank's whole environment and command;
  :func:`attempt_prefix` is the store namespace of one attempt.

Not here: running the job (launch.py), how an attempt ended and what follows (launch_outcome.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import secrets
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from runtime import args as types
from runtime import auth
from runtime.membership import Bounds
from runtime.scheduler import THREAD_VARS, usable_cores

EPILOG = """\
Everything after the script or module name goes to the ranks.

Each rank's environment (torchrun's names, then ours; the rest is the launcher's own):
  RANK, WORLD_SIZE              node_rank * N + local_rank; M * N
  LOCAL_RANK, LOCAL_WORLD_SIZE  0..N-1 on this node; N
  GROUP_RANK, NODE_RANK         this node's rank (both names); GROUP_WORLD_SIZE: M
  MASTER_ADDR, MASTER_PORT      the store (the port it got when 0 was asked for)
  RINGWEAVE_SECRET              the job's secret (always set)
  RINGWEAVE_JOB                 the run id, the same on every node
  RINGWEAVE_RESTART             how many times the job was restarted: 0, 1, ...
  RINGWEAVE_STORE_HOSTED=1      the launcher hosts the store (rank 0 must not)
  RINGWEAVE_LAUNCHER_PID        a rank asks for SIGTERM when this process dies
  RINGWEAVE_TIMEOUT_S           only with --timeout-s
  PYTHONUNBUFFERED=1, and NUMBA_NUM_THREADS, OMP_NUM_THREADS, OPENBLAS_NUM_THREADS,
  MKL_NUM_THREADS = max(1, cores // N) where the launcher's environment leaves them unset.

Exit code: 0 when every rank exited 0; else that of the rank that failed first (128+S for
signal S; a rank of this node that aborted the job, or one that did not die of a peer, is named
before the ranks that failed because of it; a rank's usage error, exit code 2 after a line
"PROG: error: ...", is written once and never restarted); 124 past --max-time-s; 130, 143,
129 when the launcher got SIGINT, SIGTERM, SIGHUP; 2 for bad arguments or a secret that was
needed and not given; 1 when the launcher itself failed (the store could not listen, a rank
could not be started)."""

REJOIN_DELAY_S = 0.5  # --elastic: a lost rank's slot gets a joiner this long after its exit (a crash loop stays slow)


@dataclass(frozen=True)
class LaunchConfig:
    nproc: int                       # ranks on this node, e.g. 4
    target: str                      # script path or module name, e.g. "train.py"
    args: tuple[str, ...] = ()       # passed to every rank, e.g. ("--lr", "0.1")
    module: bool = False             # run the target with python -m
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None   # e.g. "10.0.0.1"
    master_port: int | None = None   # e.g. 29500
    job_id: str | None = None        # e.g. "exp7"
    max_restarts: int = 0
    grace_s: float = 5.0
    timeout_s: float | None = None   # runtime wait timeout for the ranks, e.g. 60
    max_time_s: float | None = None  # wall-clock limit of the job, e.g. 3600
    tail_lines: int = 20
    force: bool = False              # -n past nproc_bound() is allowed
    elastic: str | None = None       # "MIN:MAX": keep going while MIN ranks live, restart lost ones as joiners
    rejoin_delay_s: float = REJOIN_DELAY_S  # --elastic: the joiner starts this long after a rank's exit, e.g. 10

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    @property
    def hosts_store(self) -> bool:
        return self.node_rank == 0

    @property
    def advertised_addr(self) -> str:
        """MASTER_ADDR as the ranks see it."""
        return self.master_addr or "127.0.0.1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime.launch",
        description="Start the ranks of a ringweave job on this node, host its store, "
                    "stop them all when one fails.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc-per-node", dest="nproc", type=types.positive_int, required=True, metavar="N",
                   help="ranks to start on this node, e.g. 4")
    p.add_argument("--nnodes", type=types.positive_int, default=1, metavar="M",
                   help="nodes in the job (default 1); every node runs N ranks and its own launcher")
    p.add_argument("--node-rank", type=types.count, default=0, metavar="K",
                   help="this node, 0..M-1 (default 0); node 0 hosts the rendezvous store")
    p.add_argument("--master-addr", default=None, metavar="HOST",
                   help="address of node 0, where the store is (default 127.0.0.1; required with --nnodes > 1)")
    p.add_argument("--master-port", type=types.port_or_any, default=None, metavar="PORT",
                   help="port of the store (single node: default 0, any free port; required with --nnodes > 1)")
    p.add_argument("--job-id", default=None, metavar="ID",
                   help="the run's id, the same on every node; names its shared-memory segments and lets "
                        "python -m tools.status find it (default: fresh on one node, HOST:PORT on several)")
    p.add_argument("--max-restarts", type=types.count, default=0, metavar="R",
                   help="restart every rank of this node after a failure, up to R times (default 0); "
                        "ranks see RINGWEAVE_RESTART=1, 2, ...")
    p.add_argument("--elastic", default=None, metavar="MIN:MAX",
                   help="an elastic job of -n MAX ranks (one node): a lost rank does not stop the others while MIN "
                        "live, and is restarted as a joiner the job grows back to; a rank that leaves on SIGTERM "
                        "is not; a loss with no copy of its state left restarts the attempt from the checkpoint "
                        "(README.md)")
    p.add_argument("--rejoin-delay-s", type=types.seconds, default=REJOIN_DELAY_S, metavar="S",
                   help="with --elastic: seconds between a lost rank's exit and the start of the joiner in its slot "
                        "(default 0.5); the others train on, shrunk, meanwhile")
    p.add_argument("--grace-s", type=types.seconds, default=5.0, metavar="S",
                   help="when stopping ranks: seconds between SIGTERM and SIGKILL (default 5)")
    p.add_argument("--timeout-s", type=types.positive_seconds, default=None, metavar="T",
                   help="default timeout of every wait in the ranks, in seconds (sets RINGWEAVE_TIMEOUT_S; "
                        "default: the runtime's own, 300)")
    p.add_argument("--max-time-s", type=types.positive_seconds, default=None, metavar="T",
                   help="wall-clock limit of the whole job in seconds; past it every rank is stopped and "
                        "the launcher exits 124")
    p.add_argument("--force", action="store_true",
                   help="allow -n beyond max(64, 4 x usable cores) ranks on this node (without it such an "
                        "-n is refused: a typo must not fork thousands)")
    p.add_argument("-m", "--module", action="store_true",
                   help="the target is a module name, run as python -m TARGET")
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for every rank")
    return p


def parse_args(argv: Sequence[str]) -> LaunchConfig:
    """Parses and checks the command line.

    Raises:
        SystemExit(2): argparse's usage errors (printed by argparse).
        ValueError: the options do not make a job (see :func:`check_config`).
    """
    ns = build_parser().parse_args(list(argv))
    cfg = LaunchConfig(
        nproc=ns.nproc, target=ns.target, args=tuple(ns.args), module=ns.module,
        nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
        master_port=ns.master_port, job_id=ns.job_id, max_restarts=ns.max_restarts,
        grace_s=ns.grace_s, timeout_s=ns.timeout_s, max_time_s=ns.max_time_s, force=ns.force,
        elastic=ns.elastic, rejoin_delay_s=ns.rejoin_delay_s)
    check_config(cfg, nproc_bound(usable_cores()))
    return cfg


NPROC_PER_CORE = 4  # ranks per usable core that -n may ask for without --force
MIN_NPROC_BOUND = 64  # ... and at least this many, however few the cores


def nproc_bound(cores: int) -> int:
    """The most ranks per node -n may ask for without --force."""
    return max(MIN_NPROC_BOUND, NPROC_PER_CORE * cores)


def check_config(cfg: LaunchConfig, max_nproc: int | None = None) -> None:
    """Raises ValueError naming the first option that does not make a job; ``max_nproc``: the
    bound on -n without --force (:func:`nproc_bound`)."""
    if cfg.nproc < 1:
        raise ValueError(f"-n must be at least 1, got {cfg.nproc}")
    if cfg.elastic is None and cfg.rejoin_delay_s != REJOIN_DELAY_S:
        raise ValueError(f"--rejoin-delay-s {cfg.rejoin_delay_s:g} is for --elastic jobs (a fixed job restarts "
                         f"every rank: --max-restarts)")
    if cfg.elastic is not None:
        bounds = parse_bounds(cfg.elastic)
        if cfg.nnodes != 1 or cfg.max_restarts or bounds.max_size != cfg.nproc:
            raise ValueError(f"--elastic {cfg.elastic} runs -n {bounds.max_size} ranks on one node, without "
                             f"--max-restarts (got -n {cfg.nproc}, --nnodes {cfg.nnodes}, --max-restarts "
                             f"{cfg.max_restarts})")
    if max_nproc is not None and cfg.nproc > max_nproc and not cfg.force:
        raise ValueError(f"-n {cfg.nproc} would start more than {max_nproc} ranks on this node "
                         f"(max({MIN_NPROC_BOUND}, {NPROC_PER_CORE} per usable core)); pass --force if that is meant")
    if cfg.nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {cfg.nnodes}")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(f"--node-rank must be in 0..{cfg.nnodes - 1}, got {cfg.node_rank}")
    if cfg.nnodes > 1 and not cfg.master_addr:
        raise ValueError(f"--nnodes {cfg.nnodes} needs --master-addr (where node 0 hosts the store)")
    if cfg.nnodes > 1 and not cfg.master_port:
        raise ValueError(f"--nnodes {cfg.nnodes} needs a fixed --master-port (not 0): "
                         f"the other nodes must know it in advance")
    if cfg.master_port is not None and not 0 <= cfg.master_port <= 65535:
        raise ValueError(f"--master-port must be in 0..65535, got {cfg.master_port}")
    if cfg.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {cfg.max_restarts}")
    for name, value in (("--grace-s", cfg.grace_s), ("--rejoin-delay-s", cfg.rejoin_delay_s)):
        if not (math.isfinite(value) and value >= 0):  # NaN fails every comparison: ask for what is wanted
            raise ValueError(f"{name} must be 0 or a positive, finite number of seconds, got {value}")
    for name, value in (("--timeout-s", cfg.timeout_s), ("--max-time-s", cfg.max_time_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive, finite number of seconds, got {value}")


def is_loopback_addr(host: str) -> bool:
    """Whether ``host`` names a loopback address ("localhost", 127.x, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return auth.is_loopback(host)  # a name: resolve it


def store_listen_host(cfg: LaunchConfig) -> str:
    """Where node 0's store listens: the master address itself when it is
    loopback (nothing else may reach it), else every interface, because
    the master address may be any of this host's names or addresses."""
    addr = cfg.advertised_addr
    if is_loopback_addr(addr):
        return addr
    return "::" if ":" in addr else "0.0.0.0"


def choose_secret(cfg: LaunchConfig, env_secret: str | None,
                  make: Callable[[], str] = auth.make_secret) -> str | None:
    """The job's secret: the user's RINGWEAVE_SECRET, else a fresh one on a
    single node, else None for several nodes on loopback (they derive one:
    runtime/jobsecret.py).

    Raises:
        ValueError: several nodes beyond loopback and no RINGWEAVE_SECRET.
    """
    if env_secret:
        return env_secret
    if cfg.nnodes == 1:
        return make()
    if is_loopback_addr(cfg.advertised_addr):
        return None
    raise ValueError(
        f"a job over {cfg.nnodes} nodes listens beyond loopback ({cfg.advertised_addr}), so it "
        f"needs a secret: set {auth.SECRET_ENV} to the same value on every node, e.g. "
        f"export {auth.SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))')")


def choose_job_id(cfg: LaunchConfig, make: Callable[[], str] = lambda: secrets.token_hex(6)) -> str:
    """``--job-id``, else fresh on a single node, else ``"H:P"`` (the same on
    every node without the user choosing one)."""
    if cfg.job_id:
        return cfg.job_id
    if cfg.nnodes == 1:
        return f"job-{make()}"
    return f"{cfg.master_addr}:{cfg.master_port}"


def thread_count(cores: int, local_world_size: int) -> int:
    return max(1, cores // local_world_size)


def parse_bounds(text: str) -> Bounds:
    """``--elastic MIN:MAX`` (and RINGWEAVE_ELASTIC) as Bounds; ValueError saying what it must be."""
    lo, sep, hi = text.partition(":")
    try:
        return Bounds(int(lo), int(hi)) if sep else Bounds(0, 0)
    except ValueError:
        raise ValueError(f"--elastic takes MIN:MAX with 1 <= MIN <= MAX, e.g. 2:4; got {text!r}") from None


def member_id(job: str, rank: int, restart: int, joiner: int = 0) -> str:
    """An elastic job's member id of the process in slot ``rank``: the first, or its ``joiner``-th successor."""
    return f"{job}/r{rank}/a{restart}" + (f"/j{joiner}" if joiner else "")


def rank_argv(cfg: LaunchConfig, python: str = sys.executable) -> list[str]:
    if cfg.module:
        return [python, "-m", cfg.target, *cfg.args]
    return [python, cfg.target, *cfg.args]


def attempt_prefix(restart: int) -> str:
    """The store namespace the runtime must use in attempt ``restart``: the store outlives
    attempts, so every key goes under ``PrefixStore(attempt_prefix(n), client)``."""
    return f"restart/{restart}"


def elastic_prefix(restart: int) -> str:
    """Where an elastic attempt's generations are recorded (runtime/membership.py's keys)."""
    return f"{attempt_prefix(restart)}/elastic"


def rank_env(base: Mapping[str, str], cfg: LaunchConfig, local_rank: int, *, master_port: int,
             secret: str | None, job: str, restart: int, cores: int,
             launcher_pid: int | None = None) -> dict[str, str]:
    """The whole environment of one rank (:data:`EPILOG` lists it).

    ``launcher_pid`` sets RINGWEAVE_LAUNCHER_PID: ranks then die with the
    launcher, even a SIGKILLed one (runtime/init.py)."""
    env = dict(base)
    env.update(
        RANK=str(cfg.node_rank * cfg.nproc + local_rank),
        WORLD_SIZE=str(cfg.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(cfg.nproc),
        GROUP_RANK=str(cfg.node_rank),
        NODE_RANK=str(cfg.node_rank),
        GROUP_WORLD_SIZE=str(cfg.nnodes),
        MASTER_ADDR=cfg.advertised_addr,
        MASTER_PORT=str(master_port),
        RINGWEAVE_JOB=job,
        RINGWEAVE_STORE_HOSTED="1",
        RINGWEAVE_RESTART=str(restart),
        PYTHONUNBUFFERED="1",
    )
    if secret:
        env[auth.SECRET_ENV] = secret
    else:
        env.pop(auth.SECRET_ENV, None)
    if cfg.timeout_s is not None:
        env["RINGWEAVE_TIMEOUT_S"] = f"{cfg.timeout_s:g}"
    if launcher_pid is not None:
        env["RINGWEAVE_LAUNCHER_PID"] = str(launcher_pid)
    if cfg.elastic is not None:
        env.update(RINGWEAVE_ELASTIC=cfg.elastic, RINGWEAVE_MEMBER=member_id(job, int(env["RANK"]), restart),
                   RINGWEAVE_ELASTIC_JOIN="0")
    threads = str(thread_count(cores, cfg.nproc))
    for name in THREAD_VARS:
        if not base.get(name):
            env[name] = threads
    return env
