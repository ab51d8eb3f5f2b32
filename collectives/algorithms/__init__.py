"""The collective algorithms, one file each, in two folders by what carries their bytes:

* ``tcp/``: messages between ranks (``comm.send`` / ``irecv`` / ``sendrecv`` of the call, frames
  on the runtime's connections), so they run on any group: ring, tree, halving-doubling,
  recursive doubling, Bruck, direct, chain, flat, Rabenseifner, dissemination;
* ``shared_memory/``: the ranks of one host read each other's slots in /dev/shm (collectives/slots,
  runtime/sharedmem/), and move no TCP frame; ``all_reduce_hierarchical`` adds TCP among one leader per
  host. The registry runs them only where they can run (``registry.NEEDS``).

A file's stem is ``<collective>_<name>``, and ``name`` is its key in ``registry.ALGORITHMS``, the
word of ``algorithm=``, ``RINGWEAVE_ALGO_<COLLECTIVE>``, ``bench/collectives.py --algorithm`` and the
test ids (tests/tree/test_layout.py keeps that true). Each file opens with how the algorithm works
and exports ``async def run(comm, ...)``; ``comm`` is collectives/comm.py's ``Comm``.

Not here: choosing one (collectives/registry.py), the path of a call to it (collectives/calls.py), the
shared-memory machinery that is not an algorithm (collectives/slots/).
"""

__all__: list[str] = []  # reached through collectives.registry.ALGORITHMS

# All of it is machinery, imported only from inside collectives/ (tests/tree/test_surfaces.py).
_INTERNAL = ("tcp", "shared_memory")
