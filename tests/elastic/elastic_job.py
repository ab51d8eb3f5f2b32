"""A job for the elastic tests: ``python -m runtime.launch [--elastic MIN:MAX] -n 3 elastic_job.py OUT``.

A tiny float64 MLP on synthetic data, 2 epochs of global batch 24, strategy EL_STRATEGY (ddp). The test's hook (here only, in
the data set the loop reads): with EL_KILL_RANK and EL_KILL_STEP set, that rank of the first
processes SIGKILLs itself when it reads step EL_KILL_STEP's batch, after writing the time to
OUT/kill; EL_STEP_S sleeps that long per step so a joiner can come while the job runs. The final
rank 0 writes the parameters to OUT/params.npy; every process prints when its first step after a
loss completed, and how long after the kill.
"""

import asyncio
import os
import signal
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

OUT = sys.argv[1]
KILL_RANK, KILL_STEP = int(os.environ.get("EL_KILL_RANK", "-1")), int(os.environ.get("EL_KILL_STEP", "-1"))
STEP_S = float(os.environ.get("EL_STEP_S", "0"))
STRATEGY = os.environ.get("EL_STRATEGY", "ddp")
JOINER = env.ELASTIC_JOIN.get()


class Hooked(ArrayDataset):
    reads = 0

    def get(self, indices, epoch=0):
        Hooked.reads += 1
        time.sleep(STEP_S)
        if not JOINER and int(os.environ["RANK"]) == KILL_RANK and Hooked.reads == KILL_STEP + 1:
            with open(os.path.join(OUT, "kill"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
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


async def main():
    x, y = make_synthetic(260, in_dim=6, num_classes=3, seed=2, dtype=np.float64)
    data = types.SimpleNamespace(train=Hooked(x[:240], y[:240]), val=ArrayDataset(x[240:], y[240:]))
    config = TrainConfig(lr=1e-2, warmup_steps=0, total_steps=20, seed=1, master_dtype="float64",
                         param_dtype="float64", reduce_dtype="float64")
    rdzv = elastic.from_env()
    rt = await runtime.init(rendezvous=rdzv)
    el = ElasticJob(rdzv, rt) if env.ELASTIC.get() else None
    model, extra = mlp(6, (8,), 3, dtype=np.float64), {"redundancy": el.redundancy()} if el else {}
    strategy = (CheckedDDP(model, config, rt.world, **extra) if STRATEGY == "ddp"
                else make_strategy(STRATEGY, model, config, rt.world, **extra))
    try:
        await strategy.setup()
        await fit(strategy, data, config, epochs=2, global_batch_size=24, eval_train=False, elastic=el,
                  print_summary=False, log_every=0)
        params = np.concatenate(await strategy.full_params())
        final = el.rt if el else rt
        if final.rank == 0:
            np.save(os.path.join(OUT, "params.npy"), params)
        if el is not None and el.resumed_at is not None:
            killed = float(open(os.path.join(OUT, "kill")).read())
            print(f"first step after the loss: {el.resumed_at - killed:.3f} s after the kill "
                  f"(generation {final.generation}, {final.world_size} ranks)", flush=True)
        if el is not None and el.reforms:
            print(f"re-formed {el.reforms} time(s)", flush=True)
        print(f"member done: generation {final.generation}, rank {final.rank} of {final.world_size}", flush=True)
    finally:
        strategy.close()
        await runtime.shutdown()
        await rdzv.shutdown()


asyncio.run(main())
