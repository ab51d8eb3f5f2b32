"""A run's metrics, step by step: the record, and the file rank 0 writes it to (`--metrics PATH`).

What it is: `StepMetrics`, what `trainer.loop.fit` knows after each optimizer step, and
`MetricsLog`, which appends a row per step and one per epoch to PATH: CSV for ``.csv``, JSON
lines for ``.jsonl`` / ``.ndjson`` (`metrics_format`). Every row has ``kind`` ("step" or "epoch"),
``step`` (optimizer steps done, the run's count) and ``epoch`` (0-based); a step row has the
columns of STEP_FIELDS, an epoch row those of EPOCH_FIELDS (CSV leaves the others empty, JSON
lines leaves them out; a value that is not finite, a skipped step's grad norm, is empty / null)::

    kind,step,epoch,elapsed_s,loss,lr,grad_norm,loss_scale,skipped,samples_per_s,tokens_per_s,...
    step,1,0,0.031,2.3514,0.0002,1.93,,0,2064.5,,,,,,
    epoch,23,0,0.912,,,,,,1402.1,,0.3905,0.2316,0.9361,0.9373,

A new run writes a new file; a resumed one keeps the rows up to its checkpoint's step and
appends. `read_metrics` reads either format back (trainer/plot.py draws it). Where a TensorBoard
writer is importable (torch.utils.tensorboard with the tensorboard package, else tensorboardX),
the same scalars also go to event files in PATH's stem + "-tensorboard/" (train/loss, train/lr,
..., val/loss, val/acc); otherwise the log says so once and writes PATH only.

What it is not: no collectives (rank 0 alone writes), no system metrics, no hard dependency.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["StepMetrics", "STEP_FIELDS", "EPOCH_FIELDS", "FIELDS", "MetricsLog", "metrics_format", "read_metrics",
           "summary_writer_class"]

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
STEP_FIELDS = ("elapsed_s", "loss", "lr", "grad_norm", "loss_scale", "skipped", "samples_per_s", "tokens_per_s")
EPOCH_FIELDS = ("train_loss", "val_loss", "val_acc", "train_acc", "val_bits_per_byte")
FIELDS = ("kind", "step", "epoch") + STEP_FIELDS + EPOCH_FIELDS  # a CSV file's columns, in this order
# TensorBoard's tags of the scalars
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "loss_scale": "train/loss_scale",
        "samples_per_s": "train/samples_per_s", "tokens_per_s": "train/tokens_per_s",
        "train_loss": "train/epoch_loss", "val_loss": "val/loss", "val_acc": "val/acc", "train_acc": "train/acc",
        "val_bits_per_byte": "val/bits_per_byte"}


@dataclass
class StepMetrics:
    """One optimizer step, as rank 0 shows and records it (the same numbers on every rank)."""
    step: int  # optimizer steps done in the run, this one included, e.g. 47
    epoch: int  # 0-based
    step_in_epoch: int  # steps done in this epoch, e.g. 1 after its first
    loss: float  # the step's mean loss over its global batch
    lr: float | None  # the learning rate of this step (None: the strategy has no schedule to ask)
    grad_norm: float | None  # global gradient norm before clipping (None: not reported; inf: skipped)
    loss_scale: float | None  # the loss scale of its backward (None: no dynamic loss scaling)
    skipped: bool  # the optimizer skipped it (inf/NaN gradients under loss scaling)
    samples_per_s: float  # this step's rows per second
    tokens_per_s: float | None  # samples_per_s times tokens per sample (None: samples are not token windows)
    elapsed_s: float  # seconds since fit began (this process)


def metrics_format(path) -> str:
    """"csv" or "jsonl", by the file's extension; ValueError for any other."""
    kind = FORMATS.get(Path(str(path)).suffix.lower())
    if kind is None:
        raise ValueError(f"metrics file {str(path)!r} must end in .csv, .jsonl or .ndjson (its format)")
    return kind


def _finite(value):
    """A cell: numbers as Python numbers, bools as 0/1, None and non-finite floats as None."""
    if isinstance(value, bool):
        return int(value)
    if hasattr(value, "item"):  # a NumPy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def summary_writer_class():
    """TensorBoard's SummaryWriter: torch.utils.tensorboard's when the tensorboard package is there
    (torch is imported only then), else tensorboardX's; None when neither can be imported."""
    if importlib.util.find_spec("tensorboard") is not None and importlib.util.find_spec("torch") is not None:
        try:
            return importlib.import_module("torch.utils.tensorboard").SummaryWriter
        except ImportError:
            pass
    try:
        return importlib.import_module("tensorboardX").SummaryWriter
    except ImportError:
        return None


def read_metrics(path) -> list[dict]:
    """The rows of a metrics file, in order; CSV cells become numbers (empty: absent)."""
    kind = metrics_format(path)
    with open(path, newline="") as f:
        if kind == "jsonl":
            return [json.loads(line) for line in f if line.strip()]
        rows = []
        for raw in csv.DictReader(f):
            row = {}
            for key, cell in raw.items():
                if key is None or cell in (None, ""):
                    continue
                row[key] = cell if key == "kind" else (int(cell) if key in ("step", "epoch", "skipped") else
                                                       float(cell))
            rows.append(row)
        return rows


class MetricsLog:
    """Rank 0's metrics file (the module docstring). ``resume_step``: the step a resumed run goes on
    from (rows after it, from the attempt that died, are dropped), None for a new run.
    ``say``: where the one line about a missing TensorBoard writer goes. ``writer_class``: a
    SummaryWriter-like class (default `summary_writer_class()`), or False for none."""

    def __init__(self, path, *, resume_step: int | None = None, say=print, writer_class=None) -> None:
        self.path = Path(path)
        self.kind = metrics_format(self.path)
        kept = []
        if resume_step is not None and self.path.is_file():
            kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= resume_step]
        os.makedirs(self.path.parent, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._file = open(tmp, "w", newline="")  # the kept rows, then renamed over PATH: never half a file
        self._csv = csv.DictWriter(self._file, FIELDS, extrasaction="ignore") if self.kind == "csv" else None
        if self._csv is not None:
            self._csv.writeheader()
        for row in kept:
            self._write(row)
        self._file.flush()
        os.replace(tmp, self.path)
        cls = summary_writer_class() if writer_class is None else writer_class
        self.tensorboard_dir = self.path.with_name(self.path.stem + "-tensorboard")
        self._tb = None
        if cls:
            self._tb = cls(log_dir=str(self.tensorboard_dir), purge_step=resume_step)
        else:
            say(f"metrics: no TensorBoard writer here (pip install tensorboard, or tensorboardX); writing {self.path} "
                f"only")

    def _write(self, row: dict) -> None:
        row = {k: _finite(v) for k, v in row.items() if k in FIELDS}
        if self._csv is not None:
            self._csv.writerow({k: ("" if v is None else v) for k, v in row.items()})
        else:
            self._file.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")

    def _scalars(self, row: dict, step: int) -> None:
        if self._tb is None:
            return
        for key, tag in TAGS.items():
            value = _finite(row.get(key))
            if value is not None:
                self._tb.add_scalar(tag, value, step)

    def step(self, m: StepMetrics) -> None:
        row = {"kind": "step", **{k: v for k, v in asdict(m).items() if k != "step_in_epoch"}}
        self._write(row)
        self._scalars(row, m.step)
        self._file.flush()

    def epoch(self, values: dict) -> None:
        """An epoch's row: ``values`` holds step, epoch, EPOCH_FIELDS and the epoch's elapsed_s,
        samples_per_s, tokens_per_s (others, and None, are left out)."""
        row = {"kind": "epoch", **values}
        self._write(row)
        self._scalars({k: v for k, v in row.items() if k in EPOCH_FIELDS}, int(values["step"]))
        self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()
