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

Measurements (beside OpenMPI over shared memory, where the time goes, the protocol's costs):
bench/results/shm.md#beside-openmpi.
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
