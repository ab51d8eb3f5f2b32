"""``python -m runtime.store``: the job's rendezvous store as a process of its own, so that it
outlives any rank (jobs started by srun, mpirun or by hand; the launcher hosts its own).

    export RINGWEAVE_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
    python -m runtime.store --host 0.0.0.0 --port 29400 &     # prints where it listens
    # each rank: MASTER_ADDR=<this host> MASTER_PORT=29400 RINGWEAVE_STORE_HOSTED=1 RINGWEAVE_JOB=<as printed>

The secret is ``RINGWEAVE_SECRET`` or the one line of ``--secret-file`` (a regular file of this
user with no access for group or others, opened without following a link). Without one it
listens on loopback only, like every listener of the runtime; any other address is refused
(exit 2). Its first line on stdout says ``listening on HOST:PORT`` (port 0 picks a free one).
SIGTERM or SIGINT closes every connection and exits 0, within :data:`CLOSE_TIMEOUT_S`.

What happens to a job when this process is lost: its keys are gone with it, so ranks that need
the store (a membership change, a commit decision) get a ``StoreError`` naming the address and
the job stops; restart it from its checkpoint. Nothing here is replicated or written to disk.

Not here: the server itself (store_server.py), its clients (store_tcp.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

from runtime import args as types
from runtime import auth, private, scheduler
from runtime import env
from runtime.errors import AuthenticationError, RingweaveError
from runtime.store_server import StoreServer

CLOSE_TIMEOUT_S = 10.0  # closing tells each client bye and waits for its socket at most 1 s
EXIT_USAGE = 2  # bad arguments, no secret where one is needed, an address that cannot be bound
SECRET_FILE_MAX_NBYTES = 4096

_SECRET_FILE = private.Rules(
    "a secret file", private.PRIVATE, AuthenticationError,
    owner_risk="another user could know the job's secret", fix="make the file yourself",
    mode_fix="chmod 600 it")


def read_secret_file(path: str) -> bytes:
    """The content of ``path``, stripped (as tools' ``--secret-file``): one line, in a regular file
    of this user with no access for group or others, opened without following a link.

    Raises:
        AuthenticationError: the file is not such a file, or holds no secret.
        OSError: it cannot be read (missing, say).
    """
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, _ = private.open_file(os.path.basename(path), dfd, _SECRET_FILE, label=path)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        secret = f.read(SECRET_FILE_MAX_NBYTES + 1).strip()
    if not secret or len(secret) > SECRET_FILE_MAX_NBYTES or b"\n" in secret:
        raise AuthenticationError(f"{path} must hold the secret on one line of at most "
                                  f"{SECRET_FILE_MAX_NBYTES} bytes")
    return secret


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.store", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=types.port_or_any, default=0, help="port to listen on (default 0: a free one, printed)")
    p.add_argument("--job", default=None, help="the job's name, as the ranks name it (default: RINGWEAVE_JOB, "
                   "else slurm-<SLURM_JOB_ID> inside a SLURM job, else ringweave)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help=f"read the secret from PATH instead of {auth.SECRET_ENV}")
    return p


async def serve(host: str, port: int, *, secret: bytes | None, job: str, out=sys.stdout) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit status."""
    server = StoreServer(host, port, secret=secret, job=job)
    await server.start()  # AuthenticationError / OSError before anything listens
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = (signal.SIGTERM, signal.SIGINT)
    for sig in handled:
        loop.add_signal_handler(sig, stop.set)
    reach = socket.gethostname() if host in ("", "0.0.0.0", "::") else host  # what ranks dial
    try:
        print(f"listening on {host}:{server.port} (job {job!r}, "
              f"{'authenticated' if secret else 'unauthenticated: loopback only'}); ranks: MASTER_ADDR={reach} "
              f"MASTER_PORT={server.port} {env.STORE_HOSTED.name}=1 {env.JOB.name}={job}",
              file=out, flush=True)
        await stop.wait()  # the service itself: it ends on a signal, and only then
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await server.close()
        except TimeoutError:
            print(f"python -m runtime.store: closing took over {CLOSE_TIMEOUT_S:g} s", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else auth.secret_from_env()
        job = args.job or scheduler.placement(os.environ).job or env.JOB.get()  # as the ranks name it
        return asyncio.run(serve(args.host, args.port, secret=secret, job=job))
    except (RingweaveError, OSError) as exc:
        print(f"python -m runtime.store: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
