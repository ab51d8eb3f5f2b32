"""`python -m trainer`: the project's main job, and the GPT on text.

    python -m runtime.launch -n 4 -m trainer                      # 4 ranks, ddp, MLP on digits
    python -m runtime.launch -n 4 -m trainer --strategy fsdp --param-dtype bfloat16
    python -m trainer --epochs 3                                  # one process, world size 1
    python -m runtime.launch -n 4 -m trainer --model gpt --strategy fsdp    # the GPT on pydoc text
    python -m runtime.launch -n 4 -m trainer --model gpt --tp 2 --pp 2 --micro-batches 8 --schedule 1f1b
    python -m runtime.launch -n 2 -m trainer --tp 2                # the MLP's Linears cut over 2 ranks
    python -m runtime.launch -n 8 -m trainer --strategy fsdp --replicas 2   # HSDP: 2 replicas x 4 shards
    python -m trainer --model gpt --offload optimizer --offload-dir /scratch   # Adam's state on disk

Every rank: `await runtime.init()`, load the data (the same on every rank), build the model (a
strategy pads it), lay out the mesh when a mesh flag asks for one (trainer/parallel/mesh.py), build
and set up the strategy, `fit`, print the summary (rank 0), `await runtime.shutdown()`.

Defaults: MODEL_DEFAULTS below and each flag's help; what they reach under every strategy:
bench/results/trainer.md#the-main-job (MLP), bench/results/gpt.md (GPT). BLAS runs on
`--blas-threads` threads per rank, default 1 (bench/results/trainer.md#blas-threads).

Preemption: with --checkpoint-dir, SIGTERM and SIGUSR1 (RINGWEAVE_PREEMPT_SIGNALS) make every
rank save a checkpoint after the same step and exit 128 + the signal (trainer/preempt.py); --resume
continues from it; under --elastic a signalled rank leaves the job (exit 0, trainer/leave.py) while
MIN stay, and a lost tp/pp rank restarts the job from its checkpoint (trainer/checkpoint_fallback.py).
Runs (trainer/runid.py): a new run refuses another run's directory unless
--move-aside; --resume continues the directory's run. Refusals, a mesh that does not fit the world
among them, are one line on rank 0 and exit code 2 on every rank, no traceback.

What it is not: no config files (flags only), no model zoo (the MLP and the GPT).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

import runtime
from runtime import env
from runtime import args as types
from trainer.allocator import retain_freed_memory
from trainer.data import Split, load_digits_split, make_synthetic
from trainer.extras import MissingExtra
from trainer.callbacks import EPOCH_METRICS
from trainer.loop import EarlyStopping, StopAtAccuracy, fit, steps_per_epoch
from trainer.metrics import metrics_format
from trainer.nn import GPT, GPTConfig, mlp
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.parallel.offload import make_offload_strategy
from trainer import checkpoint_fallback as fallback
from trainer import compression_flags
from trainer.preempt import Left, Preempted, Preemption
from trainer.runid import RunError
from trainer.sharding import make_strategy
from trainer.sharding.base import TrainConfig
from trainer.text import load_text_split

__all__ = ["build_parser", "parse_args", "make_config", "load_data", "build_model", "run_fields", "describe", "main",
           "run"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
DTYPE_CHOICES = ("float32", "float16", "bfloat16", "float64")
MODELS = ("mlp", "gpt")
# defaults that depend on the model: (mlp, gpt)
MODEL_DEFAULTS = {
    "epochs": (5, 8),
    "batch_size": (64, 64),  # rows (mlp), windows of block_size tokens (gpt)
    "lr": (2e-3, 2e-3),
    "eval_train": (True, False),  # a GPT's training set is 420 KB of windows: the step losses say enough
    "eval_batch_size": (4096, 64),
}


SPLIT_MODELS = ("mlp", "gpt")  # the models trainer.parallel splits over --tp and --pp (split_refusal)

# every number's type comes from runtime/args.py: finite, in range, argparse's one-line error
_positive_int = types.positive_int
_non_negative_int = types.count
_positive_float = types.positive


def _resume_mode(text: str) -> str:
    if text not in ("auto", "always"):
        raise argparse.ArgumentTypeError(f"takes no value (resume, and refuse if there is no checkpoint) or auto "
                                         f"(resume if there is one), got {text!r}")
    return text


def _replicas(text: str) -> int | str:
    try:
        return text if text == "hosts" else _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a replica count >= 1, or hosts (one replica per host)") \
            from None


def _stage_layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated block counts, e.g. 3,1; got {text!r}") from None
    if any(n < 1 for n in layers):
        raise argparse.ArgumentTypeError(f"every stage needs at least one block, got {text!r}")
    return layers


def _betas(text: str) -> tuple[float, float]:
    try:
        betas = tuple(float(part) for part in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise argparse.ArgumentTypeError(f"must be two numbers B1,B2, each in [0, 1), e.g. 0.9,0.95; got {text!r}")
    return betas


def _metrics_path(text: str) -> str:
    try:
        metrics_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train an MLP (--model mlp, on --data) or a GPT (--model gpt, on --corpus text) with a ringweave "
                    "sharding strategy (launch several ranks with: python -m runtime.launch -n 4 -m trainer ...).")
    g = p.add_argument_group("strategy")
    g.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="sharding strategy (default ddp)")
    g.add_argument("--replicas", type=_replicas, nargs="?", const="hosts", default=1, metavar="R",
                   help="HSDP (zero1/2/3, fsdp): shard over dp / R ranks, replicate over R such groups, dp = R x "
                        "shard; without R, one replica per host (shard within a host, replicate across hosts: "
                        "torch's HYBRID_SHARD); default 1, no replicas")
    g.add_argument("--param-dtype", choices=DTYPE_CHOICES, default="float32",
                   help="compute copy of the parameters and its all-gather (default float32)")
    g.add_argument("--reduce-dtype", choices=DTYPE_CHOICES, default="float32",
                   help="gradient communication dtype (default float32)")
    g.add_argument("--master-dtype", choices=("float32", "float64"), default="float32")
    g.add_argument("--grad-accum", type=_positive_int, default=1, metavar="A",
                   help="micro-batches per optimizer step (default 1)")
    g.add_argument("--clip-norm", type=_positive_float, default=None, metavar="C",
                   help="global-norm gradient clipping (default off)")
    compression_flags.add_arguments(g)
    g.add_argument("--freeze-variance", action="store_true", help="adamw's variance frozen from then on (1-bit Adam)")
    g.add_argument("--bucket-cap-mb", type=_positive_float, default=25.0, help="ddp bucket size (default 25)")
    g.add_argument("--compression-flat", dest="compression_host_first", action="store_false",
                   help="ddp: compress between every pair of ranks, also inside a host (default: on several "
                        "hosts of several ranks each, reduce inside the host uncompressed, compress across hosts)")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="zero3/fsdp: keep gathered parameters from forward to backward")
    g.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="zero3/fsdp: do not gather the next unit ahead")
    g.add_argument("--loss-scale", choices=("auto", "on", "off"), default="auto",
                   help="dynamic loss scaling (auto: on for float16)")
    g.add_argument("--check-every", type=_non_negative_int, default=0, metavar="N",
                   help="check replicated state is equal across ranks every N steps (default never)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each transformer block's input in the forward and recompute the block in "
                        "the backward (same gradients, less memory; the run summary shows the activation peak)")

    g = p.add_argument_group("model parallelism and offload")
    g.add_argument("--tp", type=_positive_int, default=1, metavar="T",
                   help="tensor-parallel ranks: each layer's matrices split over T ranks of one host (the GPT's "
                        "attention heads and MLPs, the MLP's Linears in column/row pairs; default 1)")
    g.add_argument("--pp", type=_positive_int, default=1, metavar="P",
                   help="pipeline stages: the blocks (the GPT's --n-layer, the MLP's --depth hidden blocks and its "
                        "head) split into P stages, at most one per block (default 1)")
    g.add_argument("--dp", type=_positive_int, default=None, metavar="D",
                   help="data-parallel ranks, --strategy on this dimension (default: what is left, world / (T P))")
    g.add_argument("--micro-batches", type=_positive_int, default=None, metavar="M",
                   help="pipeline micro-batches per step (a multiple of --grad-accum; default --grad-accum)")
    g.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="pipeline schedule: 1f1b (at most P micro-batches in flight) or gpipe (all M); default 1f1b")
    g.add_argument("--stage-layers", type=_stage_layers, default=None, metavar="N,N,...",
                   help="blocks per stage, e.g. 3,1, adding up to the model's blocks (default: balanced by "
                        "parameter count)")
    g.add_argument("--offload", choices=("optimizer", "params"), default=None,
                   help="keep the optimizer state (and with params also the float32 master weights, which needs "
                        "a lower --param-dtype) in memory-mapped files, read ahead and written back unit by unit")
    g.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="directory for the offload files (a private subdirectory is made; default the temporary "
                        "directory)")

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=_non_negative_int, default=None, help="default 5 (mlp), 8 (gpt)")
    g.add_argument("--batch-size", type=_positive_int, default=None, metavar="G",
                   help="global micro-batch size, all ranks together: rows (mlp) or windows (gpt); default 64")
    g.add_argument("--lr", type=_positive_float, default=None, help="peak learning rate (default 2e-3)")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--weight-decay", type=types.non_negative, default=0.01)
    g.add_argument("--decay", choices=("matrices", "all"), default="matrices",
                   help="which parameters weight decay applies to: the layers' matrices, not biases, LayerNorm or "
                        "embeddings (default, as nanoGPT and DeepSpeed), or all")
    g.add_argument("--momentum", type=types.fraction, default=0.9, help="sgd only")
    g.add_argument("--betas", type=_betas, default=(0.9, 0.999), metavar="B1,B2",
                   help="adamw's beta1,beta2, each in [0, 1) (default 0.9,0.999; nanoGPT trains with 0.9,0.95)")
    g.add_argument("--nesterov", action="store_true", help="sgd only")
    g.add_argument("--min-lr", type=types.non_negative, default=None, help="cosine floor (default lr / 100)")
    g.add_argument("--adam-kernel", choices=("numba", "numpy"), default="numba")
    g.add_argument("--warmup-steps", type=_non_negative_int, default=None,
                   help="linear warm-up steps (default half an epoch)")
    g.add_argument("--seed", type=_non_negative_int, default=0,
                   help="seeds parameters, data order, dropout and the split")

    g = p.add_argument_group("data and model")
    g.add_argument("--model", choices=MODELS, default="mlp",
                   help="mlp (on --data, default) or gpt (a decoder-only transformer on byte tokens of --corpus)")
    g.add_argument("--data", choices=("digits", "synthetic"), default="digits", help="mlp: the data set")
    g.add_argument("--size", type=_positive_int, default=10000, help="synthetic: rows (default 10000)")
    g.add_argument("--in-dim", type=_positive_int, default=64, help="synthetic: features (default 64)")
    g.add_argument("--classes", type=_positive_int, default=10, help="synthetic: classes (default 10)")
    g.add_argument("--val-fraction", type=types.open_fraction, default=0.2)
    g.add_argument("--width", type=_positive_int, default=256, help="hidden width (default 256)")
    g.add_argument("--depth", type=_positive_int, default=2, help="hidden blocks (default 2)")
    g.add_argument("--dropout", type=types.fraction, default=0.0)
    g.add_argument("--activation", choices=("gelu", "relu"), default="gelu", help="mlp: the activation")
    g.add_argument("--gelu", choices=("tanh", "erf"), default="tanh",
                   help="GELU form: tanh, the approximation GPT-2 uses (default here), or erf, the exact form "
                        "(torch.nn.GELU's default)")
    g.add_argument("--kernel", choices=("fast", "reference"), default="fast",
                   help="layers' kernels: fast (Numba passes around NumPy's SIMD exp/tanh, default) or reference "
                        "(the readable NumPy)")

    g = p.add_argument_group("gpt (--model gpt)")
    g.add_argument("--n-layer", type=_positive_int, default=4, help="transformer blocks (default 4)")
    g.add_argument("--n-head", type=_positive_int, default=4, help="attention heads (default 4)")
    g.add_argument("--n-embd", type=_positive_int, default=128, help="width, a multiple of --n-head (default 128)")
    g.add_argument("--block-size", type=_positive_int, default=64, help="context length in bytes (default 64)")
    g.add_argument("--corpus", choices=("pydoc",), default="pydoc",
                   help="text: pydoc, the Python documentation's topics (466 KB, ships with Python)")
    g.add_argument("--windows-per-epoch", type=_positive_int, default=None, metavar="N",
                   help="random training windows per epoch (default: training bytes / block size)")

    g = p.add_argument_group("run")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="save checkpoints here")
    g.add_argument("--checkpoint-every", type=_non_negative_int, default=0, metavar="N",
                   help="also save every N optimizer steps (default: end of each epoch only)")
    g.add_argument("--keep-last", type=_positive_int, default=2, help="checkpoints kept (default 2)")
    g.add_argument("--resume", nargs="?", const="always", default=None, type=_resume_mode, metavar="auto",
                   help="continue the run in --checkpoint-dir from its newest valid checkpoint (an error if there is "
                        "none); --resume auto: continue if there is one, else start. A restarted attempt of the same "
                        "job (--max-restarts, a SLURM requeue, torchrun) continues without it")
    g.add_argument("--move-aside", action="store_true",
                   help="start a new run in a --checkpoint-dir that holds another run's checkpoints: move them into "
                        "DIR/aside-<run>-<time>/ first (nothing is deleted)")
    g.add_argument("--target-accuracy", type=types.probability, default=None, metavar="ACC",
                   help="stop once validation accuracy reaches ACC")
    g.add_argument("--patience", type=_positive_int, default=None,
                   help="stop when validation loss has not improved for N epochs")
    g.add_argument("--no-eval-train", dest="eval_train", action="store_false", default=None,
                   help="skip evaluating the whole training set after each epoch (the default for gpt)")
    g.add_argument("--eval-batch-size", type=_positive_int, default=None, metavar="B",
                   help="samples per evaluation call (default 4096 rows for mlp, 64 windows for gpt)")
    g.add_argument("--log-every", type=_non_negative_int, default=10, metavar="N")
    g.add_argument("--blas-threads", type=_positive_int, default=None, metavar="T",
                   help="BLAS threads per rank (default 1)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the history as JSON (rank 0)")
    g.add_argument("--metrics", type=_metrics_path, default=None, metavar="PATH",
                   help="write every step's metrics (loss, lr, grad norm, throughput) and every epoch's to PATH, "
                        "CSV (.csv) or JSON lines (.jsonl), and TensorBoard event files to PATH's stem + "
                        "-tensorboard/ where a writer is installed (rank 0); plot with python -m trainer.plot PATH")
    g.add_argument("--save-best", choices=EPOCH_METRICS, default=None, metavar="METRIC",
                   help="also keep the checkpoint of the epoch where METRIC was best (an accuracy highest, any other "
                        "lowest): val_loss, val_acc, train_loss, ...; never pruned by --keep-last (needs "
                        "--checkpoint-dir)")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    which = MODELS.index(args.model)
    for name, values in MODEL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[which])
    if args.model == "gpt" and args.n_embd % args.n_head:
        build_parser().error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.resume and not args.checkpoint_dir:
        build_parser().error("--resume needs --checkpoint-dir")
    if args.save_best and not args.checkpoint_dir:
        build_parser().error("--save-best needs --checkpoint-dir")
    if args.move_aside and not args.checkpoint_dir:
        build_parser().error("--move-aside needs --checkpoint-dir")
    if args.move_aside and args.resume:
        build_parser().error("--move-aside starts a new run and --resume continues one: give one of them")
    if not 0.0 < args.val_fraction < 1.0:
        build_parser().error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if not 0.0 <= args.dropout < 1.0:
        build_parser().error(f"--dropout must be in [0, 1), got {args.dropout}")
    if refusal := compression_flags.refusal(args):
        build_parser().error(refusal)
    if refusal := split_refusal(args):
        build_parser().error(refusal)
    if args.replicas != 1 and args.strategy == "ddp":
        build_parser().error("--replicas shards the model within each replica: HSDP needs --strategy zero1, zero2, "
                             "zero3 or fsdp (ddp replicates it whole)")
    if args.replicas not in (1, "hosts") and args.dp is not None and args.dp % args.replicas:
        build_parser().error(f"--replicas {args.replicas} must divide --dp {args.dp} (dp = replicas x shard ranks)")
    if args.stage_layers is not None and len(args.stage_layers) != args.pp:
        build_parser().error(f"--stage-layers {','.join(map(str, args.stage_layers))} names {len(args.stage_layers)} "
                             f"stages; --pp is {args.pp}")
    if refusal := stage_refusal(args):
        build_parser().error(refusal)
    if args.micro_batches is not None and args.micro_batches % args.grad_accum:
        build_parser().error(f"--micro-batches {args.micro_batches} must be a multiple of --grad-accum "
                             f"{args.grad_accum}")
    if args.offload == "params" and args.param_dtype == args.master_dtype:
        build_parser().error(f"--offload params keeps the {args.master_dtype} master weights on disk beside a "
                             f"compute copy: set --param-dtype bfloat16 (or float16), or --offload optimizer")
    return args


def uses_mesh(args: argparse.Namespace) -> bool:
    """Whether a model-parallel flag is given (--tp, --pp, --dp, --micro-batches, --stage-layers)."""
    return (args.tp > 1 or args.pp > 1 or args.dp is not None or args.micro_batches is not None
            or args.stage_layers is not None)


def mesh_strategy(args: argparse.Namespace) -> bool:
    """Whether the run trains through trainer.parallel's strategy: a model-parallel flag, or the
    GPT's offload. (HSDP alone does not: --replicas lays out a mesh for a plain strategy.)"""
    return uses_mesh(args) or bool(args.offload and args.model == "gpt")


def split_refusal(args: argparse.Namespace) -> str | None:
    """Why the model-parallel flags cannot split this model (None: they can, or none is given)."""
    if uses_mesh(args) and args.model not in SPLIT_MODELS:
        return (f"--tp, --pp, --dp, --micro-batches and --stage-layers split --model "
                f"{' or '.join(SPLIT_MODELS)}, not {args.model}")
    return None


def pipeline_blocks(args: argparse.Namespace) -> int:
    """The calls trainer/parallel/pipeline.py cuts into stages: the GPT's blocks (its embedding and
    head are pinned to the first and last stage), the MLP's hidden blocks and its head."""
    return args.n_layer if args.model == "gpt" else args.depth + 1


def stage_refusal(args: argparse.Namespace) -> str | None:
    """Why --pp / --stage-layers cannot cut this model's blocks (None: they can)."""
    blocks, what = pipeline_blocks(args), ("--n-layer" if args.model == "gpt" else "--depth + 1")
    if args.pp > blocks:
        return f"--pp {args.pp} stages need a block each; the {args.model} has {blocks} ({what}): choose --pp <= {blocks}"
    if args.stage_layers is not None and sum(args.stage_layers) != blocks:
        return (f"--stage-layers {','.join(map(str, args.stage_layers))} adds up to {sum(args.stage_layers)} blocks; "
                f"the {args.model} has {blocks} ({what})")
    return None


def make_config(args: argparse.Namespace, steps_per_epoch: int) -> TrainConfig:
    """The TrainConfig of the flags; the schedule spans `epochs * steps_per_epoch` steps."""
    total = max(1, args.epochs * steps_per_epoch)
    warmup = steps_per_epoch // 2 if args.warmup_steps is None else args.warmup_steps
    fields = dict(
        strategy=args.strategy, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
        momentum=args.momentum, nesterov=args.nesterov, adam_kernel=args.adam_kernel, betas=args.betas,
        min_lr=args.lr / 100 if args.min_lr is None else args.min_lr,
        warmup_steps=min(warmup, total), total_steps=total,
        param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype, master_dtype=args.master_dtype,
        grad_accum=args.grad_accum, clip_norm=args.clip_norm, compression_start=compression_flags.start(args),
        compression=compression_flags.spec(args, steps_per_epoch), freeze_variance=args.freeze_variance,
        bucket_cap_mb=args.bucket_cap_mb, compression_host_first=args.compression_host_first,
        reshard_after_forward=args.reshard_after_forward, prefetch=args.prefetch,
        loss_scale={"auto": None, "on": True, "off": False}[args.loss_scale],
        seed=args.seed, check_every=args.check_every, decay=args.decay,
        activation_checkpointing=args.activation_checkpointing, offload=args.offload, offload_dir=args.offload_dir)
    return TrainConfig(**fields)


def load_data(args: argparse.Namespace):
    """A trainer.data.Split (mlp) or trainer.text.TextSplit (gpt), the same on every rank."""
    if args.model == "gpt":
        return load_text_split(args.block_size, corpus=args.corpus, val_fraction=0.1, seed=args.seed,
                               windows_per_epoch=args.windows_per_epoch)
    dtype = np.float64 if args.master_dtype == "float64" else np.float32
    if args.data == "digits":
        return load_digits_split(seed=args.seed, val_fraction=args.val_fraction, dtype=dtype)
    x, y = make_synthetic(args.size, args.in_dim, args.classes, seed=args.seed, dtype=dtype)
    n_val = int(round(args.size * args.val_fraction))  # rows are in random order already
    return Split(x[n_val:], y[n_val:], x[:n_val], y[:n_val], args.classes)


def _blas_threads(args) -> int:
    """BLAS threads inside each rank: --blas-threads, else 1 (see the module docstring)."""
    return args.blas_threads or 1


def build_model(args: argparse.Namespace, data):
    """The model of the flags (unpadded: the strategy pads it to its world size)."""
    dtype = np.float64 if args.master_dtype == "float64" else np.float32
    gelu = "none" if args.gelu == "erf" else "tanh"
    if args.model == "gpt":
        config = GPTConfig(vocab_size=data.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                           n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout, gelu=gelu,
                           kernel=args.kernel)
        return GPT(config, dtype=dtype)
    return mlp(data.in_dim, (args.width,) * args.depth, data.num_classes, activation=args.activation,
               dropout=args.dropout, dtype=dtype, gelu=gelu, kernel=args.kernel)


def run_fields(args: argparse.Namespace, data) -> dict:
    """What must match, beyond the model's spec and parameters, to continue a run: the data set,
    and an MLP's shape (its activation has no parameter to tell it)."""
    if args.model == "gpt":
        return {"data": args.corpus}
    fields = {"model": "mlp", "data": args.data, "in_dim": int(data.in_dim), "hidden": [args.width] * args.depth,
              "classes": int(data.num_classes), "activation": args.activation}
    return fields | ({"gelu": args.gelu} if args.activation == "gelu" else {})


def describe(args: argparse.Namespace, data, model, world_size: int, steps: int, mesh=None) -> str:
    """The first line rank 0 prints: what trains on what."""
    head = f"{args.strategy} on {world_size} rank(s): "
    replicas = mesh.dim_size("dp_replicate") if mesh is not None else 1
    hsdp = f" (HSDP: {replicas} replicas x {mesh.dim_size('dp_shard')} shard ranks)" if replicas > 1 else ""
    if mesh is not None and mesh_strategy(args):
        m = args.micro_batches or args.grad_accum
        head = (f"{args.strategy} on {world_size} rank(s) as dp {mesh.shape['dp']}{hsdp} x tp {mesh.shape['tp']} "
                f"x pp {mesh.shape['pp']} ({args.schedule}, {m} micro-batches per step): ")
    elif hsdp:
        head = f"{args.strategy} on {world_size} rank(s){hsdp}: "
    if args.offload:
        head += f"{args.offload} offloaded to {args.offload_dir or 'the temporary directory'}; "
    tail = (f" ({model.numel:,} parameters), {args.optimizer} lr {args.lr}, batch {args.batch_size} x "
            f"{args.grad_accum}, {args.epochs} epochs of {steps} steps")
    if args.model == "gpt":
        baseline = data.unigram_loss
        return (head + f"{args.corpus} text ({len(data.train.tokens):,} training bytes, {len(data.val.tokens):,} "
                f"validation; unigram baseline {baseline:.4f} nats = {baseline / math.log(2):.3f} bits per byte), "
                f"GPT {args.n_layer} layers x {args.n_head} heads x {args.n_embd} wide, block {args.block_size}, "
                f"GELU {args.gelu}" + (", activation checkpointing" if args.activation_checkpointing else "") + tail)
    return (head + f"{args.data} ({len(data.x_train)} train, {len(data.x_val)} val), MLP {data.in_dim}-"
            f"{'-'.join([str(args.width)] * args.depth)}-{data.num_classes}" + tail)


def elastic_refusal(args: argparse.Namespace) -> str | None:
    """Why this command cannot run as an elastic job (RINGWEAVE_ELASTIC: runtime.launch --elastic),
    or None: ddp, zero1/2/3 and fsdp on the plain data-parallel layout re-shard in memory; a tensor
    or pipeline layout (no replica) restarts from its checkpoint (trainer/checkpoint_fallback.py),
    so it needs --checkpoint-dir."""
    what = [flag for flag, on in (("--replicas", args.replicas != 1), ("--offload", bool(args.offload)),
                                  ("--compression", args.compression not in (None, "none"))) if on]
    if what:
        return (f"--elastic runs ddp, zero1, zero2, zero3 and fsdp on the plain data-parallel layout, and "
                f"--tp/--pp with --checkpoint-dir; not with {', '.join(what)}")
    if uses_mesh(args) and not args.checkpoint_dir:
        return ("--elastic runs ddp, zero1, zero2, zero3 and fsdp on the plain data-parallel layout, and "
                "--tp/--pp/--dp/--micro-batches/--stage-layers only with --checkpoint-dir: a lost rank's slice "
                "of the model has no copy, so the job restarts from its newest checkpoint")
    return None


async def run(args: argparse.Namespace) -> int:
    retain_freed_memory()  # a step's activations stay in malloc's heap: no page faults (trainer/allocator.py)
    job = rdzv = None
    layout = None  # an elastic job's tp/pp layout, e.g. "tp 2 x pp 1": a loss there restarts from the checkpoint
    if env.ELASTIC.get():  # python -m runtime.launch --elastic MIN:MAX (trainer/elastic.py)
        why = elastic_refusal(args)
        if why:
            if os.environ.get("RANK", "0") == "0":
                print(f"trainer: error: {why}", file=sys.stderr, flush=True)
            return 2
        from runtime import elastic as relastic
        from trainer.elastic import ElasticJob

        rdzv = relastic.from_env()
        rt = await runtime.init(rendezvous=rdzv)
        if mesh_strategy(args):  # no replica to re-shard from (trainer/checkpoint_fallback.py)
            layout = f"tp {args.tp} x pp {args.pp}"
        else:
            job = ElasticJob(rdzv, rt)
    else:
        rt = await runtime.init()
    strategy = None
    try:
        from threadpoolctl import threadpool_limits  # a dependency (pyproject.toml)

        limiter = threadpool_limits(limits=_blas_threads(args), user_api="blas")
    except ImportError:  # pragma: no cover - a dependency
        limiter = None
    try:
        world = rt.world
        data = load_data(args)
        spe = steps_per_epoch(len(data.train), args.batch_size, args.grad_accum)
        config = make_config(args, spe)
        model = build_model(args, data)
        mesh, split = None, mesh_strategy(args)
        if split or args.replicas != 1:
            try:
                mesh = Mesh(world, dp=args.dp, tp=args.tp, pp=args.pp, replicate=args.replicas)
            except ValueError as exc:  # sizes that do not fit this world: the same on every rank
                if world.rank == 0:
                    print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
                return 2
        # HSDP without a split model: the strategy shards over dp_shard and replicates over dp_replicate
        group, hsdp = world, {}
        if mesh is not None and not split and mesh.dim_size("dp_replicate") > 1:
            group, hsdp = mesh["dp_shard"], {"replicate": mesh["dp_replicate"]}
        if split:
            parallel = ParallelConfig(schedule=args.schedule, micro_batches=args.micro_batches,
                                      stage_layers=args.stage_layers)
            strategy = make_parallel_strategy(args.strategy, model, config, mesh, parallel=parallel)
        elif args.offload:
            strategy = make_offload_strategy(args.strategy, model, config, group, **hsdp)
        else:
            strategy = make_strategy(args.strategy, model, config, group, **hsdp,
                                     **({"redundancy": job.redundancy()} if job else {}))
        await strategy.setup()
        if world.rank == 0 and not args.quiet:
            print(describe(args, data, model, world.size, spe, mesh), file=sys.stderr, flush=True)
        callbacks = []
        if args.target_accuracy is not None:
            callbacks.append(StopAtAccuracy(args.target_accuracy))
        if args.patience is not None:
            callbacks.append(EarlyStopping("val_loss", patience=args.patience))
        # with --checkpoint-dir, the scheduler's signals checkpoint and stop every rank (trainer/preempt.py); in an
        # elastic job a rank signalled leaves it while enough stay (trainer/leave.py)
        try:
            with Preemption(enabled=bool(args.checkpoint_dir) or job is not None):
                history = await fit(strategy, data, config, epochs=args.epochs, global_batch_size=args.batch_size,
                                    callbacks=callbacks, checkpoint_dir=args.checkpoint_dir,
                                    keep_last=args.keep_last, resume=args.resume or False,
                                    move_aside=args.move_aside, run_fields=run_fields(args, data),
                                    log_every=0 if args.quiet else args.log_every,
                                    checkpoint_every=args.checkpoint_every, eval_train=args.eval_train,
                                    eval_batch_size=args.eval_batch_size, group=world, metrics=args.metrics,
                                    save_best=args.save_best, elastic=job)
        except Left as exc:  # this rank left the elastic job on a signal; the others go on
            print(f"trainer: rank {job.rt.rank}: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        except Preempted as exc:
            if (job.rt.world if job else world).rank == 0:
                print(f"{exc} (resume with --checkpoint-dir {args.checkpoint_dir} --resume)", file=sys.stderr,
                      flush=True)
            return exc.exit_code
        except RunError as exc:  # raised on every rank alike: one line, no traceback
            if world.rank == 0:
                print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
            return 2
        except Exception as exc:  # a loss whose state has no copy: restart from the checkpoint, saying so
            lost = fallback.lost_without_copy(exc, layout=layout) if rdzv and args.checkpoint_dir else None
            if lost is None:
                raise
            if fallback.speaks((job.rt if job else rt).rank, [] if job else lost):
                print(fallback.line(lost, exc, layout, args.checkpoint_dir, strategy.step), file=sys.stderr,
                      flush=True)
            return fallback.FALLBACK_EXIT
        world = job.rt.world if job else world  # an elastic job's last generation
        if args.json and world.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "history": history.as_dict()}, f, indent=1, default=str)
    finally:
        if strategy is not None and hasattr(strategy, "close"):
            strategy.close()
        if limiter is not None:
            limiter.restore_original_limits()
        await runtime.shutdown(job.rt if job else rt)
        if rdzv is not None:
            await rdzv.shutdown()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return runtime.run(run(args))  # uvloop's event loop when installed
    except MissingExtra as exc:  # e.g. the digits without the trainer extra: one line, no traceback
        print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
        return 2
