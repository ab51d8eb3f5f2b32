"""trainer.sharding: DDP, ZeRO-1/2 and ZeRO-3/FSDP over the same flat-buffer model.

    from trainer.sharding import TrainConfig, make_strategy
    model = mlp(64, (256, 256), 10)               # or GPT(GPTConfig(...)); padding is the strategy's
    strategy = make_strategy("zero3", model, TrainConfig(lr=2e-3), world)   # loss=MSELoss() for another loss
    await strategy.setup()
    result = await strategy.train_step([(x_local, y_local, offset, global_size)])
    strategy.close()
    make_strategy("fsdp", model, config, shard_group, replicate=replica_group)   # hybrid sharding

Files: base.py (the contract, TrainConfig, StepResult), data_parallel.py (the
data-parallel base: the step every strategy shares), parts.py (the parts a strategy
holds: model parallelism, offload), hsdp.py (the replicate dimension of hybrid
sharding and its bytes per step), accounted.py (the collectives a strategy runs,
counted and timed, and the compute-thread bridge), ddp.py, zero.py (stages 1 and 2),
fsdp.py (stage 3), redundancy.py (elastic training: the commit vote, buddy replicas, reshard).

What it is not: no data loading, no checkpoint files (trainer/checkpoint.py), no loop.
"""

from __future__ import annotations

from trainer.sharding.base import (ReplicaMismatchError, ShardLostError, StepAbortedError, StepResult, Strategy,
                                   TrainConfig)
from trainer.sharding.data_parallel import DECAY_GROUPS, STRATEGIES, make_codec

__all__ = ["STRATEGIES", "DECAY_GROUPS", "ReplicaMismatchError", "StepAbortedError", "ShardLostError", "StepResult",
           "Strategy", "TrainConfig", "make_strategy", "make_codec"]
# Machinery, imported only from inside trainer/ (tests/tree/test_surfaces.py): the strategies' counted
# door to collectives/.
_INTERNAL = ("accounted",)


def make_strategy(name: str, model, config: TrainConfig, group, **kw) -> Strategy:
    """The strategy called ``name`` (ddp | zero1 | zero2 | zero3 | fsdp) over ``model`` on ``group``.

    ``kw`` goes to the strategy (e.g. ``schedule=`` a callable step -> lr that
    replaces the one TrainConfig describes, ``loss=`` a loss object other than the
    model's, ``replicate=`` a ProcessGroup of the ranks holding copies of this rank's
    shards: hybrid sharding over ``group`` x ``replicate``, zero1/2/3 and fsdp; ``world=``
    then the group of them all, default the runtime's world). Call ``await setup()`` next.

    Raises:
        ValueError: an unknown name or a bad TrainConfig field.
    """
    if name == "ddp":
        from trainer.sharding.ddp import DDPStrategy
        return DDPStrategy(model, config, group, **kw)
    if name in ("zero1", "zero2"):
        from trainer.sharding.zero import ZeroStrategy
        return ZeroStrategy(model, config, group, stage=int(name[-1]), **kw)
    if name in ("zero3", "fsdp"):
        from trainer.sharding.fsdp import FSDPStrategy
        return FSDPStrategy(model, config, group, name=name, **kw)
    raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
