"""A job for the elastic tests: ``python -m runtime.launch [--elastic MIN:MAX] -n N elastic_job.py OUT``.

A tiny float64 MLP on synthetic data, 2 epochs of global batch 24 (20 steps), strategy EL_STRATEGY
(ddp). The test's hooks (fault_points.py, here only): EL_FAULTS="SLOT:POINT@STEP,..." makes the
first process of a slot SIGKILL (or SIGSTOP) itself at a chosen point of a step, after writing
OUT/fault-SLOT; EL_KILL_RANK / EL_KILL_STEP is "RANK:read@STEP". EL_STEP_S sleeps that long per
step. EL_HOLD_S: while the job is smaller than the launcher's -n, the members wait at a step
boundary (at most that long) until a joiner registers, so the job grows back before its last step
whatever the machine's load. EL_CKPT=K: a checkpoint every K steps under OUT/ckpt. The final rank 0
writes the parameters to OUT/params.npy; every process prints its member id when done, and when
its first step after a loss completed.
"""

import asyncio
import glob
import os
import sys
import time
import types

import numpy as np

import runtime
from runtime import env
from runtime import elastic
from trainer.data import ArrayDataset, make_synthetic
from trainer.elastic import ElasticJob
from trainer.loop import fit
from trainer.nn import mlp
from trainer.sharding import make_strategy
from trainer.sharding.base import TrainConfig
from trainer.sharding.ddp import DDPStrategy

from fault_points import Faults

OUT = sys.argv[1]
if os.environ.get("EL_KILL_RANK"):
    os.environ["EL_FAULTS"] = f"{os.environ['EL_KILL_RANK']}:read@{os.environ['EL_KILL_STEP']}"
FAULTS = Faults(OUT)
STEP_S = float(os.environ.get("EL_STEP_S", "0"))
HOLD_S = float(os.environ.get("EL_HOLD_S", "0"))
STRATEGY = os.environ.get("EL_STRATEGY", "ddp")
FULL = int(os.environ.get("WORLD_SIZE", "1"))


class Hooked(ArrayDataset):
    def get(self, indices, epoch=0):
        time.sleep(STEP_S)
        FAULTS.on_read()
        return super().get(indices, epoch)


class CheckedDDP(DDPStrategy):
    """Says whether this member's parameters already equalled new rank 0's when the job re-formed:
    a step that raised changed no state on any survivor (the strategy's contract)."""

    async def reshard(self, group, lost=None, **kw):
        before = np.concatenate([m[: u.numel] for m, u in zip(self.master, self.units)])
        await super().reshard(group, lost, **kw)
        if kw.get("joining"):
            return
        after = np.concatenate([m[: u.numel] for m, u in zip(self.master, self.units)])
        print(f"reshard: parameters equal to new rank 0's: {bool(np.array_equal(before, after))}", flush=True)


def hold_for_joiners(el: ElasticJob) -> None:
    """The members ask at every step boundary whether joiners wait (``rdzv.joiners_waiting``): while
    the job is smaller than at its start, that question waits (at most EL_HOLD_S) for one."""
    ask = el.rdzv.joiners_waiting

    async def joiners_waiting() -> int:
        until = time.monotonic() + HOLD_S
        while not (waiting := await ask()) and el.rt.world_size < FULL and time.monotonic() < until:
            await asyncio.sleep(0.05)
        return waiting
    el.rdzv.joiners_waiting = joiners_waiting


async def main():
    x, y = make_synthetic(260, in_dim=6, num_classes=3, seed=2, dtype=np.float64)
    data = types.SimpleNamespace(train=Hooked(x[:240], y[:240]), val=ArrayDataset(x[240:], y[240:]))
    config = TrainConfig(lr=1e-2, warmup_steps=0, total_steps=20, seed=1, master_dtype="float64",
                         param_dtype="float64", reduce_dtype="float64")
    rdzv = elastic.from_env()
    rt = await runtime.init(rendezvous=rdzv)
    el = ElasticJob(rdzv, rt) if env.ELASTIC.get() else None
    if el is not None and HOLD_S:
        hold_for_joiners(el)
    model, extra = mlp(6, (8,), 3, dtype=np.float64), {"redundancy": el.redundancy()} if el else {}
    strategy = (CheckedDDP(model, config, rt.world, **extra) if STRATEGY == "ddp"
                else make_strategy(STRATEGY, model, config, rt.world, **extra))
    FAULTS.arm(strategy)
    every = int(os.environ.get("EL_CKPT", "0"))
    ckpt = {"checkpoint_dir": os.path.join(OUT, "ckpt"), "checkpoint_every": every} if every else {}
    try:
        await strategy.setup()
        await fit(strategy, data, config, epochs=2, global_batch_size=24, eval_train=False, elastic=el,
                  print_summary=False, log_every=0, **ckpt)
        params = np.concatenate(await strategy.full_params())
        final = el.rt if el else rt
        if final.rank == 0:
            np.save(os.path.join(OUT, "params.npy"), params)
        if el is not None and el.resumed_at is not None:
            killed = min(float(open(p).read().split()[1]) for p in glob.glob(os.path.join(OUT, "fault-*")))
            print(f"first step after the loss: {el.resumed_at - killed:.3f} s after the kill "
                  f"(generation {final.generation}, {final.world_size} ranks)", flush=True)
        if el is not None and el.reforms:
            print(f"re-formed {el.reforms} time(s)", flush=True)
        print(f"member done: {env.MEMBER.get() or '-'}, generation {final.generation}, rank {final.rank} of "
              f"{final.world_size}", flush=True)
    finally:
        strategy.close()
        await runtime.shutdown()
        await rdzv.shutdown()


asyncio.run(main())
