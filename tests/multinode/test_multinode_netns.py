"""Two machines, simulated: two network namespaces joined by a veth pair, one launcher in each.

    ns "a" 10.N.M.1/24  <-- veth -->  ns "b" 10.N.M.2/24          (each with its loopback up)

    ip netns exec A unshare --uts sh -c 'hostname node-a && exec python -m runtime.launch -n 2 \\
        --nnodes 2 --node-rank 0 --master-addr 10.N.M.1 --master-port P job.py OUT'
    ip netns exec B unshare --uts sh -c 'hostname node-b && exec python -m runtime.launch -n 2 \\
        --nnodes 2 --node-rank 1 --master-addr 10.N.M.1 --master-port P job.py OUT'

with the same RINGWEAVE_SECRET in both. (The 512 KiB broadcast takes the pipelined chain,
the table's choice for groups that span hosts.) Each namespace gets its own host name
(``unshare --uts``) because the runtime tells machines apart by host name and
boot id: with the same name the 4 ranks would look like one machine and talk
through /dev/shm, which the namespaces share. The job checks all_reduce,
all_gather, broadcast and barrier against closed forms, then trains an MLP
with FSDP for a few steps and checks every rank ends with the same parameters.
Two runs: TCP only (RINGWEAVE_SHM=0), and the default (shared memory inside a
"node", TCP between them).

Needs root and ``ip`` (iproute2); skipped with the reason otherwise. The
namespaces are always deleted, whatever happens.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    if shutil.which("unshare") is None:
        return "needs util-linux's `unshare` (a host name per namespace)"
    probe = f"rwprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

JOB = r'''
import asyncio, os, sys
import numpy as np
import runtime
import collectives as C
from trainer.data import iter_local_batches, make_synthetic
from trainer.nn import mlp
from trainer.sharding import TrainConfig, make_strategy


async def main():
    rt = await runtime.init()
    r, n = rt.rank, rt.world_size
    peers = sorted(set(rt.nodes))
    x = np.full(1 << 18, r + 1.0, np.float32)                  # 1 MiB
    await C.all_reduce(x)
    assert (x == n * (n + 1) / 2).all(), x[:4]
    out = np.empty(n * 1000, np.int64)
    await C.all_gather(out, np.full(1000, r, np.int64))
    assert (out.reshape(n, 1000) == np.arange(n)[:, None]).all()
    b = np.full(4096, r, np.float64)
    await C.broadcast(b, src=n - 1)
    assert (b == n - 1).all()
    big = np.arange(1 << 16, dtype=np.float64) + r                # 512 KiB: the chain across nodes
    await C.broadcast(big, src=1)
    assert (big == np.arange(1 << 16) + 1).all(), big[:4]
    await C.barrier()
    print(f"rank {r}: collectives ok across {len(peers)} node(s) {peers}", flush=True)

    xs, ys = make_synthetic(512, in_dim=16, num_classes=4, seed=1)
    model = mlp(16, (32, 32), 4, pad_to=n)
    strategy = make_strategy("fsdp", model, TrainConfig(strategy="fsdp", lr=1e-2, seed=0, adam_kernel="numpy"),
                             rt.world)
    await strategy.setup()
    try:
        losses = []
        for b_ in list(iter_local_batches(len(xs), 64, n, r, seed=0, epoch=0))[:6]:
            res = await strategy.train_step([(xs[b_.indices], ys[b_.indices], b_.offset, b_.global_size)])
            losses.append(float(getattr(res, "loss", float("nan"))))
        full = np.concatenate([p.ravel() for p in await strategy.full_params()]).astype(np.float64)
    finally:
        strategy.close()
    sums = np.zeros(2 * n, np.float64)
    sums[2 * r], sums[2 * r + 1] = full.sum(), float(np.abs(full).sum())
    await C.all_reduce(sums)
    assert np.all(sums[0::2] == sums[0]) and np.all(sums[1::2] == sums[1]), sums
    print(f"rank {r}: fsdp 6 steps, losses {[round(v, 4) for v in losses]}, params checksum {sums[0]:.6f} "
          f"equal on all {n} ranks", flush=True)
    await runtime.shutdown(rt)

asyncio.run(main())
'''


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def two_namespaces():
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    ns_a, ns_b = f"rwa{tag}", f"rwb{tag}"
    veth_a, veth_b = f"rwva{tag}", f"rwvb{tag}"
    subnet = f"10.{random.randrange(100, 200)}.{random.randrange(1, 250)}"
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        sh("ip", "link", "set", veth_a, "netns", ns_a)
        sh("ip", "link", "set", veth_b, "netns", ns_b)
        for ns, veth, host in ((ns_a, veth_a, 1), (ns_b, veth_b, 2)):
            sh("ip", "-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, f"{subnet}.1"
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert ns_a not in left and ns_b not in left, left


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["tcp", "shm+tcp"])
def test_two_nodes_in_two_namespaces(tmp_path, two_namespaces, path):
    ns_a, ns_b, master = two_namespaces
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = str(random.randrange(20000, 30000))
    env = dict(os.environ, PYTHONPATH=str(REPO), RINGWEAVE_SECRET="netns-test-" + os.urandom(8).hex(),
               RINGWEAVE_SHM="0" if path == "tcp" else "1")
    procs = []
    for node, ns in enumerate((ns_a, ns_b)):
        inner = (f"hostname rw-node-{node} && exec {sys.executable} -m runtime.launch -n 2 --nnodes 2 "
                 f"--node-rank {node} --master-addr {master} --master-port {port} --max-time-s 90 {script}")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", inner],
                                      cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=100))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    print(f"\n== two namespaces joined by a veth ({path}), master {master}:{port}")
    for node, ((out, err), p) in enumerate(zip(outs, procs)):
        for line in out.splitlines():
            print(f"   node {node} {line}")
        assert p.returncode == 0, f"node {node} exit {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    text = outs[0][0] + outs[1][0]
    for r in range(4):
        assert f"rank {r}: collectives ok across 2 node(s)" in text, text
        assert f"rank {r}: fsdp 6 steps" in text, text
