"""trainer.parallel: the trainer's other dimensions, tensor and pipeline parallelism on a device mesh.

    mesh = Mesh(world, tp=2, pp=2)                       # dp: what is left
    strategy = make_parallel_strategy("fsdp", GPTConfig(...), TrainConfig(...), mesh,
                                      parallel=ParallelConfig(schedule="1f1b", micro_batches=8))
    make_parallel_strategy("ddp", mlp(64, (256, 256), 10), config, mesh)   # any declared model
    await strategy.setup(); await strategy.train_step(micro_batches)     # as any Strategy

Files: mesh.py (DeviceMesh, n named dimensions of process groups; the trainer's Mesh: pp x dp x
tp, dp = replicas x shard ranks), tp_group.py (the tp group from the compute thread), tensor.py
(Megatron's f / g, column- and row-parallel Linear, attention and MLP, the layers between a
column and a row one), vocab.py (vocabulary-parallel embedding, head and cross-entropy), gpt.py
(the GPT's units per tp rank and their maps to the full layout), split.py (any model's units per
tp rank, from its layers' declarations), pipeline.py (stages and balancing), schedules.py (GPipe
and 1F1B as action lists), executor.py (running a stage's schedule), strategy.py (dp x tp x pp:
the model-parallel part of any data-parallel strategy), fullstate.py (full parameters and
checkpoints from a rank's parts), offload.py (optimizer state and master weights on disk).

What it is not: no implementation lives here.
"""

from trainer.parallel.mesh import DIMS, DeviceMesh, Mesh
from trainer.parallel.schedules import SCHEDULES, bubble_formula, format_table, schedule
from trainer.parallel.strategy import ParallelConfig, make_parallel_strategy

__all__ = ["DIMS", "DeviceMesh", "Mesh", "SCHEDULES", "bubble_formula", "format_table", "schedule", "ParallelConfig",
           "make_parallel_strategy"]
# Machinery, imported only from inside trainer/ (tests/tree/test_surfaces.py): running a stage's
# schedule, the tp group the layers talk through.
_INTERNAL = ("executor", "tp_group")
