"""The algorithms for ranks that share a host, over shared-memory slots (collectives/slots,
runtime/sharedmem/), one file each; the same signatures as the TCP ones (registry key in brackets):

* ``all_reduce_shm`` [shm]: one copy in, a parallel reduce-scatter by reading the peers' slots, one
  copy out; one phase for messages up to 64 KiB.
* ``all_gather_shm``, ``reduce_scatter_shm``, ``broadcast_shm``, ``barrier_shm`` [shm].
* ``all_reduce_hierarchical``, ``all_gather_hierarchical``, ``reduce_scatter_hierarchical``
  [hierarchical]: for groups spanning hosts: shared memory inside each host, TCP between hosts (each
  byte crosses into a host once), shared memory again to spread the result.

None decides for itself whether it can run: the registry (``NEEDS`` and the tables) runs "shm" only
where every rank of the group is on one host and shared memory is on (``RINGWEAVE_SHM`` not ``"0"``
on every rank, ``group.shm_enabled``, /dev/shm writable), "hierarchical" only where shared memory is
on; elsewhere the table's choice runs, and the call's fingerprint and trace name it. Every rank
decides the same, from the same facts. The protocol: docs/design.md, "The shared-memory protocol";
measurements: bench/results/shm.md#beside-openmpi.
"""

__all__: list[str] = []  # reached through collectives.registry.ALGORITHMS
