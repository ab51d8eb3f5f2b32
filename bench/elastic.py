"""Elastic jobs: what a lost rank and a joiner cost, against the restart path, at 4 ranks.

    python bench/elastic.py                          # the default GPT, ddp and fsdp, 4 ranks
    python bench/elastic.py --model mlp --strategies ddp,zero2,fsdp --steps 12

Per strategy, three jobs of ``python -m runtime.launch -n N``, each one BLAS thread per rank:

- elastic (``--elastic N-1:N``): rank 1 SIGKILLs itself when it reads step ``--kill-step``'s
  batch, after writing the time; the job runs until the joiner is in and ``--steps`` are done. (a) kill -> first step completed by the shrunk job (the
  survivors' ElasticJob.resumed_at; the fastest survivor); (b) the joiner the launcher starts in
  its slot: from the start of its main (imports excluded) to its first step completed;
- restart (``--max-restarts 1``, a checkpoint every step): the same kill; (d) kill -> the first
  step completed by the restarted attempt (imports, rendezvous, checkpoint load included);
- steps: (c) the median step time with the strategy's Redundancy (the vote, buddy replicas) off
  and on, alternating, in one job, and their ratio.

The model: the default GPT of ``python -m trainer --model gpt`` (or the MLP with --model mlp),
float32 AdamW, the trainer's own config; a job stops after ``--steps`` steps (no evaluation).
Figures go to stdout as one table (--json: also to a file); none are asserted.
"""

from __future__ import annotations

import argparse
from runtime import env
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, bench/ is sys.path[0], and bench/trainer.py would shadow the trainer package
sys.path[:] = [str(REPO)] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (str(REPO / "bench"), str(REPO))]
T_MAIN = time.time()  # the worker's start, after its imports below are done (reset in worker())


def cli_args(o):
    from trainer import cli
    return cli.parse_args(["--model", o.model, "--strategy", o.strategy, "--quiet"])


async def worker(o) -> None:
    import types

    import runtime
    from runtime import elastic as relastic
    from trainer import cli
    from trainer.elastic import ElasticJob
    from trainer.loop import fit, steps_per_epoch
    from trainer.sharding import make_strategy

    global T_MAIN
    T_MAIN = time.time()
    args = cli_args(o)
    data = cli.load_data(args)
    spe = steps_per_epoch(len(data.train), args.batch_size, args.grad_accum)
    config = cli.make_config(args, spe)
    rank, joiner = int(os.environ.get("RANK", "0")), env.ELASTIC_JOIN.get()
    restart = env.RESTART.get()
    out = Path(o.out)
    train, reads = data.train, [0]

    def get(indices, epoch=0):  # the kill: rank 1 of the first processes, at --kill-step's batch
        reads[0] += 1
        if o.mode != "steps" and rank == 1 and not joiner and restart == 0 and reads[0] == o.kill_step + 1:
            (out / "kill").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return type(train).get(train, indices, epoch)

    train.get = get
    rdzv = relastic.from_env() if o.mode == "elastic" else None
    rt = await (runtime.init(rendezvous=rdzv) if rdzv else runtime.init())
    job = ElasticJob(rdzv, rt) if rdzv else None
    try:
        if o.mode == "steps":
            await step_times(o, rt, config, cli.build_model(args, data), data, args, out)
            return
        extra = {"redundancy": job.redundancy()} if job else {}
        strategy = make_strategy(o.strategy, cli.build_model(args, data), config, rt.world, **extra)
        await strategy.setup()
        first = {}

        class Stop:
            def on_step_end(self, state):
                first.setdefault("at", time.time())
                grown = job is None or state.world_size == o.ranks  # elastic: the joiner trains too
                state.stop_training = (state.step >= o.steps and grown) or state.step >= 20 * o.steps

        ckpt = {"checkpoint_dir": str(out / "ckpt"), "checkpoint_every": 1} if o.mode == "restart" else {}
        await fit(strategy, types.SimpleNamespace(train=train, val=[]), config, epochs=1000,
                  global_batch_size=args.batch_size, eval_train=False, print_summary=False, log_every=0,
                  callbacks=[Stop()], elastic=job, **ckpt)
        me = {"mode": o.mode, "rank": rank, "restart": restart, "joiner": joiner, "main": T_MAIN}
        if job is not None:
            me.update(resumed=job.resumed_at, first_step=job.first_step_at)
        else:
            me.update(first_step=first.get("at"))
        (out / f"{o.mode}-{os.getpid()}.json").write_text(json.dumps(me))
        strategy.close()
    finally:
        await runtime.shutdown(job.rt if job else rt)
        if rdzv is not None:
            await rdzv.shutdown()


async def step_times(o, rt, config, model, data, args, out) -> None:
    """(c): the median step with the Redundancy off and on, alternating."""
    import numpy as np

    from trainer.data import iter_local_batches
    from trainer.sharding import make_strategy
    from trainer.sharding.redundancy import Redundancy

    world = rt.world
    pair = [make_strategy(o.strategy, model, config, world),
            make_strategy(o.strategy, model, config, world, redundancy=Redundancy(rt.store, timeout=rt.timeout_s))]
    for s in pair:
        await s.setup()
    batches = list(iter_local_batches(len(data.train), args.batch_size, world.size, world.rank, seed=1, epoch=0))
    times = ([], [])
    for k in range(2 * o.steps + 2):
        b = batches[k // 2 % len(batches)]
        x, y = data.train.get(b.indices, 0)
        t = time.perf_counter()
        await pair[k % 2].train_step([(x, y, b.offset, b.global_size)])
        if k >= 2:
            times[k % 2].append(time.perf_counter() - t)
    for s in pair:
        s.close()
    if world.rank == 0:
        (out / "steps.json").write_text(json.dumps({"off": float(np.median(times[0])), "on": float(np.median(times[1]))}))


def launch(o, mode: str, strategy: str, out: Path, flags: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "runtime.launch", *flags, "-n", str(o.ranks), "--timeout-s", "30", "--grace-s", "2",
           __file__, "--worker", mode, "--model", o.model, "--strategy", strategy, "--steps", str(o.steps),
           "--kill-step", str(o.kill_step), "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=o.job_timeout_s)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-3000:])
        raise SystemExit(f"bench/elastic.py: the {mode} job of {strategy} failed ({p.returncode})")


def records(out: Path, mode: str) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob(f"{mode}-*.json"))]


def row(o, strategy: str, root: Path) -> dict:
    d = root / strategy
    launch(o, "elastic", strategy, d / "elastic", ["--elastic", f"{o.ranks - 1}:{o.ranks}"])
    kill = float((d / "elastic" / "kill").read_text())
    el = records(d / "elastic", "elastic")
    shrunk = min(r["resumed"] - kill for r in el if r["resumed"] and not r["joiner"])
    joiners = [r["first_step"] - r["main"] for r in el if r["joiner"] and r["first_step"]]
    launch(o, "steps", strategy, d / "steps", [])
    steps = json.loads((d / "steps" / "steps.json").read_text())
    launch(o, "restart", strategy, d / "restart", ["--max-restarts", "1"])
    kill = float((d / "restart" / "kill").read_text())
    again = [r["first_step"] for r in records(d / "restart", "restart") if r["restart"] == 1 and r["first_step"]]
    return {"strategy": strategy, "shrink_s": shrunk, "joiner_s": min(joiners) if joiners else None,
            "step_off_s": steps["off"], "step_on_s": steps["on"], "ratio": steps["on"] / steps["off"],
            "restart_s": min(again) - kill if again else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=14, help="steps per job (and per mode of the step-time job)")
    p.add_argument("--kill-step", type=int, default=3)
    p.add_argument("--job-timeout-s", type=float, default=120.0)
    p.add_argument("--worker", choices=("elastic", "restart", "steps"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the rows here")
    o = p.parse_args()
    if o.worker:
        o.mode = o.worker
        asyncio.run(worker(o))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        for strategy in o.strategies.split(","):
            rows.append(row(o, strategy, Path(tmp)))
    def fmt(v):
        return "-" if v is None else f"{v:.3f}"
    print(f"{o.model} at {o.ranks} ranks, rank 1 SIGKILLed at step {o.kill_step}")
    print("strategy  kill->first step, shrunk (s)  joiner training (s)  step off (s)  step on (s)  on/off  "
          "restart: kill->first step (s)")
    for r in rows:
        print(f"{r['strategy']:8}  {fmt(r['shrink_s']):>28}  {fmt(r['joiner_s']):>19}  {fmt(r['step_off_s']):>12}  "
              f"{fmt(r['step_on_s']):>11}  {r['ratio']:6.3f}  {fmt(r['restart_s']):>29}")
    if o.json:
        Path(o.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
