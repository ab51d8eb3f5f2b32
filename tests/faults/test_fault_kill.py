"""A rank killed with SIGKILL in the middle of a collective, through the real launcher.

Each case: 4 ranks; rank 2 kills itself (after writing the instant of the
fault) while every rank is inside the collective. Every other rank must raise
PeerLostError naming rank 2 within 5 s, the launcher must exit non-zero naming
rank 2 and SIGKILL, and no process of the job may be left. Each case runs
over TCP only (RINGWEAVE_SHM=0) and with the same-host shared-memory path
(the default, which serves these collectives on one machine). Run with ``-s``
to see the per-rank times.
"""

from __future__ import annotations

import math

import pytest

from tests.faults.harness import assert_no_process_left, launch

VICTIM = 2
BOUND_S = 5.0

ALL_REDUCE_64MIB = r'''
import collectives.comm as comm
import collectives.slots.memops as memops

def die_in_first_reduction():
    """Rank 2 dies at its first reduction of the timed all_reduce: it has sent (TCP) or published
    (shared memory) its input, and the others still need what it would reduce. (A timer 5 ms into
    the call raced: a rank's whole part of a 64 MiB shared-memory all_reduce can be done by then,
    and the others finished without it.)"""
    def reduce_now(*args, **kw):  # every TCP algorithm reduces through the Comm's reduce step
        die()
    comm.reduce_now = reduce_now
    def reduce_publish(*args, **kw):
        die()
    memops.reduce_publish = reduce_publish

async def body(rt):
    x = np.full(16 * 1024 * 1024, RANK + 1.0, np.float32)  # 64 MiB
    await C.all_reduce(x)                     # warm: kernels loaded, buffers and pools allocated
    x.fill(RANK + 1.0)
    await C.barrier()
    if RANK == 2:
        die_in_first_reduction()
    await C.all_reduce(x)
    raise SystemExit(f"rank {RANK}: the all_reduce finished without rank 2")

run(body)
'''

BARRIER = r'''
async def body(rt):
    x = np.ones(4, np.float32)
    await C.all_reduce(x)                     # everyone is connected and running
    if RANK == 2:
        # A barrier lasts as long as its last rank takes to arrive: rank 2 dies while
        # the others wait inside it (when it entered too, its first messages could
        # already complete the others' part, and nobody would be left waiting).
        await asyncio.sleep(0.5)
        print(f"rank 2: dying while the others wait in the barrier", flush=True)
        die()
    await C.barrier()
    raise SystemExit(f"rank {RANK}: the barrier finished without rank 2")

run(body)
'''

FSDP_STEP = r'''
import collectives
from trainer.data import iter_local_batches, make_synthetic
from trainer.nn import mlp
from trainer.sharding import TrainConfig, make_strategy

KILL_STEP = 2
step_now = [0]
if RANK == 2:
    import collectives.api
    real = collectives.api.reduce_scatter

    async def reduce_scatter(*a, **kw):       # the first gradient reduce-scatter of step 2:
        if step_now[0] == KILL_STEP:          # forward done, backward half way
            print(f"rank 2: dying in the backward of step {KILL_STEP}", flush=True)
            die()
        return await real(*a, **kw)
    collectives.reduce_scatter = reduce_scatter


async def body(rt):
    world = rt.world
    x, y = make_synthetic(512, in_dim=32, num_classes=4, seed=1)
    model = mlp(32, (64, 64), 4, pad_to=world.size)
    strategy = make_strategy("fsdp", model, TrainConfig(strategy="fsdp", lr=1e-2, seed=0, adam_kernel="numpy"),
                             world)
    await strategy.setup()
    try:
        batches = list(iter_local_batches(len(x), 64, world.size, world.rank, seed=0, epoch=0))
        for step, b in enumerate(batches):
            step_now[0] = step
            await strategy.train_step([(x[b.indices], y[b.indices], b.offset, b.global_size)])
    finally:
        strategy.close()
    raise SystemExit(f"rank {RANK}: training finished without rank 2")

run(body)
'''

CASES = {"all_reduce_64MiB": ALL_REDUCE_64MIB, "barrier": BARRIER, "fsdp_step": FSDP_STEP}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["tcp", "shm"])
@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_mid_collective(tmp_path, case, path):
    env = {"RINGWEAVE_SHM": "0" if path == "tcp" else "1"}
    result = launch(tmp_path, CASES[case], env=env, timeout_s=45)
    result.show(f"SIGKILL of rank {VICTIM} in the middle of {case} ({path})")
    assert result.returncode == 128 + 9, result.explain()
    assert f"rank {VICTIM} failed first: signal SIGKILL" in result.stderr, result.explain()
    survivors = [r for r in range(4) if r != VICTIM]
    assert sorted(result.reports) == survivors, result.explain()
    for r in survivors:
        rep = result.reports[r]
        assert rep.error == "PeerLostError", (r, rep, result.explain())
        assert f"rank {VICTIM}" in rep.message, (r, rep.message)
        assert not math.isnan(rep.after_s) and rep.after_s < BOUND_S, (r, rep)
    assert_no_process_left(result)
