"""Elastic jobs: what a lost rank and a joiner cost, against the restart path, at 4 ranks.

    python bench/elastic.py                          # recovery times and cost: the default GPT, ddp and fsdp
    python bench/elastic.py --cost --strategies ddp,zero1,zero2,zero3,fsdp   # the redundancy's cost only
    python bench/elastic.py --judged                 # the judged run: a rank killed from outside, rejoined 10 s later
    python bench/elastic.py --model mlp --strategies ddp,zero2,fsdp --steps 12

Each job is ``python -m runtime.launch -n N`` of this file's worker, one BLAS thread per rank.

Default (recovery), per strategy: (1) elastic (``--elastic N-1:N``): rank 1 SIGKILLs itself when it
reads step ``--kill-step``'s batch, after writing the time: (a) kill -> first step completed by the
shrunk job (the fastest survivor's ElasticJob.resumed_at); (b) the joiner the launcher starts in its
slot: start of its main (imports excluded) -> its first step completed; (2) the step-cost job below;
(3) the restart path (``--max-restarts 1``, a checkpoint every step), the same kill: (d) kill -> the
first step completed by the restarted attempt (imports, rendezvous, checkpoint load included).

Cost (``--cost``, also part of the default): one job runs three blocks of ``--cost-steps`` steps
(after 2 untimed ones), each on a strategy built afresh: plain, with its Redundancy (vote, buddy
log, a refresh every K = --refresh-every steps), plain again; the median and the mean step (the
mean over whole refresh periods is the cost: a refresh step is slower), their ratios against the
two plain blocks, and the buddy memory (``redundancy.memory_nbytes``: the copy and a full log)
beside the plain strategy's parameters and optimizer state. ``--control``: all three plain.

Judged (``--judged``): the default GPT in float64 at the trainer's default global batch, per
strategy (fsdp, ddp): (1) elastic with ``--rejoin-delay-s 10``: a random rank SIGKILLed from outside
once rank 0 completed a random step (2-6, ``--seed``), the job runs until the joiner trained 3 steps
at full size and ``--steps`` are done (S steps); (2) the undisturbed run of S steps (no --elastic);
(3) the restart path (``--max-restarts 1``, a checkpoint every step) with the same kill. Reported:
max |elastic - undisturbed| of the final parameters and of every step's loss (restart path alike),
the survivors' pids (one process per slot but the killed one's, each exited 0 after the last step),
kill -> first shrunk step, the joiner's main (imports excluded) -> training, kill -> the restarted
attempt's first step. Figures go to stdout (--json: also to a file); none are asserted.
"""

from __future__ import annotations

import argparse
from runtime import env
import asyncio
import json
import os
import random
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
F64 = ["--master-dtype", "float64", "--param-dtype", "float64", "--reduce-dtype", "float64"]
REJOIN_DELAY_S = 10.0  # the judged run's restart delay of the killed rank's slot
FULL_STEPS_AFTER_GROW = 3  # the judged run ends this many steps after the joiner is in (and past --steps)
WARMUP_STEPS = 2  # the cost job's untimed steps at the start of each block


def cli_args(o):
    from trainer import cli
    return cli.parse_args(["--model", o.model, "--strategy", o.strategy, "--quiet", *(F64 if o.float64 else [])])


async def worker(o) -> None:
    import types

    import numpy as np

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
    (out / f"pid-{rank}-{os.getpid()}").write_text(json.dumps({"joiner": joiner, "restart": restart}))
    train, reads = data.train, [0]

    def get(indices, epoch=0):  # the kill from inside: rank 1 of the first processes, at --kill-step's batch
        reads[0] += 1
        inside = o.kill_inside and o.mode != "steps" and rank == 1 and not joiner and restart == 0
        if inside and reads[0] == o.kill_step + 1:
            (out / "kill").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return type(train).get(train, indices, epoch)

    train.get = get
    elastic = o.mode in ("elastic", "judged")
    rdzv = relastic.from_env() if elastic else None
    rt = await (runtime.init(rendezvous=rdzv) if rdzv else runtime.init())
    job = ElasticJob(rdzv, rt) if rdzv else None
    try:
        if o.mode == "steps":
            await step_times(o, rt, config, cli.build_model(args, data), data, args, out)
            return
        extra = {"redundancy": job.redundancy(refresh_every=o.refresh_every)} if job else {}
        strategy = make_strategy(o.strategy, cli.build_model(args, data), config, rt.world, **extra)
        await strategy.setup()
        first, full = {}, [0]

        class Stop:
            def on_step_end(self, state):
                first.setdefault("at", time.time())
                with open(out / f"steps-{os.getpid()}.jsonl", "a") as f:  # a killed process's steps count too
                    f.write(json.dumps([state.step, state.result.loss, state.result.grad_norm]) + "\n")
                if state.rank == 0:
                    (out / "progress.tmp").write_text(str(state.step))
                    os.replace(out / "progress.tmp", out / "progress")
                if o.until:  # a fixed number of steps (the undisturbed and the restart runs of the judged one)
                    state.stop_training = state.step >= o.until
                    return
                full[0] = full[0] + 1 if job is None or state.world_size == o.ranks else 0
                after = FULL_STEPS_AFTER_GROW if o.mode == "judged" else 1  # steps at full size (after the grow)
                state.stop_training = (state.step >= o.steps and full[0] >= after) or state.step >= 20 * o.steps

        ckpt = {"checkpoint_dir": str(out / "ckpt"), "checkpoint_every": 1} if o.mode == "restart" else {}
        await fit(strategy, types.SimpleNamespace(train=train, val=[]), config, epochs=1000,
                  global_batch_size=args.batch_size, eval_train=False, print_summary=False, log_every=0,
                  callbacks=[Stop()], elastic=job, **ckpt)
        params = await strategy.full_params()
        me = {"mode": o.mode, "rank": rank, "restart": restart, "joiner": joiner, "main": T_MAIN, "pid": os.getpid(),
              "last_rank": strategy.group.rank}
        if job is not None:
            me.update(resumed=job.resumed_at, first_step=job.first_step_at, entered=job.entered_at)
        else:
            me.update(first_step=first.get("at"))
        if strategy.group.rank == 0:
            np.savez(out / f"params-{o.mode}.npz", *params)
        (out / f"{o.mode}-{os.getpid()}.json").write_text(json.dumps(me))
        strategy.close()
    finally:
        await runtime.shutdown(job.rt if job else rt)
        if rdzv is not None:
            await rdzv.shutdown()


async def step_times(o, rt, config, model, data, args, out) -> None:
    """Three blocks of ``--cost-steps`` steps, each on a strategy built afresh and closed after it:
    plain, with the Redundancy, plain again (the plain blocks' mean cancels a drift of the machine;
    two strategies alive at once, stepped in turn, measured the second one slower even when both
    were plain). ``--control``: the middle block is plain too (the ratio then says the noise)."""
    import numpy as np

    from trainer.data import iter_local_batches
    from trainer.sharding import make_strategy
    from trainer.sharding.redundancy import Redundancy, memory_nbytes

    world = rt.world
    batches = list(iter_local_batches(len(data.train), args.batch_size, world.size, world.rank, seed=1, epoch=0))
    times, record = {}, {}
    for block in ("off", "on", "off2"):
        on = block == "on" and not o.control
        s = make_strategy(o.strategy, model, config, world, **({"redundancy": Redundancy(
            rt.store, timeout=rt.timeout_s, refresh_every=o.refresh_every)} if on else {}))
        await s.setup()
        times[block] = []
        for k in range(o.cost_steps + WARMUP_STEPS):
            b = batches[k % len(batches)]
            x, y = data.train.get(b.indices, 0)
            t = time.perf_counter()
            await s.train_step([(x, y, b.offset, b.global_size)])
            if k >= WARMUP_STEPS:
                times[block].append(time.perf_counter() - t)
        if block == "on":
            record["buddy_bytes"] = memory_nbytes(s)
        else:
            state = s.memory_bytes()
            record["state_bytes"] = state["params"] + state["optim"]
        s.close()
    off = times["off"] + times["off2"]
    record.update(off=float(np.median(off)), on=float(np.median(times["on"])), off_mean=float(np.mean(off)),
                  on_mean=float(np.mean(times["on"])))
    if world.rank == 0:
        (out / "steps.json").write_text(json.dumps(record))


def launch(o, mode: str, strategy: str, out: Path, flags: list[str], *, until: int = 0,
           kill: tuple[int, int] | None = None) -> subprocess.CompletedProcess:
    """One job; ``kill=(rank, step)``: SIGKILL that rank's first process from outside once rank 0
    completed ``step`` steps (the time goes to OUT/kill)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "runtime.launch", *flags, "-n", str(o.ranks), "--timeout-s", "30", "--grace-s", "2",
           __file__, "--worker", mode, "--model", o.model, "--strategy", strategy, "--steps", str(o.steps),
           "--kill-step", str(o.kill_step), "--out", str(out), "--refresh-every", str(o.refresh_every),
           "--cost-steps", str(o.cost_steps), "--until", str(until), *(["--float64"] if o.float64 else []),
           *(["--control"] if o.control else []),
           *(["--kill-inside"] if o.kill_inside else [])]
    log = out / "launcher.log"
    with open(log, "w") as sink, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                                  start_new_session=True) as p:
        try:
            if kill is not None:
                kill_at(p, out, *kill, deadline=time.monotonic() + o.job_timeout_s)
            p.wait(timeout=o.job_timeout_s)
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    if p.returncode != 0:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"bench/elastic.py: the {mode} job of {strategy} failed ({p.returncode})")
    return subprocess.CompletedProcess(cmd, p.returncode, log.read_text(), "")


def kill_at(p: subprocess.Popen, out: Path, rank: int, step: int, *, deadline: float) -> None:
    while time.monotonic() < deadline and p.poll() is None:
        done = (out / "progress").read_text() if (out / "progress").exists() else ""
        if done and int(done) >= step:
            pid = next(int(f.name.split("-")[2]) for f in out.glob(f"pid-{rank}-*")
                       if not json.loads(f.read_text())["joiner"] and not json.loads(f.read_text())["restart"])
            (out / "kill").write_text(repr(time.time()))
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.01)
    raise SystemExit(f"bench/elastic.py: rank 0 never completed step {step}")


def records(out: Path, mode: str) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob(f"{mode}-*.json"))]


def losses(out: Path) -> dict[int, float]:
    """Every step's loss as the job's processes recorded it, the killed ones' included (a step's loss
    is agreed: any process's is it; a step run again after a restart from a checkpoint: the last)."""
    got = {}
    for f in sorted(out.glob("steps-*.jsonl"), key=lambda f: f.stat().st_mtime):
        for line in f.read_text().splitlines():
            step, loss, _ = json.loads(line)
            got[int(step)] = loss
    return got


def compare(a: Path, b: Path, la: dict[int, float], lb: dict[int, float]) -> dict:
    """max |a - b| over the final parameters (npz files) and over every step's loss."""
    import numpy as np

    with np.load(a) as x, np.load(b) as y:
        if len(x.files) != len(y.files):
            return {"params": float("inf"), "loss": float("inf")}
        params = max(float(np.max(np.abs(x[k] - y[k]), initial=0.0)) for k in x.files)
    same_steps = sorted(la) == sorted(lb)
    return {"params": params, "loss": max(abs(la[k] - lb[k]) for k in la) if same_steps else float("inf"),
            "steps": len(la)}


def survivors_kept(out: Path, killed: int, ranks: int, recs: list[dict]) -> bool:
    """One process per slot but ``killed``'s (first and joiner), each with a final record (exited 0)."""
    pids = {}
    for f in out.glob("pid-*"):
        pids.setdefault(int(f.name.split("-")[1]), []).append(int(f.name.split("-")[2]))
    finished = {r["pid"] for r in recs}
    return all(len(pids.get(r, [])) == (2 if r == killed else 1) for r in range(ranks)) and all(
        pids[r][0] in finished for r in range(ranks) if r != killed)


def recovery_row(o, strategy: str, root: Path) -> dict:
    d = root / strategy
    o.kill_inside = True
    launch(o, "elastic", strategy, d / "elastic", ["--elastic", f"{o.ranks - 1}:{o.ranks}"])
    kill = float((d / "elastic" / "kill").read_text())
    el = records(d / "elastic", "elastic")
    shrunk = min(r["resumed"] - kill for r in el if r["resumed"] and not r["joiner"])
    joiners = [r["first_step"] - r["main"] for r in el if r["joiner"] and r["first_step"]]
    launch(o, "restart", strategy, d / "restart", ["--max-restarts", "1"])
    kill = float((d / "restart" / "kill").read_text())
    again = [r["first_step"] for r in records(d / "restart", "restart") if r["restart"] == 1 and r["first_step"]]
    return {"strategy": strategy, "shrink_s": shrunk, "joiner_s": min(joiners) if joiners else None,
            "restart_s": min(again) - kill if again else None, **cost_row(o, strategy, root)}


def cost_row(o, strategy: str, root: Path) -> dict:
    d = root / strategy / "steps"
    launch(o, "steps", strategy, d, [])
    s = json.loads((d / "steps.json").read_text())
    return {"strategy": strategy, "step_off_s": s["off"], "step_on_s": s["on"], "ratio": s["on"] / s["off"],
            "mean_off_s": s["off_mean"], "mean_on_s": s["on_mean"], "mean_ratio": s["on_mean"] / s["off_mean"],
            "buddy_mb": s["buddy_bytes"] / 1e6, "state_mb": s["state_bytes"] / 1e6}


def judged_row(o, strategy: str, root: Path, pick: random.Random) -> dict:
    d = root / strategy
    rank, step = pick.randrange(o.ranks), pick.randint(2, 6)
    t0 = time.monotonic()
    log = launch(o, "judged", strategy, d / "elastic", ["--elastic", f"{o.ranks - 1}:{o.ranks}", "--rejoin-delay-s",
                                                          f"{o.rejoin_delay_s:g}"], kill=(rank, step)).stdout
    el = records(d / "elastic", "judged")
    kill = float((d / "elastic" / "kill").read_text())
    total = max(losses(d / "elastic"))
    launch(o, "reference", strategy, d / "reference", [], until=total)
    launch(o, "restart", strategy, d / "restart", ["--max-restarts", "1"], until=total, kill=(rank, step))
    rs = records(d / "restart", "restart")
    again = [r["first_step"] for r in rs if r["restart"] == 1 and r["first_step"]]
    ref = losses(d / "reference")
    joiners = [r for r in el if r["joiner"]]
    return {"strategy": strategy, "killed_rank": rank, "kill_after_step": step, "steps": total,
            "joiners": log.count("starting a joiner in its place"),
            "elastic": compare(d / "elastic" / "params-judged.npz", d / "reference" / "params-reference.npz",
                               losses(d / "elastic"), ref),
            "restart": compare(d / "restart" / "params-restart.npz", d / "reference" / "params-reference.npz",
                               losses(d / "restart"), ref),
            "survivors_kept": survivors_kept(d / "elastic", rank, o.ranks, el),
            "shrink_s": min(r["resumed"] - kill for r in el if r["resumed"] and not r["joiner"]),
            "joiner_s": min(r["first_step"] - r["main"] for r in joiners) if joiners else None,
            "restart_s": min(again) - kill if again else None, "wall_s": time.monotonic() - t0}


def fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    p.add_argument("--strategies", default=None, help="comma-separated (default ddp,fsdp; --judged: fsdp,ddp)")
    p.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=14, help="steps per job at least")
    p.add_argument("--kill-step", type=int, default=3, help="the recovery jobs' kill (the judged run's is random)")
    p.add_argument("--cost", action="store_true", help="the redundancy's cost only (step times, memory)")
    p.add_argument("--cost-steps", type=int, default=24, help="timed steps per block of the cost job (whole refresh periods)")
    p.add_argument("--control", action="store_true", help="the cost job's middle block without the redundancy too")
    p.add_argument("--refresh-every", type=int, default=None, help="K (default: the library's REFRESH_EVERY)")
    p.add_argument("--judged", action="store_true", help="the judged run (float64; the kill from outside)")
    p.add_argument("--rejoin-delay-s", type=float, default=REJOIN_DELAY_S, help="the judged run's restart delay")
    p.add_argument("--seed", type=int, default=None, help="the judged run's kill (default: random, printed)")
    p.add_argument("--job-timeout-s", type=float, default=300.0)
    p.add_argument("--worker", choices=("elastic", "restart", "steps", "judged", "reference"), default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--until", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--float64", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kill-inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the rows here")
    o = p.parse_args()
    if o.refresh_every is None:
        from trainer.sharding.redundancy import REFRESH_EVERY
        o.refresh_every = REFRESH_EVERY
    if o.worker:
        o.mode = o.worker
        asyncio.run(worker(o))
        return
    o.kill_inside, o.float64 = False, o.judged
    strategies = (o.strategies or ("fsdp,ddp" if o.judged else "ddp,fsdp")).split(",")
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        if o.judged:
            seed = o.seed if o.seed is not None else random.randrange(1 << 30)
            pick = random.Random(seed)
            rows = [judged_row(o, s, Path(tmp), pick) for s in strategies]
        else:
            rows = [(cost_row if o.cost else recovery_row)(o, s, Path(tmp)) for s in strategies]
    if o.judged:
        print(f"judged run: {o.model}, float64, {o.ranks} ranks, the trainer's global batch; a random rank SIGKILLed "
              f"after a random step, its slot restarted {o.rejoin_delay_s:g} s later (seed {seed})\n")
        print("| strategy | killed | steps | params max abs diff | losses max abs diff | survivors kept | "
              "kill -> first shrunk step (s) | joiner: main (after imports) -> training (s) | "
              "restart path: kill -> first step (s) | restart path: params, losses max abs diff | wall (s) |")
        print("| --- " * 11 + "|")
        for r in rows:
            e, s = r["elastic"], r["restart"]
            print(f"| {r['strategy']} | rank {r['killed_rank']} after step {r['kill_after_step']} | {r['steps']} | "
                  f"{e['params']:.2e} | {e['loss']:.2e} | {'yes' if r['survivors_kept'] and r['joiners'] == 1 else 'NO'}"
                  f" | {fmt(r['shrink_s'])} | {fmt(r['joiner_s'])} | {fmt(r['restart_s'])} | "
                  f"{s['params']:.2e}, {s['loss']:.2e} | {r['wall_s']:.0f} |")
    else:
        print(f"{o.model} at {o.ranks} ranks" + ("" if o.cost else f", rank 1 SIGKILLed at step {o.kill_step}")
              + f"; buddy refresh every {o.refresh_every} steps\n")
        print("| strategy | kill -> first step, shrunk (s) | joiner: main -> training (s) | restart path: kill -> "
              "first step (s) | step off / on, median (s) | on/off | off / on, mean (s) | on/off | buddy MB (state MB) |")
        print("| --- " * 9 + "|")
        for r in rows:
            print(f"| {r['strategy']} | {fmt(r.get('shrink_s'))} | {fmt(r.get('joiner_s'))} | {fmt(r.get('restart_s'))}"
                  f" | {r['step_off_s']:.3f} / {r['step_on_s']:.3f} | {r['ratio']:.3f} | {r['mean_off_s']:.3f} / "
                  f"{r['mean_on_s']:.3f} | {r['mean_ratio']:.3f} | {r['buddy_mb']:.2f} ({r['state_mb']:.2f}) |")
    if o.json:
        Path(o.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
