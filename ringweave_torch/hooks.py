"""DDP communication hooks on ringweave's compressed all_reduce.

    model = DistributedDataParallel(model)                      # on the "ringweave" backend
    model.register_comm_hook(None, compressed_allreduce_hook("int8"))
    model.register_comm_hook(None, compressed_allreduce_hook("topk", ratio=0.01))

Each gradient bucket is averaged over the ranks by ``collectives.all_reduce(bucket,
op="avg", compression=codec, key=bucket index)`` in place: the codec (``fp16``, ``bf16``,
``int8``, ``topk``, ``powersgd``; collectives/compressed.py says how each is reduced and the
error it brings) is made once per hook, with error feedback for the lossy codecs unless
``error_feedback=False``, so its state carries from step to step, one stream per bucket.

Not here: the codecs (collectives/compress), the process group (backend.py).
"""

import torch
import torch.distributed as dist

from collectives.compress import get_codec
from ringweave_torch.backend import ProcessGroupRingweave

__all__ = ["compressed_allreduce_hook"]

_OWN_FEEDBACK = ("none", "powersgd")  # lossless, or with error feedback of its own


def compressed_allreduce_hook(codec="int8", *, error_feedback: bool = True, **options):
    """A DDP communication hook (``hook(state, bucket) -> Future[Tensor]``): the bucket's average
    over the ranks of ``state`` (a ringweave process group, or None: the default group) through
    ``codec`` (a name with its ``options``, or a ``collectives.compress`` codec object).

    Raises:
        ValueError, TypeError: an unknown codec or option (at once, not at the first step).
    """
    feedback = error_feedback and not (isinstance(codec, str) and codec in _OWN_FEEDBACK)
    made = get_codec(codec, error_feedback=feedback, **options)

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # DDP reads these
        pg = state if state is not None else dist.distributed_c10d._get_default_group()
        if not isinstance(pg, ProcessGroupRingweave):
            raise TypeError(f"compressed_allreduce_hook runs on the ringweave backend; the group is a "
                            f"{type(pg).__name__} (backend {pg.name()!r})")
        return pg.compressed_allreduce(bucket.buffer(), made, key=bucket.index()).get_future()
    hook.__qualname__ = hook.__name__ = f"compressed_allreduce_hook_{getattr(made, 'name', codec)}"
    return hook
