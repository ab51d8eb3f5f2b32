"""The parts a data-parallel strategy holds, their contracts, and their plain forms.

What it is: `DataParallelStrategy` (data_parallel.py) computes its micro-batches, agrees on the
step and maps its state through `self.model_parallel`, and keeps its optimizer state where
`self.offload` says. Both are objects with a few explicit methods, each given the strategy
(`s`) it serves; neither changes the strategy's class. The plain forms here are what a
strategy holds without a mesh: `ModelParallel` runs the micro-batches one after the other
through the whole model, `NoOffload` keeps everything in memory. The other forms:
trainer/parallel/strategy.py's `MeshParallel` (tensor x pipeline) and
trainer/parallel/offload.py's `DiskOffload`.

    model_parallel  compute(s, micro_batches, denominator, scale) -> the loss this rank counts
                    finish_grads(s)                  async: after the dp gradients are in
                    counted_ranges(s, i)             unit i's elements this rank's norm counts
                    agree(s, [loss, found_inf, sumsq])  async: summed over every rank of the job
                    report(s, result)                its bytes and timings, into the step's result
                    evaluate, full_params, full_state / local_state (checkpoint names and
                    layout), sharded_state_dict, accounted (its collectives), pipeline_report
    offload         adopt(s) at setup; begin_step(); before_update(i) / after_update(i) around
                    unit i's optimizer step; finish_update(); after_load(); memory(mem); close()

What it is not: no strategy logic (data_parallel.py, ddp.py, zero.py, fsdp.py), no mesh.
"""

from __future__ import annotations

import functools

import numpy as np

from trainer.nn import EVAL, Context

__all__ = ["ModelParallel", "NoOffload"]


class ModelParallel:
    """The model-parallel part of a strategy without a mesh: one stage, the whole model, no
    tensor parallelism. Subclasses (trainer/parallel) keep the contract of every method."""

    group = None  # the ranks checkpoints and the loop agree over (None: the strategy's own)
    data_group = None  # the ranks the data are split over (None: the loop's group)
    logical_model = None  # the model checkpoints describe (None: the strategy's)

    def accounted(self) -> list:
        """The AccountedCollectives this part launches on (reset, drained and cancelled with the dp ones)."""
        return []

    def compute(self, s, micro_batches, denominator: float, scale: float) -> float:
        """Compute thread: forward and backward of every micro-batch through the strategy's hooks
        (the last one, `sync`, launches the gradient collectives); returns the local loss sum."""
        loss, rows_before = 0.0, 0
        params = s._compute_params()
        s.meter.clear()  # what a failed step may have left
        for j, (x, y, offset, global_size) in enumerate(micro_batches):
            grads = s._grad_list()
            hooks = s._hooks(j == len(micro_batches) - 1, params, grads)
            ctx = Context(training=True, seed=s.config.seed, step=s.step, batch_offset=rows_before + int(offset))
            # grads_zero at j == 0: the strategy's _begin_step zeroed every gradient buffer (ddp, zero1) or
            # dropped them, and before_unit_backward allocates them as zeros (zero2, zero3/fsdp)
            loss += s.model.forward_backward(params, grads, s._cast_input(x), y, ctx, loss=s.loss,
                                             loss_denominator=denominator, grad_scale=scale, grads_zero=j == 0,
                                             checkpoint=s.config.activation_checkpointing, meter=s.meter, **hooks)
            rows_before += int(global_size)
        return loss

    async def finish_grads(self, s) -> None:
        """After the strategy's gradient collectives are drained (nothing here)."""

    def counted_ranges(self, s, i: int) -> list[tuple[int, int]]:
        """[lo, hi) of unit i (padded coordinates) whose squares this rank adds to the global norm
        (before the strategy keeps only its shard and one replica): all of it."""
        return [(0, s.lengths[i])]

    async def agree(self, s, stats: np.ndarray) -> None:
        """Sums ``stats`` in place over every data-parallel rank: the shard group, then the replicas."""
        await s.collectives.exposed(s.collectives.all_reduce(stats))
        await s.replicas.agree(stats)

    def report(self, s, result) -> None:
        """Adds this part's bytes and timings to the step's StepResult (nothing here)."""

    def pipeline_report(self) -> dict | None:
        return None  # no pipeline

    async def evaluate(self, s, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """See Strategy.evaluate: one forward through the whole model with the strategy's eval hooks."""
        params = s._compute_params()
        hooks = s._eval_hooks(params)
        try:
            forward = functools.partial(s.model.forward, params, s._cast_input(x), EVAL, **hooks)
            out = await s._in_thread(forward)
            await s.collectives.drain()
        except BaseException:
            await s._cancel_pending()
            raise
        return {k: float(v) for k, v in s.loss.metrics(out, y).items()}

    async def full_params(self, s) -> list[np.ndarray]:
        """See Strategy.full_params (the strategy gathers its own units)."""
        return await s._full_params()

    def full_state(self, s, state: dict) -> dict:
        """The strategy's state_dict in the names and layout checkpoints hold (the same here)."""
        return state

    def local_state(self, s, state: dict) -> dict:
        """The reverse of full_state: a loaded state in the strategy's own names (the same here)."""
        return state

    async def sharded_state_dict(self, s) -> dict:
        """What a checkpoint writes: the strategy's state, its shards once (replica 0 under HSDP)."""
        return s.replicas.written(s.state_dict())

    def close(self) -> None:
        pass


class NoOffload:
    """The offload part of a strategy that keeps everything in memory: every method does nothing."""

    def adopt(self, s) -> None:
        """After setup: moves the strategy's per-unit optimizer arrays out of memory."""

    def begin_step(self) -> None:
        """A step starts (the first unit may be read ahead while the forward runs)."""

    def before_update(self, i: int) -> None:
        """Compute thread, right before the optimizer steps unit i."""

    def after_update(self, i: int) -> None:
        """Compute thread, right after unit i stepped (and the strategy's own after-work)."""

    def finish_update(self) -> None:
        """After the update, failed or not: waits for what after_update left behind."""

    def after_load(self) -> None:
        """After load_state_dict wrote into the arrays."""

    def memory(self, mem: dict) -> dict:
        return mem

    def close(self) -> None:
        pass
