"""What is every rank of a job doing now? The first thing to ask of a job that seems stuck.

    python -m tools.status                 # this user's job on this machine (the newest of several, said so)
    python -m tools.status --job job-1a2b  # a given job
    python -m tools.status --json
    python -m tools.status --master-addr n01 --master-port 15042 --job slurm-5042   # through its store
    srun --jobid=5042 --overlap -n 1 python -m tools.status                          # the same, from SLURM

It finds the job (tools/locate.py), reads every rank's address from the store, connects to each
rank as an authenticated tool (the job's secret; tools may call only ``ringweave.*`` handlers) and
prints each rank's collective calls in flight: the operation, how long it has waited and on which
ranks. A rank answers from its listener's own thread (runtime/acceptor.py), so one whose event
loop is busy still answers at once; one that does not answer within ``--timeout-s`` is reported
as not answering (stopped, holding the GIL in native code, or dead).

Example, a job whose rank 2 was stopped with SIGSTOP::

    rank 0: all_reduce op=sum dtype=float32 count=1048576 (group 0, call #12) waiting 41.2 s on ranks [2]
    rank 1: all_reduce op=sum dtype=float32 count=1048576 (group 0, call #12) waiting 41.2 s on ranks [2]
    rank 2: not answering (timed out after 2.0 s)
    rank 3: all_reduce op=sum dtype=float32 count=1048576 (group 0, call #12) waiting 41.1 s on ranks [2]

Not here: stopping or changing anything in the job (it only asks), finding it (tools/locate.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import msgpack

from runtime import args as types
from runtime import auth, wire
from runtime.actor import SCHEMA as _ACTOR_SCHEMA
from runtime.errors import RingweaveError
from runtime.launch_config import attempt_prefix
from runtime.store import PrefixStore
from runtime.store_tcp import TCPStore
from tools import locate

_REPLY_SCHEMA: wire.Schema = {"r": _ACTOR_SCHEMA["r"], "b": _ACTOR_SCHEMA["b"]}  # what a rank answers a tool


async def ask(host: str, port: int, secret: bytes | None, job: str, name: str = "ringweave.status",
              timeout_s: float = 2.0):
    """Calls handler ``name`` on the rank listening at host:port, as a tool."""
    loop = asyncio.get_running_loop()
    where, during = f"rank at {host}:{port}", f"the reply to {name}"
    sock = await auth.dial(host, port, secret=secret, job=job, who={"tool": "status"}, what="rank",
                           timeout_s=timeout_s, handshake_timeout_s=timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            args = msgpack.packb([])
            await loop.sock_sendall(sock, wire.encode_head({"k": "q", "i": 1, "n": name}, len(args)) + args)
            hlen, plen = wire.parse_prefix(await auth.recv_exact(sock, wire.PREFIX_NBYTES, where, during), 1 << 24,
                                           where=f" from {where}")
            header = wire.parse_header(await auth.recv_exact(sock, hlen, where, during), _REPLY_SCHEMA,
                                       where=f" from {where}")
            payload = await auth.recv_exact(sock, plen, where, during)
            if "e" in header:
                raise RuntimeError(header["e"])
            return msgpack.unpackb(payload, strict_map_key=False)
    finally:
        sock.close()


async def collect(info: dict, timeout_s: float) -> list[dict]:
    secret = info["secret"].encode() if info.get("secret") else None
    store = await TCPStore.connect(info["master_addr"], info["master_port"], secret=secret, job=info["job"],
                                   timeout_s=timeout_s, who={"tool": "status"})
    try:
        prefixed = PrefixStore(attempt_prefix(info["restart"]), store)
        out = []
        for r in range(info["world_size"]):
            try:
                addr = msgpack.unpackb(await prefixed.get(f"addr/{r}", timeout_s))
            except Exception as exc:
                out.append({"rank": r, "error": f"no address in the store ({type(exc).__name__})"})
                continue
            try:
                out.append(await ask(addr["host"], addr["port"], secret, info["job"], timeout_s=timeout_s))
            except (TimeoutError, OSError, RuntimeError, RingweaveError) as exc:  # e.g. ConnectError: dead
                out.append({"rank": r, "error": f"not answering ({type(exc).__name__}: {exc or 'timed out'} "
                                                f"after {timeout_s:.1f} s)"})
        return out
    finally:
        await store.close()


def which_job(info: dict, chosen: bool) -> list[str]:
    """The lines that say which job is shown: ``chosen`` when the flags or the environment named
    it, else it is this user's only job on this machine, or the newest of several (then listed)."""
    def about(job: dict) -> str:
        started = job.get("started_at")
        when = f", started {time.strftime('%H:%M:%S', time.localtime(started))}" if isinstance(
            started, (int, float)) else ""
        return f"{job.get('world_size', '?')} ranks{when}"

    others = info.get("others") or []
    head = f"job {info['job']} ({about(info)})"
    if chosen:
        return [head]
    if not others:
        return [f"{head}: the only job of this user on this machine"]
    return [f"{head}: the newest of {len(others) + 1} jobs of this user on this machine; the others:",
            *(f"  job {o['job']} ({about(o)}): python -m tools.status --job {o['job']}" for o in others)]


def render(statuses: list[dict]) -> list[str]:
    lines = []
    for st in statuses:
        r = st["rank"]
        if "error" in st:
            lines.append(f"rank {r}: {st['error']}")
            continue
        if not st["calls"]:
            extra = f"; failed groups {st['failed_groups']}" if st.get("failed_groups") else ""
            lines.append(f"rank {r}: no collective in flight{extra}")
        for c in st["calls"]:
            waiting = f" on ranks {c['waiting_on']}" if c["waiting_on"] else ""
            lines.append(f"rank {r}: {c['op']} (group {c['group']}, call #{c['seq']}) "
                         f"waiting {c['waited_s']:.1f} s{waiting}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=None, help="the job's id (the launcher prints it first); default: this "
                   "user's job on this machine, the newest of several (said so, the others listed)")
    p.add_argument("--timeout-s", type=types.positive_seconds, default=2.0,
                   help="how long each rank (and the store) may take to answer, in seconds (default 2)")
    p.add_argument("--json", action="store_true")
    locate.add_arguments(p)  # or through the job's store: tools/locate.py
    args = p.parse_args(argv)
    try:
        info = asyncio.run(locate.locate(args, args.timeout_s))
    except (FileNotFoundError, RingweaveError, OSError) as exc:  # JobFileError (a RingweaveError): not safely ours
        print(exc, file=sys.stderr)
        return 1
    chosen = args.job is not None or "others" not in info  # named, or found through the environment
    header = which_job(info, chosen)
    statuses = asyncio.run(collect(info, args.timeout_s))
    if args.json:
        if len(header) > 1:  # several jobs: which one this is goes beside the JSON, not into it
            print("\n".join(header), file=sys.stderr)
        print(json.dumps(statuses, indent=1))
    else:
        print("\n".join(header + render(statuses)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
