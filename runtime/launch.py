"""``python -m runtime.launch``: start the ranks of a job on this node, host its store, and stop
them all together.

    python -m runtime.launch -n 4 train.py --lr 0.1        # 4 ranks on this machine
    python -m runtime.launch -n 4 -m trainer --epochs 3    # a module instead of a script

``--help`` lists every flag, each rank's environment and the exit codes (launch_config.py);
README.md ("Running on a cluster") starts a job over several nodes.

:func:`run_job` is the whole job: it chooses the secret, hosts the store on node 0 in this event
loop for every attempt (:func:`hosted_store`), writes the job file that tools find the job by, and
runs attempts until one ends without a restart. :func:`run_attempt` spawns this node's ranks
(procs.py: each the leader of a process group of its own, its output prefixed ``[rank R]``), waits
for the first of a failure, every rank's success, a signal to the launcher and the deadline
(:func:`watch`), and always stops and reaps every rank, and what it left, before returning.
:class:`Console` keeps the ranks' lines and the launcher's ``[launch]`` messages in order;
:class:`Stopper` turns the launcher's signals into a stop (a second one skips the grace period).
The decisions are pure functions beside it: the command line in launch_config.py, what follows an
attempt in launch_outcome.py. docs/design.md ("The launcher") says how the failure is named, how
ranks are stopped and what restarts ask of the runtime.

``--elastic MIN:MAX`` attempts are launch_elastic.py's. Not this: nodes with different rank counts. A launcher killed by SIGKILL
stops nothing itself: each rank that called ``runtime.init`` gets SIGTERM from the kernel, but what
a rank started may live on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import signal
import sys
import time
from typing import Callable, Mapping, Sequence

import msgpack

from runtime import auth, jobfile, launch_elastic, membership, procs
from runtime import env
from runtime.errors import JobFileError, RingweaveError, WouldBlock, ranks_in_words
from runtime.init import ABORT_KEY
from runtime.launch_config import (
    LaunchConfig,
    attempt_prefix,
    choose_job_id,
    choose_secret,
    elastic_prefix,
    parse_args,
    rank_argv,
    rank_env,
    store_listen_host,
)
from runtime.launch_outcome import (
    EXIT_LAUNCHER,
    EXIT_USAGE,
    Action,
    Ending,
    Outcome,
    RankExit,
    cause_still_running,
    failure_report,
    first_failure,
    next_step,
    restart_message,
    signal_name,
    stop_plan,
    usage_report,
)
from runtime.scheduler import usable_cores
from runtime.sharedmem import segments
from runtime.store_server import StoreServer
from runtime import jobsecret

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)



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

    The only places the launcher touches the store (runtime.store_server): here and
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


def left_record(server, restart: int, member: str) -> str | None:
    """Why elastic ``member`` of attempt ``restart`` left the job on purpose (the ``left/<member>``
    record runtime/elastic.py writes before its exit 0), or None."""
    if server is None or not member:
        return None
    try:
        return server.data.get_nowait(f"{elastic_prefix(restart)}/left/{member}").decode("utf-8", "replace")
    except (WouldBlock, RingweaveError):
        return None


def latest_members(server, restart: int) -> set[str] | None:
    """The member ids of the latest generation decided in elastic attempt ``restart`` (None: unknown)."""
    if server is None:
        return None
    prefix = elastic_prefix(restart)
    try:
        g = int(server.data.get_nowait(f"{prefix}/{membership.LATEST}"))
        record = membership.decode_record(server.data.get_nowait(f"{prefix}/gen/{g}"), g)
    except (WouldBlock, RingweaveError, ValueError):
        return None
    return set(record.get("members", ()))


PIPE_WAIT_S = 0.3  # how long a failed rank's last lines (its traceback) may take to arrive after its exit


async def _exit_of(r: procs.RankProcess) -> RankExit:
    """How ``r`` exited; for a failure, with the exception line of its last traceback, read once
    its pipes close (bounded: a grandchild may hold them open)."""
    if r.returncode and not r.protocol.pipes_closed.done():
        await asyncio.wait([r.protocol.pipes_closed], timeout=PIPE_WAIT_S)
    return RankExit(r.rank, r.returncode, r.protocol.exited_at, r.protocol.last_exception)


async def watch(ranks: list[procs.RankProcess], stopper: Stopper, deadline: float | None,
                aborted: Callable[[], dict | None] = lambda: None, settle_s: float = 0.0) -> Outcome:
    """Waits for the first of: a rank failing, every rank exiting 0, a signal to the launcher,
    the deadline. Does not stop anything.

    A failure is the rank that caused it (launch_outcome.first_failure): when the first rank
    seen failing died of a peer, or another rank of ours aborted the job, this waits up to
    ``settle_s`` more for that rank to exit (its exit waits for its traceback and its
    interpreter's teardown, often longer than its victims')."""
    by_future = {r.protocol.exited: r for r in ranks}
    waiting: set[asyncio.Future] = set(by_future) | {stopper.requested}
    exits: list[RankExit] = []
    settle_until: float | None = None
    while True:
        ends = [t for t in (deadline, settle_until) if t is not None]
        timeout = None if not ends else max(0.0, min(ends) - time.monotonic())
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if stopper.requested.done():
            return Outcome(Ending.INTERRUPTED, signum=stopper.requested.result())
        exits += [await _exit_of(by_future[f]) for f in done]
        waiting -= done
        record = aborted()
        aborted_rank = record["rank"] if record is not None else None
        failure = first_failure(exits, aborted_rank)
        if failure is not None:
            running = [by_future[f].rank for f in waiting if f is not stopper.requested]
            if settle_until is None:
                settle_until = time.monotonic() + settle_s
            now = time.monotonic()
            if (now >= settle_until or (deadline is not None and now >= deadline)
                    or not cause_still_running(failure, aborted_rank, running)):
                return Outcome(Ending.FAILED, failure=failure)
            continue
        if waiting == {stopper.requested}:
            return Outcome(Ending.SUCCEEDED)
        if not done and deadline is not None and time.monotonic() >= deadline:
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
    usage_errors: set[str] = set()  # written once per attempt, whichever ranks wrote them (procs.UsageFolder)
    outcome: Outcome | None = None
    try:
        for local_rank, rank_environ in enumerate(envs):
            if stopper.requested.done():
                break
            rank = first_rank + local_rank
            ranks.append(await procs.spawn(rank, argv, rank_environ, console.write, cfg.tail_lines,
                                           fold=functools.partial(_echo_of_abort, aborted, rank),
                                           usage_errors=usage_errors))
        outcome = await watch(ranks, stopper, deadline, aborted, settle_s=cfg.grace_s)
        if outcome.ending is Ending.FAILED and usage_errors:
            failed = next(r for r in ranks if r.rank == outcome.failure.rank)
            outcome.usage_error = failed.protocol.usage_error or next(iter(usage_errors))
    finally:
        sig, notice = stop_plan(cfg, outcome)
        if notice:
            console.say(notice)
        killed = await procs.stop_all(ranks, sig, cfg.grace_s, hurry=lambda: stopper.hurried)
        if killed and stopper.hurried:
            console.say(f"{ranks_in_words(killed)} killed at once (second signal)")
        elif killed:
            console.say(f"{ranks_in_words(killed)} did not stop within --grace-s {cfg.grace_s:g}: killed")
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


def job_line(cfg: LaunchConfig, job: str) -> str:
    """What the launcher says first: the job's id, its ranks, and how to ask what they do."""
    first = cfg.node_rank * cfg.nproc
    ranks = (f"{cfg.world_size} ranks" if cfg.nnodes == 1 else
             f"ranks {first}-{first + cfg.nproc - 1} of {cfg.world_size} on node {cfg.node_rank}")
    return f"job {job}: {ranks} (python -m tools.status --job {job} shows what each is doing)"


def remove_shm_segments(envs: list[dict[str, str]]) -> list[str]:
    """Shared-memory clean-up at the end of an attempt (runtime/sharedmem/): unlinks the /dev/shm
    segments of the job owned by this node's ranks. Ranks unlink their segments' names as soon
    as every peer has mapped them; this removes what a rank killed inside that window left."""
    job = env.JOB.given(envs[0]) if envs else None
    return segments.remove_job_segments(job, [int(e["RANK"]) for e in envs]) if job else []


async def run_job(cfg: LaunchConfig, console: Console, environ: Mapping[str, str]) -> int:
    """The whole job: secret, store, attempts, restarts. Returns the exit code."""
    try:
        secret = choose_secret(cfg, env.SECRET.get(environ))
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
            console.say(job_line(cfg, job))
            restart = 0
            started_at = time.time()  # tools.status lists this user's jobs by it
            while True:
                if cfg.hosts_store:
                    try:
                        jobfile.write(job, {"master_addr": cfg.advertised_addr, "master_port": master_port,
                                            "secret": secret, "restart": restart, "world_size": cfg.world_size,
                                            "launcher_pid": os.getpid(), "started_at": started_at})
                    except JobFileError as exc:  # the job runs; only tools.status cannot find it
                        console.say(f"warning: no job file for tools.status: {exc}")
                envs = [rank_env(environ, cfg, local_rank, master_port=master_port, secret=secret,
                                 job=job, restart=restart, cores=cores, launcher_pid=os.getpid())
                        for local_rank in range(cfg.nproc)]
                aborted = functools.partial(abort_record, server, restart)
                try:
                    if cfg.elastic is not None:  # runtime/launch_elastic.py
                        await launch_elastic.record_first_generation(cfg, master_port, secret, job, restart)
                        outcome = await launch_elastic.run_elastic_attempt(
                            cfg, envs, console, stopper, deadline,
                            launch_elastic.fold_for(aborted, _echo_of_abort), restart,
                            functools.partial(left_record, server, restart),
                            functools.partial(latest_members, server, restart))
                    else:
                        outcome = await run_attempt(cfg, envs, console, stopper, deadline, aborted)
                except OSError as exc:
                    console.say(f"error: could not start the ranks: {exc}")
                    return EXIT_LAUNCHER
                if outcome.is_usage_error:
                    console.say(usage_report(job, outcome.failure))
                    return EXIT_USAGE
                if outcome.ending is Ending.FAILED:
                    console.say(*failure_report(cfg, outcome.failure, outcome.tail, aborted(),
                                                outcome.last_exception))
                # an elastic job restarts only to fall back to its checkpoint (runtime/launch_elastic.py)
                budget = cfg.max_restarts if cfg.elastic is None else launch_elastic.restarts_allowed(outcome)
                action, code = next_step(outcome, restart, budget)
                if action is Action.RESTART:
                    console.say(restart_message(outcome, restart, budget))
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
