"""Shared memory between the ranks of one host, in three modules:

* ``segments``: the /dev/shm files, their unguessable names, creating, mapping and unlinking them
  under the rules that keep another local user out, and clean-up after a job;
* ``domains``: the members of one group on one host, the segments each owns and all map, how they
  agree on them over the call's TCP messages, the order of their calls, when the segments go;
* ``waits``: the words of each member's control header, posting a phase and waiting for the
  peers' (spin, then futex sleeps in slices), what wakes a wait and what ends it.

Imports point one way: ``domains`` uses ``segments`` and ``waits``, which know nothing of each
other. Bytes only: the arrays and algorithms over these slots are collectives/slots/ and
collectives/algorithms/shared_memory/. The protocol in depth: docs/design.md, "The shared-memory protocol".
"""

__all__: list[str] = []  # the modules are imported by name (runtime.sharedmem.domains, ...)
