"""A real job for the security tests (and bench/security.py): the rank script, starting it
through the launcher, its progress, and its ranks' addresses as a tool finds them.

    run = LaunchedJob(tmp_path, 4)               # python -m runtime.launch -n 4, a fresh secret
    await run.wait_running()
    ranks = await rank_addresses(jobfile.find(run.id))
    code, log = await run.stop()

Not here: the attacks (the test files, netutil.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import msgpack

REPO = Path(__file__).resolve().parents[2]

# Every rank: checked all_reduces in a loop until the file out/stop appears. Modes: "steady"
# (4,096 float64 a call, a short sleep, out/iters.R written every iteration: a checkpoint needs
# descriptors too), "grow" (the array grows 6 times: shared-memory data slots are made anew),
# "tight" (no sleep, nothing written: the loop seldom yields).
JOB = r'''
import asyncio, os, sys, time
import numpy as np
import runtime
import collectives as C

OUT, RANK, MODE = sys.argv[1], int(os.environ["RANK"]), sys.argv[2]
with open(f"{OUT}/pid.{RANK}", "w") as f:
    f.write(str(os.getpid()))


def put(name, text):
    with open(f"{OUT}/{name}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{OUT}/{name}.tmp", f"{OUT}/{name}")


async def main():
    rt = await runtime.init()
    n = rt.world_size
    flag = np.zeros(1, np.int32)
    sizes = [16, 2_000, 20_000, 200_000, 700_000, 2_000_000] if MODE == "grow" else [4096]
    i = 0
    while True:
        count = sizes[min(i, len(sizes) - 1)]
        x = np.full(count, RANK + 1, np.float64)
        await C.all_reduce(x)
        assert (x == n * (n + 1) / 2).all(), x[:4]
        i += 1
        if MODE != "tight":
            put(f"iters.{RANK}", str(i))  # a file every iteration: a checkpoint needs descriptors too
        if MODE != "tight" or i % 200 == 0:
            flag[0] = 1 if os.path.exists(f"{OUT}/stop") else 0
            await C.all_reduce(flag, op="max")
            if flag[0]:
                break
        if MODE == "grow":
            await asyncio.sleep(0.2)
        elif MODE != "tight":
            await asyncio.sleep(0.01)
    put(f"iters.{RANK}", str(i))
    await runtime.shutdown(rt)

asyncio.run(main())
'''


def iters(out: Path) -> dict[int, int]:
    """Each rank's iteration count so far. A rank writes ``iters.R.tmp`` and renames it to
    ``iters.R``: the .tmp files are skipped, and one renamed between the listing and the read
    (FileNotFoundError) is read at the next poll."""
    got = {}
    for p in out.glob("iters.*"):
        if p.suffix == ".tmp":
            continue
        try:
            got[int(p.name.split(".")[1])] = int(p.read_text())
        except (ValueError, FileNotFoundError):
            pass
    return got


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def rank_addresses(info: dict) -> dict[int, tuple[str, int]]:
    """Every rank's listening address, from the store named in a job file (as tools.status finds them)."""
    from runtime.store import PrefixStore
    from runtime.store_tcp import TCPStore

    store = await TCPStore.connect(info["master_addr"], info["master_port"], secret=info["secret"].encode(),
                                   job=info["job"], timeout_s=10, who={"tool": "test"})
    try:
        prefixed = PrefixStore(f"restart/{info['restart']}", store)
        out = {}
        for r in range(info["world_size"]):
            addr = msgpack.unpackb(await prefixed.get(f"addr/{r}", 10))
            out[r] = (addr["host"], addr["port"])
        return out
    finally:
        await store.close()


class LaunchedJob:
    """JOB through the launcher with ``nproc`` ranks and a fresh secret (none inherited), running
    the code of ``repo``; its output in ``dir/job.log``, its files in ``dir/out``. ``popen_kw`` go
    to Popen (e.g. ``preexec_fn`` to lower a limit)."""

    def __init__(self, directory: Path, nproc: int, *, mode: str = "steady", repo: Path = REPO,
                 env: dict | None = None, job_id: str | None = None, max_time_s: float = 80, **popen_kw):
        self.dir = Path(directory)
        self.out = self.dir / "out"
        self.out.mkdir()
        (self.dir / "job.py").write_text(JOB)
        self.id = job_id or f"sec-{secrets.token_hex(4)}"
        self.nproc = nproc
        self._log = open(self.dir / "job.log", "w")
        env = dict(os.environ if env is None else env)
        env.pop("RINGWEAVE_SECRET", None)
        env.update(PYTHONPATH=str(repo))
        self.launcher = subprocess.Popen([sys.executable, "-m", "runtime.launch", "-n", str(nproc), "--job-id",
                                          self.id, "--max-time-s", str(max_time_s), str(self.dir / "job.py"),
                                          str(self.out), mode], cwd=str(repo), env=env, stdout=self._log,
                                         stderr=subprocess.STDOUT, **popen_kw)

    async def wait_running(self, timeout_s: float = 40) -> None:
        await asyncio.to_thread(wait_until, lambda: len(iters(self.out)) == self.nproc, timeout_s, "the job to run")

    def text(self) -> str:
        return (self.dir / "job.log").read_text(errors="replace")

    def stop_now(self, timeout_s: float = 30) -> tuple[int, str]:
        """Tells the ranks to stop and waits; returns the launcher's exit code and the job's output."""
        (self.out / "stop").write_text("")
        try:
            code = self.launcher.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            code = self.launcher.wait()
        self._log.close()
        return code, self.text()

    async def stop(self) -> tuple[int, str]:
        return await asyncio.to_thread(self.stop_now)
