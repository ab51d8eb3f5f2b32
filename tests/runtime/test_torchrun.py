"""Under torchrun: workers that call runtime.init() or Communicator.from_env() meet in our own
store, never in torchrun's (which holds MASTER_PORT), under `--standalone`, a plain
`--nproc-per-node`, and two agents of a c10d rendezvous; the trainer runs there, and a torchrun
restart (`--max-restarts 1`) continues from the checkpoint and ends with the parameters of a run
that never failed. The first tests are pure: which port every worker derives, and what a taken
one says. The rest start the real torchrun, and are skipped where torch is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from runtime import rendezvous, scheduler
from runtime.errors import ConnectError
from runtime.rendezvous import TorchrunRendezvous

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
_beside = Path(sys.executable).with_name("torchrun")
TORCHRUN = str(_beside) if _beside.exists() else shutil.which("torchrun")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed (torch is an optional extra)")

# a worker of `torchrun --nnodes 2 --nproc-per-node 2` on the second node, as torch 2.13 sets it
NODE_1 = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
          "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "2", "MASTER_ADDR": "n01", "MASTER_PORT": "41863",
          "TORCHELASTIC_RUN_ID": "exp7", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
          "TORCHELASTIC_USE_AGENT_STORE": "True"}
NODE_0 = dict(NODE_1, RANK="0", GROUP_RANK="0", ROLE_RANK="0", TORCHELASTIC_RESTART_COUNT="0")


# -- pure: what every worker derives --------------------------------------------------------------------


def test_every_worker_derives_the_same_store_away_from_torchruns_port():
    seats = [rendezvous.from_env(environ).seat for environ in (NODE_0, NODE_1, dict(NODE_1, RANK="3", LOCAL_RANK="1"))]
    port = 15000 + zlib.crc32(b"exp7\x00n01\x0041863") % 10000
    assert {(s.master_addr, s.master_port, s.job, s.restart) for s in seats} == {("n01", port, "torchrun-exp7", 0)}
    assert [s.hosts_store for s in seats] == [True, False, False]  # rank 0: GROUP_RANK 0, LOCAL_RANK 0
    # torchrun's restart count is each agent's own (here 0 and 1): it must not split the job's keys
    assert seats[0].restart == seats[1].restart == 0
    assert "MASTER_PORT=41863 (torchrun's own store's)" in seats[0].port_source


def test_another_round_or_job_derives_another_port_and_the_override_wins():
    ports = {scheduler.torchrun_port(run_id, "n01", master_port)
             for run_id, master_port in (("exp7", 41863), ("exp8", 41863), ("exp7", 41864))}
    assert len(ports) == 3 and all(15000 <= p < 25000 for p in ports)
    seat = rendezvous.from_env(dict(NODE_0, RINGWEAVE_STORE_PORT="23456")).seat
    assert (seat.master_port, seat.port_source) == (23456, "RINGWEAVE_STORE_PORT")


def test_our_launcher_inside_torchrun_is_our_launcher_and_one_worker_is_alone():
    got = rendezvous.from_env(dict(NODE_1, RINGWEAVE_STORE_HOSTED="1"))
    assert type(got) is rendezvous.LauncherRendezvous and got.seat.master_port == 41863
    alone = rendezvous.from_env(dict(NODE_0, WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_WORLD_SIZE="1"))
    assert type(alone) is rendezvous.SingleRendezvous  # `torchrun --nproc-per-node 1`: no store to host


async def test_a_taken_store_port_names_the_variable_that_moves_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environ = dict(NODE_0, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_WORLD_SIZE="1", MASTER_ADDR="localhost",
                       RINGWEAVE_STORE_PORT=str(port))
        rdzv = rendezvous.from_env(environ, secret=b"s" * 32)
        assert type(rdzv) is TorchrunRendezvous
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port}: port {port} \\(RINGWEAVE_STORE_PORT\\) is in use.* set "
                                               f"RINGWEAVE_STORE_PORT to a free port"):
            await rdzv.next_rendezvous(5)
        await rdzv.shutdown()


# -- the real torchrun ------------------------------------------------------------------------------------

ALL_REDUCE = """
import asyncio, os, numpy as np, runtime, collectives
from runtime import rendezvous
async def main():
    kind, port = rendezvous.from_env().kind, rendezvous.from_env().seat.master_port
    rt = await runtime.init()
    x = np.full(5, rt.rank + 1, np.float64)
    await collectives.all_reduce(x)
    print(f"rank {rt.rank}/{rt.world_size} {kind} store {port} torchrun {os.environ['MASTER_PORT']} "
          f"sum {x.tolist()}", flush=True)
    await runtime.shutdown()
asyncio.run(main())
"""
BLOCKING = """
import os, numpy as np
from collectives import Communicator
with Communicator.from_env() as comm:
    x = np.arange(6, dtype=np.int64) * (comm.rank + 1)
    comm.all_reduce(x)
    print(f"rank {comm.rank}/{comm.world_size} sum {x.tolist()}", flush=True)
"""
LEFT_OUT = ("RINGWEAVE_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "SLURM_",
            "OMPI_", "PMI_")


def torchrun(tmp_path: Path, *args: str, **extra: str) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(LEFT_OUT)}
    environ.update(PYTHONPATH=str(ROOT), RINGWEAVE_KERNELS="numpy", **extra)
    return subprocess.Popen([TORCHRUN, *args], cwd=tmp_path, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 90) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def check_all_reduce(out: str, world_size: int) -> None:
    want = [float(world_size * (world_size + 1) // 2)] * 5
    for r in range(world_size):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"rank {r}/{world_size} ")), None)
        assert line is not None, out[-4000:]
        _, _, kind, _, ours, _, theirs, _, got = line.split(" ", 8)
        assert kind == "torchrun" and ours != theirs, line  # our own store, never torchrun's port
        assert json.loads(got) == want, line


@needs_torchrun
def test_standalone_torchrun_runs_init_and_an_all_reduce(tmp_path):
    out = finish(torchrun(tmp_path, "--standalone", "--nproc-per-node", "2", script(tmp_path, "ar.py", ALL_REDUCE)))
    check_all_reduce(out, 2)


@needs_torchrun
def test_plain_torchrun_runs_a_communicator_from_env(tmp_path):
    """The command of the failure: `torchrun --nproc-per-node 2 hello.py`, its store on MASTER_PORT."""
    out = finish(torchrun(tmp_path, "--nproc-per-node", "2", script(tmp_path, "hello.py", BLOCKING)))
    for r in range(2):
        assert f"rank {r}/2 sum {[3 * i for i in range(6)]}" in out, out[-4000:]


@needs_torchrun
def test_two_agents_of_a_c10d_rendezvous_run_an_all_reduce(tmp_path):
    """Two "nodes" on one host (--local-addr 127.0.0.1: MASTER_ADDR is loopback, so the job's
    secret is derived as on one host; across hosts RINGWEAVE_SECRET is needed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    path = script(tmp_path, "ar.py", ALL_REDUCE)
    agents = [torchrun(tmp_path, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", endpoint, "--rdzv-id", f"two-agents-{os.getpid()}", "--local-addr",
                       "127.0.0.1", path) for _ in range(2)]
    try:
        check_all_reduce("".join(finish(a) for a in agents), 2)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate()


# -- the trainer, and a torchrun restart ------------------------------------------------------------------

WRAPPER = r'''
import os, sys

import trainer.checkpoint
from trainer.cli import main

real_save = trainer.checkpoint.save


async def save(*args, **kwargs):  # in attempt 0, rank 1 exits 3 once the first checkpoint is committed
    path = await real_save(*args, **kwargs)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1" and os.environ["FAIL"] == "1":
        print(f"rank 1: exiting with 3 after saving {path.name}", flush=True)
        os._exit(3)
    return path

trainer.checkpoint.save = save
sys.exit(main(sys.argv[2:] + ["--checkpoint-dir", sys.argv[1]]))
'''
TRAIN_ARGS = ["--data", "synthetic", "--size", "320", "--in-dim", "8", "--classes", "4", "--width", "16",
              "--depth", "1", "--epochs", "1", "--batch-size", "32", "--master-dtype", "float64", "--param-dtype",
              "float64", "--reduce-dtype", "float64", "--adam-kernel", "numpy", "--checkpoint-every", "4",
              "--no-eval-train", "--log-every", "0", "--seed", "3"]  # 8 steps: checkpoints at 4 and 8


def train(tmp_path: Path, name: str, max_restarts: int) -> str:
    wrapper = script(tmp_path, "wrapper.py", WRAPPER)
    return finish(torchrun(tmp_path, "--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
                           wrapper, str(tmp_path / name), *TRAIN_ARGS, FAIL="1" if max_restarts else "0"))


def final_params(tmp_path: Path, name: str) -> dict[str, np.ndarray]:
    from trainer.checkpoint import export_npz_from_checkpoint, latest

    path = export_npz_from_checkpoint(latest(tmp_path / name), tmp_path / f"{name}.npz")
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A training run under torchrun that never fails: (its directory, its output)."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed (torch is an optional extra)")
    where = tmp_path_factory.mktemp("torchrun-train")
    return where, train(where, "uninterrupted", max_restarts=0)


@needs_torchrun
def test_the_trainer_runs_under_torchrun(uninterrupted):
    where, out = uninterrupted
    assert "ddp on 2 rank(s)" in out and "saved checkpoint" in out and "optimizer step 8, after epoch 1" in out, out
    assert "resumed from" not in out, out


@needs_torchrun
def test_a_torchrun_restart_resumes_and_ends_with_the_uninterrupted_parameters(tmp_path, uninterrupted):
    out = train(tmp_path, "restarted", max_restarts=1)
    assert "rank 1: exiting with 3 after saving step-00000004" in out, out[-4000:]
    # attempt 1 continued from the checkpoint, not from scratch (which would end equal too)
    assert "(optimizer step 4) (restart 1 of the run " in out and "TORCHELASTIC_RESTART_COUNT=1)" in out, out[-4000:]
    got, want = final_params(tmp_path, "restarted"), final_params(uninterrupted[0], "uninterrupted")
    assert sorted(got) == sorted(want) and want
    for name in want:
        assert np.array_equal(got[name], want[name]), name
