"""Compression end to end: the default GPT on 2 emulated hosts x 2 ranks, each gradient codec
against uncompressed and against torch DDP on Gloo (plain, and with torch's PowerSGD hook): the
time to reach the validation loss the uncompressed run reaches, and tokens/s.

    sudo python bench/compress_e2e.py --rate 100mbit,1gbit --out bench/results/compression.md
    sudo python bench/compress_e2e.py --rate 100mbit --epochs 1 --windows 256 --evals-per-epoch 2 --out /tmp/e2e.md
    python bench/compress_e2e.py --from-json bench/results/compress_e2e.json --out /tmp/again.md   # table + plot again
    python bench/compress_e2e.py --out x.md --estimate --rate 100mbit       # how long, running nothing
    sudo python bench/compress_e2e.py --rate 1gbit --variants 'ddp none,ddp int8+ef,torch-ddp' --out /tmp/g/e2e.md
    python bench/compress_e2e.py --from-json /tmp/a/compress_e2e.json,/tmp/b/compress_e2e.json --out x.md  # together

Each run is its own job on its own emulated network (bench/netem.py: 2 network namespaces, 2
ranks each, every link shaped to ``--rate`` both ways; TCP only, also between the ranks of one
host). Variants, per rate:

* ``python -m trainer --model gpt --strategy S --compression C --bucket-cap-mb B`` for S in
  ``--strategies`` (ddp, fsdp) and C in ``--codecs`` (none, int8+ef, topk+ef, powersgd+ef; top-k
  at ``--topk-ratio`` when given); a pair the trainer refuses (powersgd under fsdp: it compresses
  matrices, fsdp reduce-scatters blocks) is a table row that says why, asked of the trainer's own
  strategy constructors, not run. Top-k and our PowerSGD (ddp: each bucket's matrices, rank
  ``--powersgd-rank``) send their first ``--codec-warmup-epochs`` uncompressed (the trainer's
  --compression-start; top-k without DGC's ramp), as torch's hook below does. B (default 0.5 MiB:
  one bucket per layer of the default GPT)
  lets ddp send each layer's gradient while backward goes on; with the trainer's 25 MiB all but
  the first 1 MiB bucket wait for the end of backward. torch DDP takes the same B;
* torch DDP on Gloo (``torch-ddp``), and the same with torch's PowerSGD hook (``torch-ddp
  powersgd``: rank ``--powersgd-rank``, error feedback and warm start, vanilla all_reduce for the
  first ``--codec-warmup-epochs``; the whole model in one bucket), when torch is importable (``--torch auto``; skipped with a
  note otherwise). Its model is bench/trainer.py's torch GPT (nanoGPT's layout of the same
  architecture), started from the trainer's initial parameters (seed 0, copied in), on the
  trainer's data order, with the trainer's AdamW (decay on the matrices only) and learning-rate
  schedule: the same run as ``ddp none`` up to float rounding. Its Gloo store (a TCPStore) is on
  the master's address, the port after the launcher's; Gloo's pairs on the interface that
  routes there (bench/collectives.py gloo_interface).

Budget: ``--epochs`` (default 2) of ``--windows`` training windows each (default: the trainer's
epoch, training bytes / block size = 6,554), global batch 64, evaluated ``--evals-per-epoch``
times per epoch: the trainer runs epochs of windows/K (rounded up to whole batches), so its
validation loss comes K times per epoch. The learning-rate warm-up stays half an epoch of the
full size, and top-k's and PowerSGD's uncompressed start is ``--codec-warmup-epochs`` (default
0.5). The table's header states all of it. ``--variants``
picks variants by label, ``--estimate`` prints how long the runs should take (from the recorded
run's seconds per step, bench/results/compress_e2e.json) and runs nothing; the estimate is printed before every run too.

Measured, per variant: the validation loss after each of those intervals against the training
clock (seconds since training began, evaluation excluded: every variant evaluates alike, and the
evaluation is no part of a step), tokens/s = steps x 64 x 64 / training seconds. Target, per
rate: L = the final validation loss of the same strategy's uncompressed run (torch's rows: ddp
none's); "time to target" is when the curve first reaches L x (1 + ``--tolerance``), linearly
interpolated between evaluations (tolerance default 1%, the loss margin the goal allows; 0 for
L itself, which a codec ending a hair above L never reaches). Goals, printed, never asserted: on
100 Mbit/s the best codec reaches the target at least 2x sooner than uncompressed and than torch
DDP; no variant ends more than 1% above L.

Output: one section of ``--out`` (markdown: header, a table per rate, the goals), which replaces
the section of the same heading there (or is added at the end); beside it compress_e2e.png (one
panel per rate, validation loss against the training clock, one line per variant) and
compress_e2e.json, the data, saved after every job (``--from-json`` draws the section and the
plot again from it). Needs root (bench/netem.py);
a run killed by SIGKILL leaves namespaces that ``bench/netem.py --cleanup`` removes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# run as a script, bench/ is sys.path[0]: bench/trainer.py and bench/collectives.py would shadow the packages
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, _ROOT)

STRATEGIES = ("ddp", "fsdp")
CODECS = ("none", "int8+ef", "topk+ef", "powersgd+ef")
BATCH = 64  # the trainer's global batch of windows for the GPT
BLOCK = 64  # its block size: tokens per window
RATE = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$", re.IGNORECASE)  # as tc spells a rate
STOP_GRACE_S = 90  # netem's clean-up after SIGTERM (its own grace periods, then every namespace deleted)


@dataclass(frozen=True)
class Variant:
    framework: str  # "ringweave" | "torch"
    strategy: str  # "ddp" | "fsdp"
    codec: str  # "none" | "int8+ef" | "topk+ef" | "powersgd"

    @property
    def label(self) -> str:
        """e.g. "ddp int8+ef", "torch-ddp", "torch-ddp powersgd"."""
        head = self.strategy if self.framework == "ringweave" else f"torch-{self.strategy}"
        return head if self.framework == "torch" and self.codec == "none" else f"{head} {self.codec}"


@dataclass(frozen=True)
class Budget:
    """How long each variant trains, and how often it is evaluated."""
    epochs: float  # e.g. 2
    epoch_windows: int  # training windows of one epoch, e.g. 6554
    evals_per_epoch: int  # e.g. 4
    codec_warmup_epochs: float  # e.g. 0.5

    @property
    def intervals(self) -> int:
        """Evaluations in the run: the trainer's --epochs."""
        return max(1, round(self.epochs * self.evals_per_epoch))

    @property
    def interval_windows(self) -> int:
        """The trainer's --windows-per-epoch: an epoch / K, rounded up to whole batches."""
        return max(1, math.ceil(self.epoch_windows / self.evals_per_epoch / BATCH)) * BATCH

    @property
    def steps(self) -> int:
        return self.intervals * self.interval_windows // BATCH

    @property
    def epoch_steps(self) -> int:
        return math.ceil(self.epoch_windows / BATCH)

    @property
    def lr_warmup_steps(self) -> int:
        """The trainer's default for an epoch of the full size: half of it."""
        return self.epoch_steps // 2

    @property
    def codec_warmup_steps(self) -> int:
        return round(self.codec_warmup_epochs * self.epoch_steps)

    def describe(self) -> str:
        done = self.steps * BATCH / self.epoch_windows
        return (f"{self.epochs:g} epochs of {self.epoch_windows:,} windows, global batch {BATCH}: {self.steps} steps "
                f"({self.steps * BATCH:,} windows, {done:.2f} epochs), evaluated {self.intervals} times (every "
                f"{self.interval_windows // BATCH} steps); learning-rate warm-up {self.lr_warmup_steps} steps; top-k's "
                f"and PowerSGD's (ours and torch's) uncompressed start {self.codec_warmup_steps} steps "
                f"({self.codec_warmup_epochs:g} epochs)")

    def deviations(self, default_windows: int) -> list[str]:
        """How this budget differs from 2 epochs of the trainer's epoch (the goal's), said plainly."""
        out = []
        if self.epochs != 2:
            out.append(f"{self.epochs:g} epoch{'' if self.epochs == 1 else 's'}, not the 2 the goal names")
        if self.epoch_windows != default_windows:
            out.append(f"epochs of {self.epoch_windows:,} windows, not the trainer's {default_windows:,}")
        return out


def default_epoch_windows() -> int:
    """The trainer's epoch of the default GPT: training bytes / block size."""
    from trainer.cli import load_data, parse_args
    return len(load_data(parse_args(["--model", "gpt"])).train)


def trainer_args(variant: Variant, budget: Budget, metrics: str, bucket_cap_mb: float | None = None,
                 topk_ratio: float | None = None, flat: bool = False,
                 powersgd_rank: int | None = None) -> list[str]:
    """`python -m trainer` arguments of a variant (torch's worker reads the same for its data,
    model, schedule and bucket size). ``bucket_cap_mb``: ddp's (None: the trainer's default);
    ``topk_ratio``: top-k's kept fraction (None: the codec's default); ``flat``: ddp compresses
    between every pair of ranks (the trainer's --compression-flat), not host first; ``powersgd_rank``:
    our PowerSGD's rank (None: the codec's, 4). Top-k and PowerSGD start after the budget's codec
    warm-up, sent uncompressed (--compression-start: torch's start_powerSGD_iter), not on DGC's ramp."""
    args = ["--model", "gpt", "--strategy", "ddp" if variant.framework == "torch" else variant.strategy,
            "--batch-size", str(BATCH), "--epochs", str(budget.intervals),
            "--windows-per-epoch", str(budget.interval_windows), "--warmup-steps", str(budget.lr_warmup_steps),
            "--metrics", metrics, "--quiet", "--seed", "0"]
    if bucket_cap_mb is not None:
        args += ["--bucket-cap-mb", f"{bucket_cap_mb:g}"]
    if variant.framework == "ringweave" and variant.codec != "none":
        codec = variant.codec
        if codec.startswith("topk") and topk_ratio is not None:
            codec += f":ratio={topk_ratio:g}"
        if codec.startswith("powersgd") and powersgd_rank is not None:
            codec += f":rank={powersgd_rank}"
        args += ["--compression", codec] + (["--compression-flat"] if flat and variant.strategy == "ddp" else [])
        if codec.startswith("topk"):
            args += ["--compression-warmup-steps", "0"]  # no DGC ramp: the uncompressed start instead
        if codec.startswith(("topk", "powersgd")) and budget.codec_warmup_steps:
            args += ["--compression-start", str(budget.codec_warmup_steps)]  # as torch's PowerSGD hook gets
    return args


def job(variant: Variant, budget: Budget, metrics: str, powersgd_rank: int, **knobs) -> list[str]:
    """What bench/netem.py runs after ``--`` for a variant (torch's worker: its options, then
    ``--trainer`` and the trainer's arguments, which give it the data, model and schedule);
    ``knobs``: :func:`trainer_args`' bucket_cap_mb, topk_ratio and flat. ``powersgd_rank``: ours
    and torch's hook alike."""
    if variant.framework == "ringweave":
        return ["-m", "trainer", *trainer_args(variant, budget, metrics, powersgd_rank=powersgd_rank, **knobs)]
    rank = powersgd_rank if variant.codec == "powersgd" else 0
    return [os.path.abspath(__file__), "--torch-worker", "--powersgd-rank", str(rank),
            "--powersgd-start", str(max(2, budget.codec_warmup_steps)), "--trainer",
            *trainer_args(variant, budget, metrics, **knobs)]


# ---- which variants run ---------------------------------------------------------------------


def refusals(strategies, codecs) -> dict[tuple[str, str], str]:
    """{(strategy, codec): the trainer's reason} for the pairs its strategy constructors refuse,
    asked of them on 2 in-process ranks (a tiny MLP: the refusals depend on the codec alone)."""
    from runtime.testing import run_ranks
    from trainer.cli import make_config, parse_args
    from trainer.nn import mlp
    from trainer.sharding import make_strategy

    async def body(group):
        found = {}
        for s in strategies:
            for c in codecs:
                if c == "none":
                    continue
                config = make_config(parse_args(["--strategy", s, "--compression", c]), 1)
                try:
                    strategy = make_strategy(s, mlp(4, (8,), 2, pad_to=group.size), config, group)
                except ValueError as exc:
                    found[s, c] = str(exc).splitlines()[0]
                else:
                    if hasattr(strategy, "close"):
                        strategy.close()
        return found

    return asyncio.run(run_ranks(2, body))[0]


def variants(strategies, codecs, torch: bool) -> tuple[list[Variant], dict[Variant, str]]:
    """(the variants to run, {refused variant: why}): every strategy x codec the trainer takes,
    then torch DDP plain and with PowerSGD (when ``torch``)."""
    refused = refusals(strategies, codecs)
    run, skip = [], {}
    for s in strategies:
        for c in codecs:
            v = Variant("ringweave", s, c)
            if (s, c) in refused:
                skip[v] = refused[s, c]
            else:
                run.append(v)
    if torch:
        run += [Variant("torch", "ddp", "none"), Variant("torch", "ddp", "powersgd")]
    return run, skip


def all_labels() -> list[str]:
    """Every variant's label, refused or not: what --variants picks from."""
    return [f"{s} {c}" for s in STRATEGIES for c in CODECS] + ["torch-ddp", "torch-ddp powersgd"]


def knobs_of(args) -> dict:
    """The trainer's knobs this run sets for every variant (see :func:`trainer_args`)."""
    return {"bucket_cap_mb": args.bucket_cap_mb, "topk_ratio": args.topk_ratio, "flat": args.compression_flat}


PER_JOB_S, WARM_JOB_S = 10.0, 15.0  # launch and exit of one job; one cache-warming job


def prior_wall_s_per_step(path: str | None = None) -> dict[str, dict[str, float]]:
    """rate -> label -> wall seconds per step of each variant in the recorded run (``path``, default
    bench/results/compress_e2e.json: wall_s / steps): what the estimate scales. Empty where there
    is no readable record."""
    path = path or os.path.join(_ROOT, "bench", "results", NAME + ".json")
    try:
        with open(path) as f:
            results = json.load(f)["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    prior: dict[str, dict[str, float]] = {}
    for r in results:
        if isinstance(r, dict) and r.get("steps") and isinstance(r.get("wall_s"), (int, float)):
            prior.setdefault(r["rate"], {})[r["label"]] = r["wall_s"] / r["steps"]
    return prior


def estimate_s(rates, labels, steps: int, prior: dict | None = None) -> float:
    """Seconds the grid should take on 2 quiet cores: per job PER_JOB_S plus its prior seconds per
    step (``prior``, default :func:`prior_wall_s_per_step`) x ``steps`` (a rate not measured: the
    nearest measured one, by the rate's bits per second; a variant not measured: its strategy's
    none, else 0.6 s), plus one cache-warming job per ringweave variant."""
    prior_all = prior_wall_s_per_step() if prior is None else prior
    def bps(rate: str) -> float:
        num, unit = re.match(r"^(\d+(?:\.\d+)?)([kmgt]?)", rate.lower()).groups()
        return float(num) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit]
    total = WARM_JOB_S * sum(not label.startswith("torch") for label in labels)
    for rate in rates:
        prior = prior_all.get(rate) or (prior_all[min(prior_all, key=lambda r: abs(math.log(bps(r) / bps(rate))))]
                                        if prior_all else {})
        for label in labels:
            per_step = prior.get(label) or prior.get(f"{label.split()[0].removeprefix('torch-')} none", 0.6)
            total += PER_JOB_S + per_step * steps
    return total


# ---- reading a run ------------------------------------------------------------------------


def curve(rows: list[dict]) -> dict:
    """A metrics file's rows -> {"points": [(training s, val loss)], "train_s", "steps"}: the
    training clock is elapsed_s less the evaluations before it (an epoch row's elapsed_s less
    the last step's is that evaluation)."""
    points, eval_s, last, steps, train_s = [], 0.0, 0.0, 0, 0.0
    for r in rows:
        if r.get("kind") == "step":
            last, steps = float(r["elapsed_s"]), int(r["step"])
            train_s = last - eval_s
        elif r.get("kind") == "epoch":
            if r.get("val_loss") is not None:
                points.append((last - eval_s, float(r["val_loss"])))
            if r.get("elapsed_s") is not None:
                eval_s += max(0.0, float(r["elapsed_s"]) - last)
    return {"points": points, "train_s": train_s, "steps": steps}


def time_to_target(points, target: float) -> float | None:
    """When the loss curve first reaches ``target``: linear between the evaluations around the
    crossing, the first evaluation's time if it is there already, None if never."""
    prev = None
    for t, loss in points:
        if loss <= target:
            if prev is None:
                return float(t)
            t0, l0 = prev
            return float(t0 + (l0 - target) / (l0 - loss) * (t - t0))
        prev = (t, loss)
    return None


# ---- the table and the plot -------------------------------------------------------------------


def baseline_of(result: dict, by_label: dict) -> dict | None:
    """The uncompressed run a result is measured against: its strategy's none; torch's: ddp none."""
    strategy = result["strategy"] if result["framework"] == "ringweave" else "ddp"
    return by_label.get(f"{strategy} none")


def analyse(results: list[dict], tolerance: float) -> dict[str, list[dict]]:
    """{rate: rows}: each result with its target, times to it, ratios and final-loss gap."""
    out = {}
    for rate in dict.fromkeys(r["rate"] for r in results):
        mine = [r for r in results if r["rate"] == rate]
        by_label = {r["label"]: r for r in mine if r.get("points")}
        rows = []
        for r in mine:
            row = dict(r)
            base = baseline_of(r, by_label)
            if r.get("points") and base is not None:
                L = base["points"][-1][1]
                row["target"], row["final"] = L, r["points"][-1][1]
                row["gap"] = row["final"] / L - 1
                row["t_strict"] = time_to_target(r["points"], L)
                row["t_target"] = time_to_target(r["points"], L * (1 + tolerance))
            rows.append(row)
        t_of = {row["label"]: row.get("t_target") for row in rows}
        for row in rows:
            t = row.get("t_target")
            base = t_of.get(f"{row['strategy'] if row['framework'] == 'ringweave' else 'ddp'} none")
            torch = t_of.get("torch-ddp")
            row["x_uncompressed"] = base / t if t and base else None
            row["x_torch"] = torch / t if t and torch else None
        out[rate] = rows
    return out


def goals(rate: str, rows: list[dict]) -> list[str]:
    """The goal lines of one rate: the best codec's speed-ups, and the final losses."""
    codecs = [r for r in rows if r["framework"] == "ringweave" and r["codec"] != "none" and r.get("t_target")]
    lines = []
    if codecs:
        best = min(codecs, key=lambda r: r["t_target"])
        for key, what in (("x_uncompressed", f"{best['strategy']} none"), ("x_torch", "torch-ddp")):
            x = best.get(key)
            verdict = "no figure" if x is None else ("met" if x >= 2 else "NOT met")
            lines.append(f"{rate}: the best codec, {best['label']}, reaches the target "
                         f"{'?' if x is None else f'{x:.2f}'}x sooner than {what} (goal >= 2x: {verdict})")
    else:
        lines.append(f"{rate}: no codec reached the target (goal >= 2x sooner: NOT met)")
    ran = [r for r in rows if r.get("gap") is not None]
    worse = [f"{r['label']} {100 * r['gap']:+.2f}%" for r in ran if r["gap"] > 0.01 + 1e-9]  # 1% exactly is within
    failed = [r["label"] for r in rows if r.get("error")]
    lines.append(f"{rate}: final validation loss within 1% of the uncompressed run's: "
                 + ("NOT met (" + ", ".join(worse) + ")" if worse else "met" if ran else "no figure")
                 + (f"; failed: {', '.join(failed)}" if failed else ""))
    return lines


def _f(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def markdown(meta: dict, analysed: dict[str, list[dict]]) -> str:
    """The results section: header (command, machine, date, budget, definitions), a table per rate, goals."""
    tol = meta["tolerance"]
    lines = [f"## {meta['title']}", "",
             f"- Command: `{meta['command']}`",
             f"- Machine: {meta['machine']}, load {meta['load_before']:.1f} before, {meta['load_after']:.1f} after",
             f"- Date: {meta['date']}",
             f"- Budget: {meta['budget']}" + (f" (**{meta['deviation']}**)" if meta.get("deviation") else ""),
             f"- Network: 2 emulated hosts x 2 ranks (bench/netem.py), every link shaped by tc to the rate, both "
             f"ways (rate only: no delay or loss), TCP only; torch {meta.get('torch') or 'not installed: no torch rows'}",
             "",
             f"Target L: the final validation loss of the same strategy's uncompressed run (torch's rows: ddp "
             f"none's). \"to L+{100 * tol:g}%\": training seconds until the validation loss first reaches "
             f"L x {1 + tol:g} (interpolated between evaluations; evaluation time excluded), the speed-ups are of "
             f"that; \"to L\": until it reaches L itself. tokens/s: steps x 64 windows x 64 tokens / training "
             f"seconds. wall s: the job from launch to exit. Before the runs, one tiny job per variant on loopback "
             f"filled the kernel caches (no compile inside a timed run).", ""]
    for rate, rows in analysed.items():
        lines += [f"### {rate}", "",
                  f"| variant | final val loss | vs L | to L+{100 * tol:g}% s | x uncompressed | x torch DDP | "
                  f"to L s | tokens/s | training s | wall s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            if r.get("refused"):
                lines.append(f"| {r['label']} | refused by the trainer: {r['refused']} | | | | | | | | |")
                continue
            if r.get("error"):
                lines.append(f"| {r['label']} | failed: {r['error']} | | | | | | | | |")
                continue
            tps = r["steps"] * BATCH * BLOCK / r["train_s"] if r.get("train_s") else None
            gap = None if r.get("gap") is None else f"{100 * r['gap']:+.2f}%"
            lines.append(
                f"| {r['label']} | {_f(r.get('final'), '.4f')} | {gap or '-'} | "
                f"{_f(r.get('t_target'), '.1f', 'not reached')} | {_f(r.get('x_uncompressed'), '.2f')} | "
                f"{_f(r.get('x_torch'), '.2f')} | {_f(r.get('t_strict'), '.1f', 'not reached')} | "
                f"{_f(tps, ',.0f')} | {_f(r.get('train_s'), '.1f')} | {_f(r.get('wall_s'), '.0f')} |")
        lines.append("")
    lines += ["Goals (on 100 Mbit/s; printed for every rate, never asserted):", ""]
    for rate, rows in analysed.items():
        lines += [f"- {g}" for g in goals(rate, rows)]
    if meta.get("plot"):
        lines += ["", f"![validation loss against training time]({os.path.basename(meta['plot'])})"]
    return "\n".join(lines) + "\n"


def plot(path: str, analysed: dict[str, list[dict]], title: str) -> str:
    """A PNG: one panel per rate, validation loss against the training clock, one line per
    variant, the target as a dotted line. Returns a line saying where it went, or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"plot skipped: matplotlib is not importable ({e}); pip install matplotlib"
    rates = [rate for rate, rows in analysed.items() if any(r.get("points") for r in rows)]
    if not rates:
        return "plot skipped: no run has a validation loss"
    fig, axes = plt.subplots(1, len(rates), figsize=(6.4 * len(rates), 4.4), squeeze=False)
    for ax, rate in zip(axes.flat, rates):
        target = None
        for r in analysed[rate]:
            if r.get("points"):
                ax.plot([p[0] for p in r["points"]], [p[1] for p in r["points"]], marker="o", markersize=3,
                        label=r["label"], linestyle="--" if r["framework"] == "torch" else "-")
                target = r.get("target", target) if r["codec"] == "none" and r["framework"] == "ringweave" else target
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1, label="L (uncompressed, end)")
        ax.set_title(rate)
        ax.set_xlabel("training seconds (evaluation excluded)")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


TITLE = "End to end: the default GPT on 2 hosts x 2 ranks, compressed against uncompressed and torch DDP"
NAME = "compress_e2e"  # the plot's and the data's file names beside --out: compress_e2e.png, .json


def beside(out: str, ext: str) -> str:
    """The plot (.png) or the data (.json) in --out's folder."""
    return os.path.join(os.path.dirname(os.path.abspath(out)), NAME + ext)


def put_section(path: str, text: str) -> None:
    """Writes ``text`` (one "## " section) into the markdown file at ``path``: in place of the
    section with the same heading where there is one, else at the end (the file made if missing)."""
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    heading = text.split("\n", 1)[0]
    parts = [p.rstrip("\n") for p in re.split(r"(?m)^(?=## )", old) if p.strip()]
    at = next((i for i, p in enumerate(parts) if p.split("\n", 1)[0] == heading), None)
    if at is None:
        parts.append(text.rstrip("\n"))
    else:
        parts[at] = text.rstrip("\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n\n".join(parts) + "\n")
    os.replace(tmp, path)


def write_outputs(out: str, meta: dict, results: list[dict]) -> list[str]:
    """The section into --out (replacing its namesake), the plot beside it; the lines to print."""
    meta = dict(meta, plot=beside(out, ".png"))
    analysed = analyse(results, meta["tolerance"])
    said = [plot(meta["plot"], analysed, "the default GPT, 2 hosts x 2 ranks: validation loss against training time")]
    if not said[0].startswith("wrote"):
        meta["plot"] = None
    put_section(out, markdown(meta, analysed))
    said.append(f"wrote {out}")
    return said


# ---- the run --------------------------------------------------------------------------------


class Stopped(SystemExit):
    """A signal asked this run to stop; the exit status is 128 + the signal's number."""


def _on_signal(signum, frame) -> None:
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(128 + signum)


def run_variant(args, rate: str, variant: Variant, budget: Budget, scratch: str) -> dict:
    """One job under bench/netem.py; its curve, tokens/s and wall time, or its error."""
    from trainer.metrics import read_metrics
    name = re.sub(r"[^a-z0-9]+", "-", f"{rate}-{variant.label}".lower())
    metrics, log_path = os.path.join(scratch, name + ".csv"), os.path.join(scratch, name + ".log")
    cmd = [sys.executable, os.path.join(_HERE, "netem.py"), "-n", "2", "--per-node", "2", "--rate", rate,
           "--max-time-s", str(args.max_time_s), "--",
           *job(variant, budget, metrics, args.powersgd_rank, **knobs_of(args))]
    result = {"rate": rate, "label": variant.label, **asdict(variant), "load_before": os.getloadavg()[0]}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            code = proc.wait(timeout=args.max_time_s + 120)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:  # a timeout or a signal: netem stops its jobs and deletes its namespaces
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    result["wall_s"], result["load_after"] = time.perf_counter() - t0, os.getloadavg()[0]
    with open(log_path) as f:
        tail = f.read()[-3000:]
    if code != 0:
        result["error"] = "timed out" if code is None else f"exit {code}"
        print(f"  {variant.label}: {result['error']}; the job's output ends:\n{tail}", file=sys.stderr, flush=True)
        return result
    if not os.path.exists(metrics):
        result["error"] = "no metrics file"
        return result
    result.update(curve(read_metrics(metrics)))
    if not result["points"]:
        result["error"] = "no validation loss in its metrics"
    return result


QUIET_WAIT_S = 300.0  # the longest a job waits for --quiet-start


def wait_for_load(below: float, limit_s: float, *, load=os.getloadavg, sleep=time.sleep) -> float:
    """Waits (at most ``limit_s``) until the 1-minute load average is under ``below``: the previous
    job's ranks decay out of it, so each job starts on a machine its predecessor has left. Returns
    the load it started at (printed, and over ``below`` where the wait ran out)."""
    deadline = time.monotonic() + limit_s
    while (now := load()[0]) >= below and time.monotonic() < deadline:
        sleep(2.0)
    if now >= below:
        print(f"compress_e2e: the load is still {now:.2f} after {limit_s:.0f} s; starting anyway",
              file=sys.stderr, flush=True)
    return now


def warm_caches(todo: list[Variant], scratch: str, knobs: dict | None = None) -> None:
    """One tiny job per codec and strategy to run, on loopback: the kernels compile into Numba's
    cache here, not inside the first timed run's training clock (a cold cache cost a first step
    ~15 s)."""
    for v in todo:
        if v.framework != "ringweave":
            continue
        args = trainer_args(v, Budget(1, BATCH, 1, 0), os.path.join(scratch, "warm.csv"), **(knobs or {}))  # one step
        cmd = [sys.executable, "-m", "runtime.launch", "-n", "2", "--max-time-s", "300", "-m", "trainer", *args]
        print(f"warming the kernel caches: {v.label}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, cwd=_ROOT, env=dict(os.environ, RINGWEAVE_SHM="0"), capture_output=True,
                              text=True, timeout=360)
        if done.returncode:
            raise SystemExit(f"compress_e2e: the warm-up job of {v.label} failed:\n{done.stderr[-2000:]}")


def run_grid(args, budget: Budget, meta: dict) -> list[dict]:
    """Every variant at every rate, each its own netem job; fills ``meta`` (the header's facts) and
    saves the results so far after each job (--out's .json: a run stopped halfway keeps them)."""
    import importlib.metadata
    import importlib.util
    torch_version = importlib.metadata.version("torch") if importlib.util.find_spec("torch") else None
    use_torch = torch_version is not None and args.torch != "off"
    if args.torch == "on" and torch_version is None:
        raise SystemExit("compress_e2e: --torch on needs torch (pip install torch)")
    if args.torch == "auto" and torch_version is None:
        print("compress_e2e: torch is not importable: no torch-ddp rows", file=sys.stderr)
    todo, refused = variants(args.strategies, args.codecs, use_torch)
    if args.variants:
        todo = [v for v in todo if v.label in args.variants]
        refused = {v: why for v, why in refused.items() if v.label in args.variants}
    from bench._machine import describe
    meta.update(machine=describe().describe(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                load_before=os.getloadavg()[0], torch=torch_version)
    results = []

    def save():
        meta["load_after"] = os.getloadavg()[0]
        with open(beside(args.out, ".json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)

    with tempfile.TemporaryDirectory(prefix="rwe2e") as scratch:
        warm_caches(todo, scratch, knobs_of(args))
        for rate in args.rate:
            for v in todo:
                if args.quiet_start is not None:
                    wait_for_load(args.quiet_start, QUIET_WAIT_S)
                print(f"{rate} {v.label} ...", file=sys.stderr, flush=True)
                r = run_variant(args, rate, v, budget, scratch)
                if r.get("points"):
                    print(f"{rate} {v.label}: final val loss {r['points'][-1][1]:.4f}, {r['train_s']:.1f} s of "
                          f"training, {r['wall_s']:.0f} s in all", file=sys.stderr, flush=True)
                results.append(r)
                save()
            results += [{"rate": rate, "label": v.label, **asdict(v), "refused": why} for v, why in refused.items()]
    save()
    return results


# ---- torch's worker -------------------------------------------------------------------------


def _torch_params(module, ours, params) -> None:
    """Copies the trainer GPT's initial parameters (one flat array per unit) into bench/trainer.py's
    torch GPT: the same values, torch's Linear weights being ours transposed."""
    import torch
    with torch.no_grad():
        ends = ours.units[0].views(params[0])
        module.wte.weight.copy_(torch.from_numpy(ends["wte.weight"]))
        module.wpe.weight.copy_(torch.from_numpy(ends["wpe.weight"]))
        module.ln_f.weight.copy_(torch.from_numpy(ends["ln_f.weight"]))
        module.ln_f.bias.copy_(torch.from_numpy(ends["ln_f.bias"]))
        for block, unit, flat in zip(module.blocks, ours.units[1:], params[1:]):
            p = unit.views(flat)
            for mine, theirs in (("ln_1", block.ln_1), ("ln_2", block.ln_2)):
                theirs.weight.copy_(torch.from_numpy(p[f"{mine}.weight"]))
                theirs.bias.copy_(torch.from_numpy(p[f"{mine}.bias"]))
            for mine, theirs in (("attn.qkv", block.qkv), ("attn.proj", block.proj), ("mlp.fc", block.fc),
                                 ("mlp.proj", block.fc_proj)):
                theirs.weight.copy_(torch.from_numpy(p[f"{mine}.weight"].T))
                theirs.bias.copy_(torch.from_numpy(p[f"{mine}.bias"]))


def torch_setup(targs):
    """(data, TrainConfig, schedule, the torch module, its loss) of the trainer's arguments."""
    import torch
    from bench.trainer import _torch_model
    from trainer.cli import build_model, load_data, make_config
    from trainer.loop import steps_per_epoch
    from trainer.sharding.data_parallel import make_schedule

    data = load_data(targs)
    config = make_config(targs, steps_per_epoch(len(data.train), targs.batch_size, targs.grad_accum))
    ours = build_model(targs, data)
    module, loss_fn = _torch_model(argparse.Namespace(model="gpt", n_embd=targs.n_embd, n_head=targs.n_head,
                                                      block_size=targs.block_size, n_layer=targs.n_layer))
    _torch_params(module, ours, ours.init_params(config.seed))
    torch.manual_seed(config.seed)
    return data, config, make_schedule(config), module, loss_fn


def torch_optimizer(module, config):
    """The trainer's AdamW: decay on the layers' matrices only (not biases, LayerNorms, embeddings)."""
    import torch
    decay = [p for name, p in module.named_parameters() if p.dim() == 2 and not name.startswith(("wte", "wpe"))]
    ids = {id(p) for p in decay}
    rest = [p for p in module.parameters() if id(p) not in ids]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=config.lr, betas=config.betas, eps=1e-8)


def torch_worker(argv: list[str]) -> int:
    """One rank of torch DDP on Gloo, on the trainer's data, model, optimizer and schedule."""
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist
    from threadpoolctl import threadpool_limits

    from bench.collectives import gloo_interface
    from trainer.allocator import retain_freed_memory
    from trainer.cli import parse_args
    from trainer.data import iter_local_batches, split_bounds
    from trainer.metrics import MetricsLog, StepMetrics

    p = argparse.ArgumentParser(prog="compress_e2e.py --torch-worker")
    p.add_argument("--powersgd-rank", type=int, default=0, help="0: plain DDP")
    p.add_argument("--powersgd-start", type=int, default=2)
    split = argv.index("--trainer")  # what follows: python -m trainer's arguments
    wargs, targs = p.parse_args(argv[:split]), parse_args(argv[split + 1:])
    retain_freed_memory()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master = os.environ["MASTER_ADDR"]
    gloo_interface(master)
    store = dist.TCPStore(master, int(os.environ["MASTER_PORT"]) + 1, world, is_master=rank == 0,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    log = None
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            data, config, schedule, module, loss_fn = torch_setup(targs)
            # PowerSGD: one bucket for the whole model (3.3 MB). With two, the hook's chained all_reduces
            # of P and Q start in whatever order each rank's callbacks run, and Gloo pairs them wrongly
            # (a size mismatch in compute_qs on 2 hosts x 2 ranks).
            model = torch.nn.parallel.DistributedDataParallel(
                module, bucket_cap_mb=64 if wargs.powersgd_rank else targs.bucket_cap_mb)
            if wargs.powersgd_rank:
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
                state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=wargs.powersgd_rank,
                                           start_powerSGD_iter=wargs.powersgd_start, use_error_feedback=True,
                                           warm_start=True, random_seed=0)
                model.register_comm_hook(state, psgd.powerSGD_hook)
            opt = torch_optimizer(module, config)
            if rank == 0:
                log = MetricsLog(targs.metrics, writer_class=False, say=lambda line: None)
            val_lo, val_hi = split_bounds(len(data.val), world)[rank:rank + 2]
            step, T = 0, targs.block_size
            dist.barrier()
            started = time.perf_counter()
            for epoch in range(targs.epochs):
                batches = list(iter_local_batches(len(data.train), targs.batch_size, world, rank, seed=config.seed,
                                                  epoch=epoch, shuffle=True))
                for k, b in enumerate(batches):
                    t0 = time.perf_counter()
                    x, y = (torch.from_numpy(a) for a in data.train.get(b.indices, epoch))
                    for group in opt.param_groups:
                        group["lr"] = schedule(step)
                    opt.zero_grad(set_to_none=True)
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    opt.step()
                    step += 1
                    rate = b.global_size / (time.perf_counter() - t0)
                    if log is not None:
                        log.step(StepMetrics(step=step, epoch=epoch, step_in_epoch=k + 1, loss=float(loss),
                                             lr=schedule(step - 1), grad_norm=None, loss_scale=None, skipped=False,
                                             samples_per_s=rate, tokens_per_s=rate * T,
                                             elapsed_s=time.perf_counter() - started))
                with torch.no_grad():  # the validation loss over every window, split over the ranks
                    total = torch.zeros(2, dtype=torch.float64)
                    for a in range(val_lo, val_hi, targs.eval_batch_size):
                        chunk = np.arange(a, min(val_hi, a + targs.eval_batch_size))
                        x, y = (torch.from_numpy(v) for v in data.val.get(chunk, epoch))
                        total[0] += float(loss_fn(module(x), y)) * len(x)
                        total[1] += len(x)
                    dist.all_reduce(total)
                if log is not None:
                    log.epoch({"step": step, "epoch": epoch, "elapsed_s": time.perf_counter() - started,
                               "val_loss": float(total[0] / total[1])})
    finally:
        if log is not None:
            log.close()
        dist.destroy_process_group()
    return 0


# ---- the command ----------------------------------------------------------------------------


def _rates(text: str) -> list[str]:
    rates = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rates if not RATE.match(r)]
    if not rates or bad:
        raise argparse.ArgumentTypeError(f"rates as tc spells them, comma-separated, e.g. 100mbit,1gbit; got {text!r}")
    return rates


def _choices(allowed):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"comma-separated, of {', '.join(allowed)}; got {text!r}")
        return list(dict.fromkeys(items))
    return parse


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/compress_e2e.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=_rates, default=["100mbit", "1gbit"],
                   help="link rates, comma-separated as tc spells them (default 100mbit,1gbit)")
    p.add_argument("--strategies", type=_choices(STRATEGIES), default=list(STRATEGIES), help="default ddp,fsdp")
    p.add_argument("--codecs", type=_choices(CODECS), default=list(CODECS),
                   help="default none,int8+ef,topk+ef,powersgd (none is the target: always needed)")
    p.add_argument("--variants", type=_choices(all_labels()), default=None,
                   help="only these variants, by label, comma-separated, e.g. 'ddp none,ddp int8+ef,torch-ddp' "
                        "(each strategy's none, and ddp none for torch's rows: their targets)")
    p.add_argument("--bucket-cap-mb", type=_positive(float), default=0.5,
                   help="ddp's bucket size for ours and torch DDP (not torch's PowerSGD: one bucket); default 0.5: "
                        "a bucket per layer of the default GPT, sent while backward goes on")
    p.add_argument("--topk-ratio", type=_positive(float), default=None,
                   help="top-k's kept fraction (default: the codec's, 0.01)")
    p.add_argument("--compression-flat", action="store_true",
                   help="ddp's codecs between every pair of ranks (default: reduced inside each host first, "
                        "the codec across hosts only)")
    p.add_argument("--estimate", action="store_true", help="print how long the runs should take, run nothing")
    p.add_argument("--torch", choices=("auto", "on", "off"), default="auto",
                   help="torch DDP rows: auto (when torch is importable), on (an error without it), off")
    p.add_argument("--epochs", type=_positive(float), default=2.0, help="training budget in epochs (default 2)")
    p.add_argument("--windows", type=_positive(int), default=None,
                   help="training windows per epoch (default: the trainer's, training bytes / block size)")
    p.add_argument("--evals-per-epoch", type=_positive(int), default=4, help="validation losses per epoch (default 4)")
    p.add_argument("--codec-warmup-epochs", type=float, default=0.5,
                   help="top-k's and PowerSGD's uncompressed start (ours and torch's hook), epochs (default 0.5)")
    p.add_argument("--powersgd-rank", type=_positive(int), default=32,
                   help="PowerSGD's rank, ours and torch's hook (default 32: rank 4, torch's default, ends 6%% "
                        "above uncompressed in this budget, 32 within 0.2%%: bench/results/compression.md)")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="the target is L x (1 + this), L the uncompressed final loss (default 0.01)")
    p.add_argument("--max-time-s", type=_positive(int), default=900, help="one job's limit (default 900)")
    p.add_argument("--quiet-start", type=_positive(float), default=None, metavar="LOAD",
                   help="before each job, wait (at most 300 s) until the 1-minute load average is under LOAD, "
                        "e.g. 1.0: the previous job's four ranks decay out of it (each job's load_before says "
                        "where it started)")
    p.add_argument("--out", required=True,
                   help="the markdown file: its section of this name is replaced (or added); compress_e2e.png "
                        "and compress_e2e.json go beside it")
    p.add_argument("--from-json", default=None, metavar="JSON[,JSON...]",
                   help="no runs: the table and plot of this data (several: their results together, e.g. one "
                        "run per rate; the first one's header)")
    p.add_argument("--deviation", default=None,
                   help="why the budget differs from 2 epochs of the trainer's epoch, for the header (which "
                        "names the difference itself)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.out.endswith(".md"):
        p.error(f"--out must be a markdown file (.md), got {args.out!r}")
    if "none" not in args.codecs:
        p.error("--codecs must include none: the uncompressed run sets the target")
    if args.variants:
        picked = [v for v in args.variants if v.split()[0].removeprefix("torch-") in args.strategies
                  and (v.startswith("torch") or v.split()[1] in args.codecs)]
        if picked != args.variants:
            p.error(f"--variants {', '.join(v for v in args.variants if v not in picked)}: not in --strategies "
                    f"and --codecs")
        need = {f"{v.split()[0].removeprefix('torch-')} none" for v in args.variants}
        if need - set(args.variants):
            p.error(f"--variants must include {', '.join(sorted(need - set(args.variants)))}: the target of the "
                    f"others")
    if not 0 <= args.tolerance < 1:
        p.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    if not 0 <= args.codec_warmup_epochs <= args.epochs:
        p.error(f"--codec-warmup-epochs must be in [0, --epochs], got {args.codec_warmup_epochs}")
    if args.windows is not None and args.windows < BATCH:
        p.error(f"--windows must be at least one batch ({BATCH}), got {args.windows}")
    if args.from_json is None and not args.estimate:
        from bench.netem import why_not
        why = why_not()
        if why:
            p.error(f"runs need bench/netem.py, which {why}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--torch-worker"]:
        return torch_worker(argv[1:])
    args = parse_args(argv)
    command = "python bench/compress_e2e.py " + shlex.join(argv)
    if args.from_json:
        saved = []
        for path in args.from_json.split(","):
            with open(path) as f:
                saved.append(json.load(f))
        meta = dict(saved[0]["meta"], tolerance=args.tolerance)
        if len(saved) > 1:
            meta["command"] = "`; `".join(s["meta"]["command"] for s in saved)
            meta["load_after"] = saved[-1]["meta"]["load_after"]
        results = [r for s in saved for r in s["results"]]
        for line in write_outputs(args.out, meta, results):
            print(line)
        if len(saved) > 1:  # the data of the section, together, beside it
            with open(beside(args.out, ".json"), "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
            print(f"wrote {beside(args.out, '.json')}")
        return 0
    default_windows = default_epoch_windows()
    budget = Budget(args.epochs, args.windows or default_windows, args.evals_per_epoch, args.codec_warmup_epochs)
    import importlib.util
    todo, _ = variants(args.strategies, args.codecs, args.torch != "off" and bool(importlib.util.find_spec("torch")))
    labels = [v.label for v in todo if not args.variants or v.label in args.variants]
    estimate = estimate_s(args.rate, labels, budget.steps)
    print(f"compress_e2e: {len(labels)} variants x {len(args.rate)} rates ({', '.join(args.rate)}), "
          f"{budget.steps} steps each: about {estimate / 60:.0f} minutes on 2 quiet cores (an estimate, from the "
          f"recorded run's seconds per step, bench/results/compress_e2e.json)", file=sys.stderr, flush=True)
    if args.estimate:
        return 0
    deviation = "; ".join(budget.deviations(default_windows) + ([args.deviation] if args.deviation else []))
    print(f"compress_e2e: {budget.describe()}", file=sys.stderr, flush=True)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, _on_signal)
    knobs = f"; ddp buckets of at most {args.bucket_cap_mb:g} MiB (ours and torch DDP's; torch's PowerSGD: one bucket)"
    if args.topk_ratio is not None:
        knobs += f"; top-k kept fraction {args.topk_ratio:g}"
    knobs += f"; PowerSGD rank {args.powersgd_rank} (ours and torch's hook)"
    knobs += ("; ddp's codecs between every pair of ranks (--compression-flat)" if args.compression_flat else
              "; ddp's codecs across hosts only (float32 inside each host first)")
    meta = dict(command=command, budget=budget.describe() + knobs, deviation=deviation or None,
                tolerance=args.tolerance, title=TITLE)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = run_grid(args, budget, meta)
    for line in write_outputs(args.out, meta, results) + [f"wrote {beside(args.out, '.json')}"]:
        print(line)
    analysed = analyse(results, args.tolerance)
    for rate, rows in analysed.items():
        for line in goals(rate, rows):
            print(line)
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
