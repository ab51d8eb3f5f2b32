"""Collectives over shared memory, for the ranks of a group that share a host.

Algorithms (one file each, the same signatures as the TCP ones; registry key in brackets):

* ``all_reduce_shm`` [shm]: one copy in, a parallel reduce-scatter by reading the peers'
  slots, one copy out; a one-phase variant for messages up to 64 KiB.
* ``all_gather_shm``, ``reduce_scatter_shm``, ``broadcast_shm``, ``barrier_shm`` [shm].
* ``all_reduce_hierarchical`` [hierarchical]: for groups spanning hosts: shm inside each
  host, TCP among one leader per host, shm again to spread the result.

None decides for itself whether it can run: the registry (collectives/registry.py, ``NEEDS``
and the tables) runs "shm" only where every rank of the group is on one host and shared memory
is on (``RINGWEAVE_SHM`` not ``"0"`` on every rank, ``group.shm_enabled``, /dev/shm writable),
"hierarchical" only where shared memory is on; elsewhere the table's choice runs, and the
call's fingerprint and trace name it. Every rank decides the same, from the same facts.

Segments, naming, clean-up and the wait/wake primitive are in runtime/shm.py; what the
algorithms share in common.py.

Measurements (beside OpenMPI over shared memory, where the time goes, the protocol's costs):
bench/results/shm.md#beside-openmpi.
"""

__all__: list[str] = []  # the algorithms are reached through collectives.registry.ALGORITHMS

# All of it is machinery, imported only from inside collectives/ (tests/tree/test_surfaces.py).
_INTERNAL = ("all_gather_shm", "all_reduce_hierarchical", "all_reduce_shm", "atomics", "barrier_shm", "broadcast_shm",
             "common", "fastpath", "kernels", "reduce_scatter_shm")
