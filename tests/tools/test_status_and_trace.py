"""tools.status asks a running job what each rank waits on; tools.trace merges
per-rank traces into one file in the Chrome trace-event format."""

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from runtime.testing import run_ranks
from tools import trace as trace_tool

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STUCK = textwrap.dedent("""
    import asyncio, runtime, numpy as np
    async def main():
        rt = await runtime.init()
        w = rt.world
        call = w.open_call("all_reduce op=sum dtype=float32 count=4 root=-", 60)
        async def alg(c):
            bufs = [np.empty(4, np.float32) for _ in range(c.size)]
            futs = [c.irecv(p, bufs[p]) for p in range(c.size) if p != c.rank]
            if c.rank != 2:                       # rank 2 never sends: everyone waits on it
                for p in range(c.size):
                    if p != c.rank:
                        await c.send(p, np.ones(4, np.float32))
            print("ready", flush=True)
            await asyncio.gather(*futs)
        await w.run(call, alg)
        await asyncio.sleep(60)                   # rank 2 finished its part; it stays in the job
    asyncio.run(main())
""")


def test_status_names_the_rank_everyone_waits_on(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))  # a job file of our own
    job = subprocess.Popen([sys.executable, "-m", "runtime.launch", "-n", "3", "--job-id", "stuck-test",
                            "--max-time-s", "40", str(script)], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready = 0
        while ready < 3:
            line = job.stdout.readline()
            assert line, "the job ended early"
            ready += "ready" in line
        time.sleep(0.3)
        out = subprocess.run([sys.executable, "-m", "tools.status", "--job", "stuck-test", "--json"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        statuses = json.loads(out.stdout)
        assert [s["rank"] for s in statuses] == [0, 1, 2]
        for s in statuses[:2]:
            assert s["calls"][0]["op"].startswith("all_reduce")
            assert s["calls"][0]["waited_s"] > 0.1
        assert statuses[2]["calls"] == []  # rank 2 got everything it waited for
        assert statuses[0]["calls"][0]["waiting_on"] == [2]
        assert statuses[1]["calls"][0]["waiting_on"] == [2]
    finally:
        job.terminate()
        job.communicate(timeout=30)
    assert not os.path.exists(os.path.join(str(tmp_path), f"ringweave-{os.getuid()}", "stuck-test.json"))


def _check_trace_event_format(doc):
    """The JSON Object Format of the Trace Event Format (the parts Perfetto needs)."""
    assert isinstance(doc["traceEvents"], list)
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "M")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert isinstance(e.get("args", {}), dict)
    json.dumps(doc)


async def test_trace_of_collective_calls_merges_into_one_valid_file(tmp_path):
    async def body(w):
        w.runtime.tracer.out_dir = str(tmp_path)
        for i in range(3):
            call = w.open_call(f"all_gather op=- dtype=int32 count=2 root=- #{i}", 10)

            async def alg(c):
                out = [np.empty(2, np.int32) for _ in range(c.size)]
                futs = [c.irecv(p, out[p]) for p in range(c.size) if p != c.rank]
                for p in range(c.size):
                    if p != c.rank:
                        await c.send(p, np.full(2, c.rank, np.int32))
                await __import__("asyncio").gather(*futs)

            await w.run(call, alg)

    await run_ranks(3, body)  # closing each runtime writes its trace file
    assert sorted(os.listdir(tmp_path)) == [f"trace-rank{r}.json" for r in range(3)]
    assert trace_tool.main([str(tmp_path), "-o", str(tmp_path / "job.json")]) == 0
    doc = json.loads((tmp_path / "job.json").read_text())
    _check_trace_event_format(doc)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 9 and {e["pid"] for e in spans} == {0, 1, 2}
    assert all(e["args"]["outcome"] == "ok" and e["args"]["bytes_sent"] == 16 for e in spans)


async def test_a_tool_may_call_only_ringweave_handlers():
    """SECURITY.md: an authenticated tool may call only ``ringweave.*`` handlers."""
    from runtime.testing import make_runtimes
    from tools.status import ask

    secret = b"s3cret-for-tests"
    rts = await make_runtimes(2, "tcp", secret=secret)
    try:
        a = rts[1].actor
        a.register("user.secret_state", lambda: "must not leak")
        host, port = a.address
        assert await ask(host, port, secret, "test", name="ringweave.ping", timeout_s=5) == 1
        with pytest.raises(RuntimeError, match="tools may not call 'user.secret_state'"):
            await ask(host, port, secret, "test", name="user.secret_state", timeout_s=5)
    finally:
        for rt in rts:
            await rt.close()


async def test_status_reports_a_dead_rank_instead_of_failing():
    """A rank whose port no longer answers is reported as not answering."""
    import socket

    import msgpack

    from runtime.store_server import StoreServer
    from runtime.store_tcp import TCPStore
    from tools.status import collect, render

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    async with StoreServer("127.0.0.1", 0, secret=None, job="j") as srv:
        store = await TCPStore.connect("127.0.0.1", srv.port, secret=None, job="j", timeout_s=5)
        await store.set("restart/0/addr/0", msgpack.packb({"host": "127.0.0.1", "port": dead_port}))
        await store.close()
        info = {"master_addr": "127.0.0.1", "master_port": srv.port, "secret": None, "job": "j",
                "restart": 0, "world_size": 2}
        statuses = await collect(info, 0.5)
    assert [st["rank"] for st in statuses] == [0, 1]
    assert "not answering (ConnectError" in statuses[0]["error"]
    assert "no address in the store" in statuses[1]["error"]
    assert render(statuses)[0].startswith("rank 0: not answering")
