"""A rank lost in any dimension of the mesh fails every other rank with PeerLostError naming it within
seconds: its tp peer (waiting in a tensor-parallel all-reduce), its pipeline neighbours (waiting on a
point-to-point receive, which no group failure reaches: the mesh cancels it), its dp peer, and the
ranks that share no group but the world with it (waiting on a live rank that waits on it).

In process, over real loopback sockets: the leaving rank aborts its connections in the middle of
step 2 while every other rank is inside the step. tests/parallel/test_mesh_launcher.py kills a rank
with SIGKILL under the real launcher.
"""

import asyncio
import time

import pytest

from mesh_cases import CONFIG, make_config, step_batches
from runtime.errors import PeerLostError
from runtime.testing import run_ranks
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy

BOUND_S = 5.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mesh, leaver", [({"tp": 2, "pp": 2}, 3), ({"tp": 2, "pp": 2}, 0), ({"dp": 2, "pp": 2}, 1)],
                         ids=["tp2pp2-last-stage", "tp2pp2-first-stage", "dp2pp2"])
async def test_a_rank_lost_mid_step_fails_every_rank_naming_it(mesh, leaver):
    async def body(world):
        m = Mesh(world, **mesh)
        s = make_parallel_strategy("zero1", CONFIG, make_config(), m,
                                   parallel=ParallelConfig(schedule="1f1b", micro_batches=4))
        try:
            await s.setup()
            batches = step_batches(m.shape["dp"], m.coords["dp"], 1)
            await s.train_step(batches[0])
            if world.rank == leaver:
                await asyncio.sleep(0.3)  # the others are inside step 2, waiting on this rank
                for conn in list(world.runtime.actor.conns.values()):
                    conn.abort()
                return None
            start = time.monotonic()
            with pytest.raises(PeerLostError) as info:
                await s.train_step(batches[1])
            return time.monotonic() - start, str(info.value), m.coords
        finally:
            s.close()

    for rank, out in enumerate(await run_ranks(4, body, transport="tcp", timeout_s=30)):
        if rank == leaver:
            continue
        seconds, message, coords = out
        assert seconds < BOUND_S, (rank, seconds)
        assert f"rank {leaver}" in message, (rank, coords, message)
