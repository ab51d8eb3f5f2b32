"""Collectives over shared memory, for the ranks of a group that share a machine.

Algorithms (one file each, the same signatures as the TCP ones; registry key in brackets):

* ``all_reduce_shm`` [shm]: one copy in, a parallel reduce-scatter by reading the peers'
  slots, one copy out; a one-phase variant for messages up to 64 KiB.
* ``all_gather_shm``, ``reduce_scatter_shm``, ``broadcast_shm``, ``barrier_shm`` [shm].
* ``all_reduce_hierarchical`` [hierarchical]: for groups spanning nodes: shm inside each
  node, TCP among one leader per node, shm again to spread the result.

Each falls back by itself when shared memory cannot serve the group (ranks on several nodes,
``RINGWEAVE_SHM=0``, ``group.shm_enabled = False``, /dev/shm not writable): ``all_reduce``
to the hierarchical algorithm, which falls back to the TCP table's choice; the others to the
TCP table's choice. Every rank of a group decides the same, from the same facts.

Segments, naming, clean-up and the wait/wake primitive are in runtime/shm.py.

Figures: 4 ranks on this 2-core machine, which other jobs shared (load 5-10), float32 sum,
medians; ratios are peer time / ours in the SAME run (>1: ours faster).

``python bench/collectives.py -n 4 --ops all_reduce,barrier --sizes 4,1M,16M,64M --compare gloo,mpi
--iters 15`` (ringweave, Gloo and OpenMPI 4.1.4 over vader in the same processes), load ~5:

    size     shm time   busbw      x gloo   x mpi-sm
    4 B       602 us      -         5.95     0.16     (OpenMPI 94 us: it spins)
    1 MiB    1.16 ms   1.36 GB/s    8.01     0.72
    16 MiB   11.3 ms   2.23 GB/s    2.88     1.15
    64 MiB   42.6 ms   2.36 GB/s    2.75     2.42     (one-core copy 10.6 GB/s: 22%)
    barrier   332 us                2.72     0.06

The same bench in busier moments (load 8-10) gave 64 MiB at 3.15x and 3.89x OpenMPI, 16 MiB at
0.72x and 0.80x, 1 MiB at 0.54x and 0.23x, 4 B at 0.10-0.18x: everything below 64 MiB swings
with the other jobs (noise 25-140 %).

``python -m runtime.launch -n 4 tests/shm/bench_allreduce.py`` (shm vs the TCP table's choice
interleaved, CPU time per call of the slowest rank; load ~6; one-core copy 3.1 GB/s then):

    size     shm               tcp                 busbw shm / fraction of one-core copy
    4 B       557 us (145 us CPU)   1264 us (322 us CPU)
    1 MiB    2.20 ms (0.64 ms)     7.26 ms (2.2 ms)     0.71 GB/s  23 %
    16 MiB   13.6 ms (6.1 ms)      40.3 ms (22 ms)      1.85 GB/s  60 %
    64 MiB   43.5 ms (22 ms)        164 ms (81 ms)      2.32 GB/s  75 %

Where the time goes. Per rank, a large all_reduce moves ~4.5 x its size through memory (copy
in 3/4, fold 4/4 read + 1/4 written twice, copy out 3/4), the minimum for private input and
output buffers; on two cores four ranks share ~2 cores' bandwidth. A small one costs ~150 us of
CPU per rank and call (~15 us of it the public API, the rest the call's bookkeeping in
runtime.group and here, the fence and the futex sleep/wake), so with 4 ranks on 2 cores and
other jobs running it cannot get near OpenMPI's busy-polling 94 us without spinning, which
the issue rules out. The 4 B goal (100 us) is not met.
"""

from collectives.shm import (all_gather_shm, all_reduce_hierarchical, all_reduce_shm, barrier_shm,
                             broadcast_shm, reduce_scatter_shm)
from collectives.shm.common import shm_available

ALGORITHMS = {
    "all_reduce": {"shm": all_reduce_shm.run, "hierarchical": all_reduce_hierarchical.run},
    "all_gather": {"shm": all_gather_shm.run},
    "reduce_scatter": {"shm": reduce_scatter_shm.run},
    "broadcast": {"shm": broadcast_shm.run},
    "barrier": {"shm": barrier_shm.run},
}

__all__ = ["ALGORITHMS", "shm_available"]
