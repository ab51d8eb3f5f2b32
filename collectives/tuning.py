"""Sizes that shape the TCP algorithms' messages, shared by several algorithm files.

One constant per line, each with its reason and the measurement behind it. Constants that only
one algorithm uses stay in its file (``EXCHANGE_NBYTES``, ...), the sizes that choose an algorithm
in the selection table (collectives/registry.py), and the runtime's settings (``RINGWEAVE_*``) in
runtime/env.py.
"""

from __future__ import annotations

# One message of the segmented algorithms (ring and halving-doubling all_reduce, ring all_gather and
# reduce_scatter): the transport's SO_RCVLOWAT wakes a receiver per few MiB, so 4 MiB gave the best
# busbw at 4-64 MiB (bench/results/transport.md#segments-and-so_rcvlowat).
SEGMENT_NBYTES = 4 << 20

# The largest receive scratch one call posts ahead into (ring and halving-doubling all_reduce): past
# it a call waits for one step's scratch to be reduced before posting the next (memory, not speed).
SCRATCH_NBYTES = 64 << 20
