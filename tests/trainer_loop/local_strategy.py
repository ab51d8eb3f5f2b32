"""A tiny Strategy for loop tests: one process's plain model + AdamW, no communication.

It follows the contract of trainer.sharding.base exactly as a world-size-1
strategy would (the loss denominator is the rows of all micro-batches of the
step), and records what the loop handed it, so tests can check the batching.
"""

from __future__ import annotations

import time

from trainer.nn import Context
from trainer.optim import AdamW, WarmupCosine
from trainer.sharding.base import StepResult, Strategy, TrainConfig


class LocalStrategy(Strategy):
    name = "local"

    def __init__(self, model, config: TrainConfig, group=None) -> None:
        self.model, self.config, self.group = model, config, group
        self.calls: list[list[tuple[int, int, int]]] = []  # per step: (rows, offset, global_size) per micro-batch
        self.evaluated_rows = 0

    async def setup(self) -> None:
        c = self.config
        self.params = self.model.init_params(c.seed)
        self.grads = self.model.zeros()
        self.opt = AdamW(weight_decay=c.weight_decay, kernel="numpy")
        self.states = [self.opt.init_state(p.size, p.dtype) for p in self.params]
        self.schedule = WarmupCosine(c.lr, c.warmup_steps, c.total_steps, c.lr / 100)
        self.step = 0

    async def train_step(self, micro_batches) -> StepResult:
        t0 = time.perf_counter()
        self.calls.append([(len(x), off, gs) for x, _, off, gs in micro_batches])
        self.model.zero_grads(self.grads)
        denominator = sum(gs for *_, gs in micro_batches)
        loss = 0.0
        for x, y, off, _ in micro_batches:
            ctx = Context(seed=self.config.seed, step=self.step, batch_offset=off)
            loss += self.model.forward_backward(self.params, self.grads, x, y, ctx, loss_denominator=denominator)
        for p, g, s in zip(self.params, self.grads, self.states):
            self.opt.step(p, g, s, self.schedule(self.step))
        self.step += 1
        compute = time.perf_counter() - t0
        return StepResult(loss=loss, comm_bytes=100, timings={"compute_s": compute, "comm_s": 0.0,
                                                              "exposed_comm_s": 0.0})

    async def evaluate(self, x, y):
        self.evaluated_rows += len(x)
        return self.model.loss.metrics(self.model.forward(self.params, x), y)

    async def full_params(self):
        return [p[: u.numel].copy() for p, u in zip(self.params, self.model.units)]

    def state_dict(self) -> dict:
        shards = {}
        for i, (p, s) in enumerate(zip(self.params, self.states)):
            shards[f"unit{i}.param"] = p.copy()
            for name, buf in s.buffers.items():
                shards[f"unit{i}.{name}"] = buf.copy()
        return {"step": self.step, "shards": shards, "layout": {}, "scaler": {},
                "optim_steps": [s.step for s in self.states]}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        for i, (p, s) in enumerate(zip(self.params, self.states)):
            p[...] = state["shards"][f"unit{i}.param"]
            for name, buf in s.buffers.items():
                buf[...] = state["shards"][f"unit{i}.{name}"]
            s.step = state["optim_steps"][i]

    def memory_bytes(self) -> dict:
        return {"params": sum(p.nbytes for p in self.params), "grads": sum(g.nbytes for g in self.grads),
                "optim": sum(s.nbytes for s in self.states), "gathered_peak": 0}
