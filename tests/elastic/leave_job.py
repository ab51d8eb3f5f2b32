"""A job for the graceful-leave and SLURM tests: ``leave_job.py OUT`` under ``python -m runtime.launch
[--elastic MIN:MAX] -n N`` or ``srun`` (RINGWEAVE_ELASTIC and a store of its own).

A tiny float64 MLP on synthetic data, 2 epochs of global batch 24 (20 steps), strategy EL_STRATEGY
(ddp), inside a Preemption scope as ``python -m trainer`` has. The test's hooks (here only, in the
data set the loop reads), each keyed by the process's first rank, firing when it reads the batch of
step EL_AT_STEP (mid-step) in the first attempt's first processes: EL_TERM_RANKS="1,2" send themselves SIGTERM (and
write the time to OUT/term); EL_KILL_RANKS SIGKILL themselves. EL_CHECKPOINT=1 checkpoints to
OUT/ckpt every 2 steps and, as python -m trainer, falls back to it when a shard has no copy left. Membership's settle wait is EL_SETTLE_S (default 60 s), so
survivors that waited for a member instead of being told it left would show it. Every process
prints how it ended: "left: ...", "stopped: ..." (Preempted: exits with its code), or "member done:
generation G, rank R of N" and, after a leave, "shrunk step: S s after the signal"; the final rank 0
writes the parameters to OUT/params.npy.
"""

import asyncio
import os
import signal
import sys
import time
import types

import numpy as np

import runtime
from runtime import elastic, env
from trainer import checkpoint_fallback as fallback
from trainer.data import ArrayDataset, make_synthetic
from trainer.elastic import ElasticJob
from trainer.loop import fit
from trainer.nn import mlp
from trainer.preempt import Left, Preempted, Preemption
from trainer.sharding import make_strategy
from trainer.sharding.base import TrainConfig

OUT = sys.argv[1]
AT_STEP = int(os.environ.get("EL_AT_STEP", "4"))
TERM = {int(r) for r in os.environ.get("EL_TERM_RANKS", "").split(",") if r}
KILL = {int(r) for r in os.environ.get("EL_KILL_RANKS", "").split(",") if r}
# the hooks fire in the first attempt's first processes only (not in a joiner, not after a restart)
FIRST_ATTEMPT = env.RESTART.get() == 0 and not env.ELASTIC_JOIN.get()
CKPT = os.path.join(OUT, "ckpt") if os.environ.get("EL_CHECKPOINT") else None
STRATEGY = os.environ.get("EL_STRATEGY", "ddp")
FIRST_RANK = -1  # this process's rank in generation 0 (set after init)


class Hooked(ArrayDataset):
    reads = 0

    def get(self, indices, epoch=0):
        Hooked.reads += 1
        if Hooked.reads == AT_STEP + 1 and FIRST_RANK in TERM and FIRST_ATTEMPT:
            with open(os.path.join(OUT, "term"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)  # noted by the Preemption scope; the step goes on
        if Hooked.reads == AT_STEP + 1 and FIRST_RANK in KILL and FIRST_ATTEMPT:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().get(indices, epoch)


class Sizes:
    """Each step's end time and world size (a step callback)."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, state):
        self.seen.append((time.time(), state.world_size))


async def main():
    global FIRST_RANK
    x, y = make_synthetic(260, in_dim=6, num_classes=3, seed=2, dtype=np.float64)
    data = types.SimpleNamespace(train=Hooked(x[:240], y[:240]), val=ArrayDataset(x[240:], y[240:]))
    config = TrainConfig(lr=1e-2, warmup_steps=0, total_steps=20, seed=1, master_dtype="float64",
                         param_dtype="float64", reduce_dtype="float64")
    rdzv = elastic.from_env()
    if isinstance(rdzv, elastic.ElasticRendezvous):
        rdzv.settle_s = float(os.environ.get("EL_SETTLE_S", "60"))
    rt = await runtime.init(rendezvous=rdzv)
    FIRST_RANK = rt.rank
    el = ElasticJob(rdzv, rt) if env.ELASTIC.get() else None
    model, extra = mlp(6, (8,), 3, dtype=np.float64), {"redundancy": el.redundancy()} if el else {}
    strategy = make_strategy(STRATEGY, model, config, rt.world, **extra)
    sizes = Sizes()
    code = 0
    try:
        await strategy.setup()
        with Preemption():
            await fit(strategy, data, config, epochs=2, global_batch_size=24, eval_train=False, elastic=el,
                      print_summary=False, log_every=0, callbacks=[sizes], checkpoint_dir=CKPT, checkpoint_every=2)
        params = np.concatenate(await strategy.full_params())
        final = el.rt if el else rt
        if final.rank == 0:
            np.save(os.path.join(OUT, "params.npy"), params)
        shrunk = [t for t, n in sizes.seen if n < rt.world_size]
        if shrunk and os.path.exists(os.path.join(OUT, "term")):
            with open(os.path.join(OUT, "term")) as f:
                signalled = float(f.read())
            print(f"shrunk step: {shrunk[0] - signalled:.3f} s after the signal", flush=True)
        print(f"member done: generation {final.generation}, rank {final.rank} of {final.world_size}", flush=True)
    except Left as exc:
        print(f"left: {exc}", flush=True)
    except Preempted as exc:
        print(f"stopped: {exc}", flush=True)
        code = exc.exit_code
    except Exception as exc:  # as python -m trainer: no copy of a shard left, restart from the checkpoint
        lost = fallback.lost_without_copy(exc, layout=None) if el and CKPT else None
        if lost is None:
            raise
        if fallback.speaks(el.rt.rank, []):
            print(fallback.line(lost, exc, None, CKPT, strategy.step), flush=True)
        code = fallback.FALLBACK_EXIT
    finally:
        strategy.close()
        await runtime.shutdown(el.rt if el else rt)
        await rdzv.shutdown()
    return code


sys.exit(asyncio.run(main()))
