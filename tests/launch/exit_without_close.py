"""A rank program that makes a Communicator, does one all_reduce and exits without close(), as
torch users often leave their process group (run: python -m runtime.launch -n 2 this_file).

It also checks, in the last exit hook of the interpreter, that no ringweave event-loop thread is
still running then: a loop left running into the interpreter's teardown (uvloop, in C) calls back
into a finalized interpreter when a peer's exit wakes one of its sockets, and the process dies of
SIGSEGV after its last line, in a run out of ten or twenty. The check makes that cause show in
every run: exit code 3 and a line naming the threads.
"""

import atexit
import os
import threading


def loop_threads_gone():
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("ringweave"))
    if left:
        print(f"loop threads still running at the last exit hook: {left}", flush=True)
        os._exit(3)


atexit.register(loop_threads_gone)  # registered before anything of ringweave: runs after their exit hooks

import numpy as np  # noqa: E402

from collectives import Communicator  # noqa: E402

comm = Communicator.from_env()
x = np.full(4, comm.rank, np.float32)
comm.all_reduce(x)
assert (x == comm.world_size * (comm.world_size - 1) / 2).all(), x
print(f"rank {comm.rank}: ok", flush=True)
