"""Where the elastic tests' job (elastic_job.py) fails on purpose: EL_FAULTS="SLOT:POINT@STEP,...".

The first process of launcher slot SLOT (never a joiner) fails at POINT of optimizer step STEP (the
strategy's committed steps, counted from 0; a step run again after a loss is the same STEP):

    read            SIGKILL when the loop reads the step's batch (between two steps' collectives)
    all_reduce      SIGKILL inside the step's first gradient all_reduce (ddp's bucket)
    stats           SIGKILL inside the statistics' all_reduce (loss, overflow, norm)
    vote            SIGKILL inside the commit vote's all_reduce
    reduce_scatter  SIGKILL inside the step's first reduce_scatter
    all_gather      SIGKILL inside the step's first all_gather (fsdp's forward; zero1/2's after the commit)
    update          SIGKILL in the optimizer's step of the second unit (after the commit)
    save            SIGKILL after writing its checkpoint pieces, before the save's agreement
    reshard         SIGKILL inside all_gather number STEP (0: the headers; 1, 2, ...: unit 0, 1, ...) of the
                    first re-shard (during a recovery)
    wire            SIGKILL once the next generation is decided, before connecting to it (during a
                    recovery: the others wait for its address until their timeout; STEP unused)
    stop            SIGSTOP when the loop reads the step's batch (the test sends SIGCONT)

"Inside" a collective: the algorithm has run a few turns of the event loop (its first frames or
shared-memory writes are out, the peers are in the call) when the process kills itself. Before it
fails the process writes OUT/fault-SLOT (its pid and the time). Test-only: nothing here runs in a
job that does not import it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from runtime import env

POINTS = ("read", "all_reduce", "stats", "vote", "reduce_scatter", "all_gather", "update", "save", "reshard", "wire",
          "stop")
COLLECTIVE_POINTS = {"all_reduce", "stats", "vote", "reduce_scatter", "all_gather", "reshard"}


def parse(spec: str) -> dict[int, tuple[str, int]]:
    """{slot: (point, step)} from "1:reduce_scatter@3,3:reshard@0"."""
    faults = {}
    for item in filter(None, spec.split(",")):
        slot, rest = item.split(":")
        point, step = rest.split("@")
        if point not in POINTS:
            raise ValueError(f"EL_FAULTS: unknown point {point!r} (one of {POINTS})")
        faults[int(slot)] = (point, int(step))
    return faults


class Faults:
    """This process's fault (or none), armed on a strategy once it exists."""

    def __init__(self, out: str, environ=os.environ) -> None:
        mine = None if env.ELASTIC_JOIN.get(environ) else parse(environ.get("EL_FAULTS", "")).get(
            int(environ.get("RANK", "0")))
        self.out, self.slot = out, int(environ.get("RANK", "0"))
        self.point, self.step = mine if mine else (None, -1)
        self.strategy = None
        self.resharding, self.gathers = False, 0

    def due(self, point: str) -> bool:
        if self.point != point or self.strategy is None:
            return False
        return point in ("reshard", "wire") or self.strategy.step == self.step

    def fail(self) -> None:
        with open(os.path.join(self.out, f"fault-{self.slot}"), "w") as f:
            f.write(f"{os.getpid()} {time.time()!r}")
        if self.point == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            self.point = None  # woken: once only
            return
        os.kill(os.getpid(), signal.SIGKILL)

    def on_read(self) -> None:
        if self.due("read") or self.due("stop"):
            self.fail()

    def arm(self, strategy) -> None:
        """Hooks the strategy (its optimizer, its re-shard) and the collectives' algorithm choice."""
        self.strategy = strategy
        if self.point is None:
            return
        if self.point == "update":
            step, calls = strategy.optimizer.step, [0]

            def dying_step(*args, **kw):
                if self.due("update"):
                    calls[0] += 1
                    if calls[0] == 2:
                        self.fail()
                return step(*args, **kw)
            strategy.optimizer.step = dying_step
        if self.point == "reshard":
            reshard = strategy.reshard

            async def resharding(*args, **kw):
                self.resharding, self.gathers = True, 0
                try:
                    await reshard(*args, **kw)
                finally:
                    self.resharding = False
            strategy.reshard = resharding
        if self.point == "wire":
            from runtime import elastic
            wire = elastic._wire

            async def dying_wire(*args, **kw):
                if self.due("wire"):
                    self.fail()
                return await wire(*args, **kw)
            elastic._wire = dying_wire
        if self.point == "save":
            from trainer import checkpoint
            write = checkpoint._write_pieces

            def dying_write(*args, **kw):
                made = write(*args, **kw)
                if self.due("save"):
                    self.fail()
                return made
            checkpoint._write_pieces = dying_write
        if self.point in COLLECTIVE_POINTS:
            self._hook_collectives()

    def _which(self, collective: str, nbytes: int) -> str | None:
        if self.resharding:  # the headers' gather, then one per unit
            self.gathers += collective == "all_gather"
            return "reshard" if collective == "all_gather" and self.gathers == self.step + 1 else None
        if collective == "all_reduce":
            return {4: "vote", 24: "stats", 8: None}.get(nbytes, "all_reduce" if nbytes > 64 else None)
        return collective if collective in ("reduce_scatter", "all_gather") else None

    def _hook_collectives(self) -> None:
        from collectives import registry
        choose = registry.choose

        def hooked(collective, nbytes, world, algorithm, group, **kw):
            algo, run = choose(collective, nbytes, world, algorithm, group, **kw)
            if not self.due(self._which(collective, nbytes) or ""):
                return algo, run

            async def run_then_fail(call, *args):
                task = asyncio.ensure_future(run(call, *args))
                for _ in range(3):  # its first frames out, the peers in the call
                    await asyncio.sleep(0)
                self.fail()
                await task
            return algo, run_then_fail
        registry.choose = hooked
        # the small shared-memory calls taken inline keep the choice they made at their first call
        # (slots/inline.py), so they would never ask the hooked choice again: every call goes the
        # normal path here, which asks it each time
        from collectives.slots import inline
        inline.all_reduce = lambda *args, **kw: None
        inline.barrier = lambda *args, **kw: None
