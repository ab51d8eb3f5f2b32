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

Figures: 4 ranks on this 2-core machine (quiet), float32 sum, medians of the slowest rank;
ratios are OpenMPI's time / ours in the SAME run (>1: ours faster).

``python bench/collectives.py -n 4 --ops all_reduce,barrier --shm on --compare mpi --iters 30``
(ringweave and OpenMPI 4.1.4 over vader interleaved in the same processes), 2026-11-22, after
the per-call overheads were cut and the small calls stopped posting EXIT; copies still streamed
from 1 MiB then (now from 4 MiB: common.py STREAM_MIN_NBYTES):

    size     shm time   busbw      x mpi-sm
    4 B       85.8 us     -         0.21     (OpenMPI 18.2 us: it spins)
    1 MiB    0.91 ms   1.72 GB/s    1.54
    16 MiB   5.79 ms   4.35 GB/s    1.54
    64 MiB   20.8 ms   4.84 GB/s    3.69     (one-core copy 11.4 GB/s: 42 %)
    barrier  50.9 us                0.11

Three more runs (``--sizes 4,1M,16M,64M``): 4 B 92-96 us; 1 MiB 1.01-1.73x; 16 MiB 1.41-1.53x;
64 MiB 3.62-3.71x. The three full sweeps after the 4 MiB threshold and the benchmark's warm-up:
4 B 89.5-93.3 us, 1 MiB 1.06 / 1.07 / 0.72x, 16 MiB 1.39-1.48x, 64 MiB 3.75-3.79x. The machine has slow periods in which both libraries slow down (OpenMPI's
4 B 25-28 us); runs in one, before the last changes, gave 4 B 125-206 us and 1 MiB 0.72-0.80x.
The first version of this file measured 4 B at 557-602 us, 1 MiB 0.72x, 16 MiB 1.15x.

Where the time goes. Per rank, a large all_reduce moves ~4.5 x its size through memory (copy
in 3/4, fold 4/4 read + 1/4 written twice, copy out 3/4), the minimum for private input and
output buffers; on two cores four ranks share ~2 cores' bandwidth, and copies of 4 MiB and up
use non-temporal stores (all_reduce_shm). A small call is CPU-bound: ~30 us of Python per rank
and call, and two ranks per core (runtime/shm.py, "Later"); the protocol alone, without the
framework, takes 32-35 us per call (``python bench/floor.py -n 4``, mode bare-shm). OpenMPI busy-polls, which the issue rules out.
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
