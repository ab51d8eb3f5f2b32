"""ringweave as a torch.distributed backend: ``import ringweave_torch`` registers "ringweave".

    import torch.distributed as dist
    import ringweave_torch  # noqa: F401  (registers the backend)

    dist.init_process_group("ringweave")          # under: python -m runtime.launch -n 2 train.py
    model = torch.nn.parallel.DistributedDataParallel(model)
    model.register_comm_hook(None, ringweave_torch.hooks.compressed_allreduce_hook("int8"))

The process groups are ringweave groups of the job that ``runtime.init()`` forms (job.py;
``ringweave_torch.communicator()`` is its ``Communicator``, for ringweave's own calls in the same
job); torch's calls run on ringweave's collectives, CPU tensors in place (backend.py). DDP and FSDP2
(``torch.distributed.fsdp.fully_shard``) run on it. torch's ``env://`` rendezvous is answered by
the job under our launcher, so Gloo works there too.

Not here: torch tensors given to ringweave's own calls (collectives/tensors.py).
"""

from __future__ import annotations

import torch.distributed as dist

from ringweave_torch import backend, hooks, job  # noqa: F401  (public modules)
from ringweave_torch.backend import ProcessGroupRingweave, Work, create
from ringweave_torch.job import job as communicator, shutdown

__all__ = ["ProcessGroupRingweave", "Work", "create", "communicator", "shutdown", "hooks", "job", "BACKEND"]

BACKEND = "ringweave"

dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
job.install()
