"""One rank fails in the third step of a torch training loop on the "ringweave" backend; the other
must see an exception, not hang. ``python -m runtime.launch -n 2 tests/torch_backend/job_fail.py HOW KIND``:
HOW ``raise`` (rank 1 raises: the job is aborted, ``PeerAbortedError``) or ``kill`` (rank 1 is
killed: ``PeerLostError``), KIND ``ddp`` or ``fsdp``. Rank 0 prints what it saw and how long after
the step began, then exits 3 (run by tests/torch_backend/test_torch_failures.py)."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import ringweave_torch  # noqa: F401  (registers the backend)

how, kind = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 says what it saw before the launcher stops it
dist.init_process_group("ringweave")
rank = dist.get_rank()
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
m = DistributedDataParallel(m) if kind == "ddp" else fully_shard(m)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(4):
    if rank == 1 and step == 2:
        if how == "raise":
            raise ValueError("rank 1 gives up at step 2")
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    except Exception as exc:
        print(f"rank {rank} step {step} saw {type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}",
              flush=True)
        os._exit(3)
print(f"rank {rank} finished", flush=True)
