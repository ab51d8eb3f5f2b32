"""``python -m runtime.launch``: start the ranks of a job on this node, host its
store, and stop them all together.

Usage::

    python -m runtime.launch -n 4 train.py --lr 0.1            # 4 ranks on this machine
    python -m runtime.launch -n 4 -m trainer --epochs 3        # run a module instead of a script

    # two machines, 4 ranks each; the same command on both, each with its node rank,
    # and the same RINGWEAVE_SECRET in the environment of both:
    python -m runtime.launch -n 4 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 \\
        --master-port 29500 --job-id exp7 train.py
    python -m runtime.launch -n 4 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 \\
        --master-port 29500 --job-id exp7 train.py

Options (everything after the script or module name goes to the ranks)::

    -n, --nproc-per-node N   ranks on this node                                e.g. 4
    --nnodes M               nodes in the job (default 1); every node runs N ranks
    --node-rank K            this node, 0..M-1 (default 0); node 0 hosts the store
    --master-addr H          where the store is (default 127.0.0.1; required if M > 1)
    --master-port P          its port (single node: default 0, any free port; required if M > 1)
    --job-id ID              the run id, same on every node (default: fresh on a single
                             node, "H:P" on several)
    --max-restarts R         restart the whole job after a failure, up to R times (default 0)
    --grace-s S              SIGTERM -> SIGKILL grace when stopping ranks (default 5)
    --timeout-s T            every wait in the runtime times out after T s (sets
                             RINGWEAVE_TIMEOUT_S for the ranks; default: the runtime's own)
    --max-time-s T           wall-clock limit of the whole job; past it, stop all, exit 124
    --force                  start more than max(64, 4 x usable cores) ranks on this node
                             (without it such an -n is refused: a typo must not fork thousands)
    -m, --module             the target is a module name (python -m), not a script path

The store
    Node 0 runs the rendezvous store server (``runtime.store_tcp.StoreServer``)
    inside the launcher's own event loop, for the whole job, restarts included.
    It listens on ``--master-addr`` (default 127.0.0.1) when that is a
    loopback address, and on every interface (0.0.0.0 / ::) otherwise, so
    that the other nodes reach it at ``--master-addr`` whichever of this
    host's names or addresses that is. Other nodes host nothing.

The secret
    A job that listens beyond loopback needs ``RINGWEAVE_SECRET`` in the
    launcher's environment (the same on every node); without it the launcher
    refuses to start (exit 2). A single node without it makes a fresh secret
    (``auth.make_secret()``). Several nodes on loopback (one host) without it
    share one made for the job in a file of this user's alone
    (runtime/jobsecret.py); no job runs unauthenticated.

Environment of every rank (the names torchrun uses, plus ours)::

    RANK               node_rank * N + local_rank             e.g. 5
    WORLD_SIZE         M * N                                  e.g. 8
    LOCAL_RANK         0..N-1 on this node
    LOCAL_WORLD_SIZE   N
    GROUP_RANK         this node's rank (torchrun's name)
    NODE_RANK          the same
    GROUP_WORLD_SIZE   M
    MASTER_ADDR        where the store is                     e.g. 10.0.0.1
    MASTER_PORT        its port (the real one when port 0 was asked for)
    RINGWEAVE_SECRET   the job's secret (always set)
    RINGWEAVE_JOB      the run id, same on every node
    RINGWEAVE_STORE_HOSTED=1   the launcher hosts the store: rank 0 must not
    RINGWEAVE_RESTART  how many times the job was restarted: 0, 1, ...
    RINGWEAVE_LAUNCHER_PID  the launcher's pid: a rank asks the kernel for SIGTERM when its
                       parent dies (PR_SET_PDEATHSIG), so a launcher killed with SIGKILL
                       leaves no rank behind
    RINGWEAVE_TIMEOUT_S        only with --timeout-s
    PYTHONUNBUFFERED=1
    NUMBA_NUM_THREADS, OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS
                       max(1, cores // N), each only where the launcher's own
                       environment does not set it

Everything else is inherited from the launcher's environment. Ranks run with
the launcher's Python (``sys.executable``), stdin from /dev/null, each the
leader of its own process group (``start_new_session``): that group is the rank
and all it starts, and is what the launcher signals.

Output
    Each line a rank writes to stdout (stderr) is written to the launcher's
    stdout (stderr) as ``[rank R] line``; a last line without a newline gets
    one at exit. The launcher's own messages go to stderr as ``[launch] ...``.
    When a rank aborted the job (``runtime.abort``: its program raised, and it
    recorded that in the store before telling its peers), a traceback another
    rank writes afterwards is that failure's echo: it is written as its last
    line plus ``(traceback of N lines not shown: ...)``. The failure report
    names a traceback already printed by its last line instead of repeating it.

Exit codes
    0        every rank exited 0
    c        the first rank to fail exited with code c != 0
    128+s    the first rank to fail was killed by signal s (137 for SIGKILL)
    130/143  the launcher got SIGINT / SIGTERM (129 for SIGHUP)
    124      --max-time-s ran out
    2        bad arguments, or a secret was needed and not given
    1        the launcher itself failed (the store could not listen, a rank
             could not be spawned)
    "First" is the rank whose exit the launcher saw first, except that a rank
    of this node that aborted the job is waited for (up to --grace-s) and
    named instead: the ranks that fail because of it may exit before it does.
    Ranks that die after that, while being stopped, never change the code. On a failure the
    launcher stops the others (SIGTERM to each group, --grace-s, then
    SIGKILL), then prints which rank failed, its code or signal name and its
    last lines. A signal to the launcher is forwarded to every rank's group
    (SIGINT stays SIGINT), with the same grace; a second one kills at once.
    However an attempt ends, whatever is left in the ranks' process groups
    (e.g. a data-loader process a rank did not wait for) is stopped the same
    way, and descendants that left their group (setsid) but were orphaned are
    killed too: the launcher is their subreaper (Linux).

Restarts (``--max-restarts R``) and what the runtime must do about them
    After a failure, everything is stopped and the whole job (all ranks of
    this node) starts again, up to R times, each with RINGWEAVE_RESTART one
    higher. The store server stays up and keeps the keys of earlier attempts,
    so the runtime must namespace every key it uses by attempt: it wraps its
    store client in ``PrefixStore(attempt_prefix(restart), client)``, i.e.
    ``"restart/<RINGWEAVE_RESTART>"``, before its first key. Then a rank of
    attempt 1 can never read a key that attempt 0 left behind. With several
    nodes, each launcher restarts its own ranks when one of them fails (the
    ranks of the other nodes then fail with a lost peer and restart too), so
    counts stay in step as long as every failure takes down every node's
    attempt once; this is not elastic rendezvous.

What this is not: elastic membership, or per-node process counts that
differ. A launcher killed with SIGKILL cannot stop anything itself: on
Linux each rank that called ``runtime.init`` gets SIGTERM from the kernel
(RINGWEAVE_LAUNCHER_PID above), but what a rank started may live on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import errno
import functools
import ipaddress
import math
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import msgpack

from runtime import args as types
from runtime import auth, jobfile, procs
from runtime import env as settings
from runtime.errors import JobFileError, RingweaveError, WouldBlock
from runtime.init import ABORT_KEY
from runtime.scheduler import THREAD_VARS, usable_cores
from runtime.sharedmem import segments
from runtime.store_tcp import StoreServer
from runtime import jobsecret

EXIT_TIMEOUT = 124
EXIT_USAGE = 2
EXIT_LAUNCHER = 1
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# -- configuration (pure) -----------------------------------------------------


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
        epilog="Everything after the script or module name goes to the ranks. Each rank gets RANK, "
               "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RINGWEAVE_SECRET, "
               "RINGWEAVE_JOB and RINGWEAVE_RESTART (see the module docstring: python -m pydoc runtime.launch). "
               "Exit code: 0 when every rank exited 0, else the code of the rank that failed first "
               "(128+N for signal N; 124 past --max-time-s; 2 for bad arguments).")
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
        grace_s=ns.grace_s, timeout_s=ns.timeout_s, max_time_s=ns.max_time_s, force=ns.force)
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
    if not (math.isfinite(cfg.grace_s) and cfg.grace_s >= 0):  # NaN fails every comparison: ask for what is wanted
        raise ValueError(f"--grace-s must be 0 or a positive, finite number of seconds, got {cfg.grace_s}")
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


def rank_argv(cfg: LaunchConfig, python: str = sys.executable) -> list[str]:
    if cfg.module:
        return [python, "-m", cfg.target, *cfg.args]
    return [python, cfg.target, *cfg.args]


def attempt_prefix(restart: int) -> str:
    """The store namespace the runtime must use in attempt ``restart`` (see
    the module docstring): ``PrefixStore(attempt_prefix(n), client)``."""
    return f"restart/{restart}"


def rank_env(base: Mapping[str, str], cfg: LaunchConfig, local_rank: int, *, master_port: int,
             secret: str | None, job: str, restart: int, cores: int,
             launcher_pid: int | None = None) -> dict[str, str]:
    """The whole environment of one rank (see the module docstring).

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
    threads = str(thread_count(cores, cfg.nproc))
    for name in THREAD_VARS:
        if not base.get(name):
            env[name] = threads
    return env


# -- decisions (pure) ----------------------------------------------------------


def exit_code_of(returncode: int) -> int:
    """A rank's returncode as a shell would report it: a code as is, a
    signal s (asyncio's -s) as 128+s."""
    return returncode if returncode >= 0 else 128 - returncode


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL (exit code 137)"``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    return f"signal {signal_name(-returncode)} (exit code {exit_code_of(returncode)})"


@dataclass(frozen=True)
class RankExit:
    rank: int
    returncode: int
    exited_at: float  # time.monotonic()


def first_failure(exits: Sequence[RankExit]) -> RankExit | None:
    """The earliest non-zero exit (ties: the lowest rank), or None."""
    failed = [e for e in exits if e.returncode != 0]
    return min(failed, key=lambda e: (e.exited_at, e.rank)) if failed else None


class Ending(enum.Enum):
    SUCCEEDED = "succeeded"      # every rank exited 0
    FAILED = "failed"            # a rank exited non-zero or by a signal
    INTERRUPTED = "interrupted"  # the launcher got a signal
    TIMED_OUT = "timed out"      # --max-time-s ran out


@dataclass
class Outcome:
    """How one attempt ended."""

    ending: Ending
    failure: RankExit | None = None   # FAILED: the first failing rank
    signum: int | None = None         # INTERRUPTED: the signal the launcher got
    tail: list[str] = field(default_factory=list)  # FAILED: its last lines
    last_exception: str | None = None  # FAILED: the last line of its last traceback
    running: list[int] = field(default_factory=list)  # TIMED_OUT: ranks still running


class Action(enum.Enum):
    EXIT = "exit"
    RESTART = "restart"


def next_step(outcome: Outcome, restarts_done: int, max_restarts: int) -> tuple[Action, int]:
    """What the launcher does after an attempt: ``(Action.RESTART, 0)`` or
    ``(Action.EXIT, code)`` with the code of the module docstring's table."""
    if outcome.ending is Ending.SUCCEEDED:
        return Action.EXIT, 0
    if outcome.ending is Ending.INTERRUPTED:
        return Action.EXIT, 128 + int(outcome.signum or signal.SIGTERM)
    if outcome.ending is Ending.TIMED_OUT:
        return Action.EXIT, EXIT_TIMEOUT
    if restarts_done < max_restarts:
        return Action.RESTART, 0
    return Action.EXIT, exit_code_of(outcome.failure.returncode)


def failure_report(cfg: LaunchConfig, failure: RankExit, tail: Sequence[str],
                   aborted: dict | None = None, last_exception: str | None = None) -> list[str]:
    """The lines printed about a failed rank (without the ``[launch]`` prefix). ``aborted``:
    the job's abort record (``{"rank", "type", "message"}``), when a rank aborted it;
    ``last_exception``: the last line of the last traceback the rank wrote.

    A traceback that ends in ``tail`` was printed already, as the rank wrote it: it is named
    by its last line, not printed again."""
    local = failure.rank - cfg.node_rank * cfg.nproc
    where = f" (node {cfg.node_rank}, local rank {local})" if cfg.nnodes > 1 else ""
    lines = [f"rank {failure.rank}{where} failed first: {describe_exit(failure.returncode)}"]
    if aborted is not None:
        cause = f"{aborted.get('type')}: {aborted.get('message')}"
        lines[0] += (f", after aborting the job ({cause})" if aborted.get("rank") == failure.rank
                     else f"; rank {aborted.get('rank')} had aborted the job ({cause})")
    if last_exception is not None and last_exception in tail:
        lines.append(f"its traceback is above, ending: {last_exception}")
    elif tail:
        lines.append(f"last {len(tail)} lines of rank {failure.rank}:")
        lines.extend(f"  | {line}" for line in tail)
    else:
        lines.append(f"rank {failure.rank} wrote no output")
    return lines


def stop_plan(cfg: LaunchConfig, outcome: Outcome | None) -> tuple[int, str | None]:
    """How the rest of an attempt is stopped: the signal for every rank's
    group, and what to say first. ``outcome`` is None when the launcher
    itself failed in the middle of the attempt. A SUCCEEDED attempt is
    "stopped" too: that only reaches what the ranks left behind."""
    if outcome is None:
        return signal.SIGTERM, None
    if outcome.ending is Ending.FAILED:
        f = outcome.failure
        return signal.SIGTERM, (f"rank {f.rank} failed with {describe_exit(f.returncode)}; "
                                f"stopping the other ranks")
    if outcome.ending is Ending.INTERRUPTED:
        return outcome.signum, None  # forwarded as is: SIGINT stays SIGINT
    if outcome.ending is Ending.TIMED_OUT:
        return signal.SIGTERM, (f"the job ran past --max-time-s {cfg.max_time_s:g}; stopping ranks "
                                f"{outcome.running}")
    return signal.SIGTERM, None


def restart_message(outcome: Outcome, restarts_done: int, max_restarts: int) -> str:
    f = outcome.failure
    return (f"restarting the job ({restarts_done + 1} of {max_restarts}) after rank {f.rank} "
            f"failed with {describe_exit(f.returncode)}")


# -- the program ---------------------------------------------------------------


class Console:
    """The launcher's stdout and stderr: rank lines and ``[launch]`` messages,
    written through one place so they keep their order. A closed stdout
    (``| head``) stops the writes to it, not the job."""

    def __init__(self, out=None, err=None):
        self._files = {1: sys.stdout.buffer if out is None else out,
                       2: sys.stderr.buffer if err is None else err}

    def write(self, fd: int, data: bytes) -> None:
        f = self._files.get(fd)
        if f is None:
            return
        try:
            f.write(data)
            f.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._files.pop(fd, None)

    def say(self, *lines: str) -> None:
        self.write(2, "".join(f"[launch] {line}\n" for line in lines).encode())


class Stopper:
    """The launcher's own signals: the first asks the job to stop (forwarded
    to the ranks), a second one skips the grace period."""

    def __init__(self, console: Console):
        self.requested: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.hurried = False
        self._console = console

    def on_signal(self, signum: int) -> None:
        if not self.requested.done():
            self._console.say(f"got {signal_name(signum)}: stopping every rank "
                              f"(again to kill them at once)")
            self.requested.set_result(signum)
        else:
            self.hurried = True

    @contextlib.contextmanager
    def installed(self):
        loop = asyncio.get_running_loop()
        for sig in HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self.on_signal, sig)
        try:
            yield self
        finally:
            for sig in HANDLED_SIGNALS:
                loop.remove_signal_handler(sig)


@contextlib.asynccontextmanager
async def hosted_store(host: str, port: int, secret: str | None, job: str):
    """Runs the job's store server in this event loop; yields it (``.port``: the real port).

    The only places the launcher touches the store (runtime.store_tcp): here and
    :func:`abort_record`."""
    server = StoreServer(host, port, secret=secret.encode() if secret else None, job=job)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def abort_record(server, restart: int) -> dict | None:
    """The record the first rank that aborted attempt ``restart`` left in the store
    (``runtime.abort``: ``{"rank", "type", "message"}``), or None."""
    if server is None:
        return None
    try:
        record = msgpack.unpackb(server.data.get_nowait(f"{attempt_prefix(restart)}/{ABORT_KEY}"), raw=False)
    except (WouldBlock, RingweaveError, ValueError, msgpack.UnpackException):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("rank"), int) else None


async def root_cause(outcome: "Outcome", ranks: list[procs.RankProcess], aborted: dict | None,
                     wait_s: float) -> "Outcome":
    """A FAILED outcome pointed at the rank that aborted the job, when that was one of ours and
    not the rank seen failing first: the others fail *because* it aborted, and may exit before
    it does (its exit waits for its traceback and its interpreter's teardown). Waits up to
    ``wait_s`` for it to exit; a rank that aborted and then exited 0 is not the failure."""
    if outcome.ending is not Ending.FAILED or aborted is None or aborted["rank"] == outcome.failure.rank:
        return outcome
    root = next((r for r in ranks if r.rank == aborted["rank"]), None)
    if root is None:
        return outcome
    if not root.protocol.exited.done():
        await asyncio.wait([root.protocol.exited], timeout=wait_s)
    if root.returncode is None or root.returncode == 0:
        return outcome
    return Outcome(Ending.FAILED, failure=RankExit(root.rank, root.returncode, root.protocol.exited_at))


async def watch(ranks: list[procs.RankProcess], stopper: Stopper,
                deadline: float | None) -> Outcome:
    """Waits for the first of: a rank failing, every rank exiting 0, a
    signal to the launcher, the deadline. Does not stop anything."""
    by_future = {r.protocol.exited: r for r in ranks}
    waiting: set[asyncio.Future] = set(by_future) | {stopper.requested}
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if stopper.requested.done():
            return Outcome(Ending.INTERRUPTED, signum=stopper.requested.result())
        exits = [RankExit(by_future[f].rank, f.result(), by_future[f].protocol.exited_at)
                 for f in done]
        failure = first_failure(exits)
        if failure is not None:
            return Outcome(Ending.FAILED, failure=failure)
        waiting -= done
        if waiting == {stopper.requested}:
            return Outcome(Ending.SUCCEEDED)
        if not done:
            return Outcome(Ending.TIMED_OUT, running=[r.rank for r in ranks if r.returncode is None])


async def run_attempt(cfg: LaunchConfig, envs: list[dict[str, str]], console: Console,
                      stopper: Stopper, deadline: float | None,
                      aborted: Callable[[], dict | None] = lambda: None) -> Outcome:
    """Spawns this node's ranks, watches them, and always stops and reaps all
    of them (and their descendants) before returning. ``aborted()``: the attempt's
    abort record (:func:`abort_record`), if a rank aborted the job."""
    argv = rank_argv(cfg)
    first_rank = cfg.node_rank * cfg.nproc
    ranks: list[procs.RankProcess] = []
    outcome: Outcome | None = None
    try:
        for local_rank, env in enumerate(envs):
            if stopper.requested.done():
                break
            rank = first_rank + local_rank
            ranks.append(await procs.spawn(rank, argv, env, console.write, cfg.tail_lines,
                                           fold=functools.partial(_echo_of_abort, aborted, rank)))
        outcome = await root_cause(await watch(ranks, stopper, deadline), ranks, aborted(), cfg.grace_s)
    finally:
        sig, notice = stop_plan(cfg, outcome)
        if notice:
            console.say(notice)
        killed = await procs.stop_all(ranks, sig, cfg.grace_s, hurry=lambda: stopper.hurried)
        if killed and stopper.hurried:
            console.say(f"ranks {killed} killed at once (second signal)")
        elif killed:
            console.say(f"ranks {killed} did not stop within --grace-s {cfg.grace_s:g}: killed")
        await procs.drain(ranks, timeout_s=1.0)
        for r in ranks:
            r.close()
        remove_shm_segments(envs)  # shared-memory clean-up (runtime/sharedmem/segments.py)
    if outcome.ending is Ending.FAILED:
        failed = next(r for r in ranks if r.rank == outcome.failure.rank)
        outcome.tail = list(failed.protocol.tail)
        outcome.last_exception = failed.protocol.last_exception
    return outcome


def _echo_of_abort(aborted: Callable[[], dict | None], rank: int) -> str | None:
    """Why a traceback of ``rank`` is written as one line: another rank aborted the job first
    (a rank aborts before telling its peers, so its record is there before their errors)."""
    record = aborted()
    if record is None or record["rank"] == rank:
        return None
    return f"rank {record['rank']}'s {record.get('type', 'error')} aborted the job"


def remove_shm_segments(envs: list[dict[str, str]]) -> list[str]:
    """Shared-memory clean-up at the end of an attempt (runtime/sharedmem/): unlinks the /dev/shm
    segments of the job owned by this node's ranks. Ranks unlink their segments' names as soon
    as every peer has mapped them; this removes what a rank killed inside that window left."""
    job = settings.JOB.given(envs[0]) if envs else None
    return segments.remove_job_segments(job, [int(e["RANK"]) for e in envs]) if job else []


async def run_job(cfg: LaunchConfig, console: Console, environ: Mapping[str, str]) -> int:
    """The whole job: secret, store, attempts, restarts. Returns the exit code."""
    try:
        secret = choose_secret(cfg, settings.SECRET.get(environ))
    except ValueError as exc:
        console.say(f"error: {exc}")
        return EXIT_USAGE
    job = choose_job_id(cfg)
    shared = None
    if secret is None:  # nodes on loopback: this host's launchers share the job's private secret
        try:
            shared = jobsecret.derive(job, cfg.master_port, cfg.advertised_addr, f"launcher of node {cfg.node_rank}",
                                      env=environ)
        except RingweaveError as exc:  # AuthenticationError: the private directory is unusable
            console.say(f"error: {exc}")
            return EXIT_USAGE
        secret = shared.secret.decode()
        console.say(f"{auth.SECRET_ENV} is unset: the nodes share the job's secret in {shared.path} (this user's alone)")
    procs.become_subreaper()
    cores = usable_cores()
    deadline = None if cfg.max_time_s is None else time.monotonic() + cfg.max_time_s
    with Stopper(console).installed() as stopper:
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(jobsecret.release, shared)
            master_port = cfg.master_port or 0
            server = None
            if cfg.hosts_store:
                host = store_listen_host(cfg)
                try:
                    server = await stack.enter_async_context(hosted_store(host, master_port, secret, job))
                except (OSError, RingweaveError) as exc:
                    busy = (f"port {master_port} (--master-port {master_port}) is in use by another program; "
                            f"choose another --master-port, or 0 for any free port"
                            if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE else str(exc))
                    console.say(f"error: could not host the store on {host}:{master_port}: {busy}")
                    return EXIT_LAUNCHER
                master_port = server.port
            if cfg.hosts_store:  # tools.status finds the job through this file
                stack.callback(jobfile.remove, job)
            restart = 0
            while True:
                if cfg.hosts_store:
                    try:
                        jobfile.write(job, {"master_addr": cfg.advertised_addr, "master_port": master_port,
                                            "secret": secret, "restart": restart, "world_size": cfg.world_size,
                                            "launcher_pid": os.getpid()})
                    except JobFileError as exc:  # the job runs; only tools.status cannot find it
                        console.say(f"warning: no job file for tools.status: {exc}")
                envs = [rank_env(environ, cfg, local_rank, master_port=master_port, secret=secret,
                                 job=job, restart=restart, cores=cores, launcher_pid=os.getpid())
                        for local_rank in range(cfg.nproc)]
                aborted = functools.partial(abort_record, server, restart)
                try:
                    outcome = await run_attempt(cfg, envs, console, stopper, deadline, aborted)
                except OSError as exc:
                    console.say(f"error: could not start the ranks: {exc}")
                    return EXIT_LAUNCHER
                if outcome.ending is Ending.FAILED:
                    console.say(*failure_report(cfg, outcome.failure, outcome.tail, aborted(),
                                                outcome.last_exception))
                action, code = next_step(outcome, restart, cfg.max_restarts)
                if action is Action.RESTART:
                    console.say(restart_message(outcome, restart, cfg.max_restarts))
                    restart += 1
                    continue
                if code != 0:
                    console.say(f"job {job} {outcome.ending.value}; exiting with {code}")
                return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    console = Console()
    try:
        cfg = parse_args(argv)
    except ValueError as exc:
        console.say(f"error: {exc}")
        return EXIT_USAGE
    return asyncio.run(run_job(cfg, console, os.environ))


if __name__ == "__main__":
    sys.exit(main())
