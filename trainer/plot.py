"""`python -m trainer.plot RUN`: a run's loss, throughput and learning rate, drawn into a PNG.

    python -m trainer --metrics runs/mlp.csv            # the run writes its metrics
    python -m trainer.plot runs/mlp.csv                 # -> runs/mlp.png
    python -m trainer.plot runs/gpt.jsonl -o gpt.png

RUN is a metrics file of `--metrics` (trainer/metrics.py: CSV or JSON lines). Three panels over
the optimizer step: the loss (every step's, the epochs' mean training loss and validation loss),
the throughput (tokens/s where samples are token windows, else samples/s) and the learning rate.
It needs matplotlib, the `plot` extra; without it, one line says how to install it (exit 1).

What it is not: no live view (TensorBoard reads the event files a run writes beside RUN), no
comparison of runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.extras import MissingExtra, need
from trainer.metrics import read_metrics

__all__ = ["build_parser", "figure_of", "plot_run", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.plot",
                                description="Draw a run's loss, throughput and learning rate into a PNG.")
    p.add_argument("run", metavar="RUN", help="the run's --metrics file (.csv, .jsonl or .ndjson)")
    p.add_argument("-o", "--out", default=None, metavar="PNG", help="the image (default RUN with .png)")
    return p


def _series(rows: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the rows of ``kind`` that have it."""
    pairs = [(r["step"], r[key]) for r in rows if r.get("kind") == kind and r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def figure_of(metrics_path):
    """The matplotlib Figure of the metrics file ``metrics_path``: loss, throughput and learning rate.

    Raises:
        MissingExtra: matplotlib is not installed.
        ValueError: the file holds no step rows.
    """
    need("matplotlib", package="matplotlib", extra="plot", what="trainer.plot")
    from matplotlib.figure import Figure  # no pyplot: no global state, no display, the Agg canvas

    rows = read_metrics(metrics_path)
    steps, losses = _series(rows, "step", "loss")
    if not steps:
        raise ValueError(f"{metrics_path} holds no step rows (write it with python -m trainer --metrics PATH)")
    rate_key = "tokens_per_s" if any(r.get("tokens_per_s") is not None for r in rows) else "samples_per_s"
    fig = Figure(figsize=(8, 9), layout="constrained")
    loss_ax, rate_ax, lr_ax = fig.subplots(3, 1, sharex=True)
    loss_ax.plot(steps, losses, lw=0.8, alpha=0.6, label="step loss")
    for key, label, marker in (("train_loss", "epoch train loss", "s"), ("val_loss", "validation loss", "o")):
        x, y = _series(rows, "epoch", key)
        if x:
            loss_ax.plot(x, y, marker=marker, label=label)
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    rate_ax.plot(*_series(rows, "step", rate_key), lw=0.8)
    rate_ax.set_ylabel(rate_key.replace("_per_s", "/s"))
    lr_ax.plot(*_series(rows, "step", "lr"))
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    fig.suptitle(str(metrics_path))
    return fig


def plot_run(metrics_path, out_path) -> Path:
    """Draws the metrics file ``metrics_path`` into the PNG ``out_path`` (100 dpi); returns its path.
    Raises what `figure_of` raises."""
    out = Path(out_path)
    figure_of(metrics_path).savefig(out, dpi=100)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or str(Path(args.run).with_suffix(".png"))
    try:
        written = plot_run(args.run, out)
    except (MissingExtra, ValueError, OSError) as exc:
        print(f"trainer.plot: {exc}", file=sys.stderr)
        return 1
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
