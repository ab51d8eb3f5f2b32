"""A rank that says what the runtime made of its launcher's environment: one JSON line on
stdout after an all_reduce of the ranks (the sum proves they met). With ``--wait`` it then
prints "ready" and stays in the job for two minutes, in a barrier every half second
(for kill and status tests: a rank that loses a peer raises PeerLostError)."""

import asyncio
import json
import os
import sys

import numpy as np
from threadpoolctl import threadpool_info

import collectives
import runtime


async def main():
    rt = await runtime.init()
    total = np.array([rt.rank], np.int64)
    await collectives.all_reduce(total)
    env = runtime.read_env()
    print(json.dumps({
        "rank": rt.rank, "world_size": rt.world_size, "local_rank": rt.local_rank,
        "local_world_size": rt.local_world_size, "sum": int(total[0]), "pid": os.getpid(),
        "hosts_store": rt.rendezvous.hosts_store, "master_addr": env["master_addr"],
        "master_addr_source": env["master_addr_source"], "master_port": env["master_port"], "job": env["job"],
        "restart": env["restart"], "launcher": env["launcher"],
        "node": os.environ.get("SLURMD_NODENAME") or os.environ.get("OMPI_MCA_orte_local_daemon_uri", "")[:12],
        "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                   "NUMBA_NUM_THREADS")},
        "blas_threads": sorted({lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}),
    }), flush=True)
    if "--wait" in sys.argv:  # in the job, meeting the others every half second (a lost one is an error)
        print("ready", flush=True)
        for _ in range(240):
            await asyncio.sleep(0.5)
            await collectives.barrier()
    await runtime.shutdown()


runtime.run(main())
