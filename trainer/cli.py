"""`python -m trainer`: the project's main job.

    python -m runtime.launch -n 4 -m trainer                      # 4 ranks, ddp, digits
    python -m runtime.launch -n 4 -m trainer --strategy fsdp --param-dtype bfloat16
    python -m trainer --epochs 3                                  # one process, world size 1
    python -m runtime.launch -n 2 -m trainer --data synthetic --size 20000 --width 1024 --depth 3

Every rank: `await runtime.init()`, load the data (the same on every rank), build
the MLP with `pad_to=world.size`, build and set up the strategy, `fit`, print
the summary (rank 0), `await runtime.shutdown()`.

Defaults (digits, MLP 64-256-256-10 with LayerNorm + GELU, AdamW at 2e-3 with
half an epoch of warm-up and cosine decay, global batch 64, 5 epochs) reach
>= 95% validation accuracy under every strategy; the figures are in the
commit that set them.

BLAS threads: each rank limits BLAS to `--blas-threads` threads (default 1)
with threadpoolctl, whatever OPENBLAS_NUM_THREADS says. The default model's
matmuls (batch 64 x 256) gain nothing from a second thread, the strategies
already run the model on a thread beside the event loop, and on a busy 2-core
machine two BLAS threads made the single-process main job slower
(bench/results/trainer.md#blas-threads). Give more threads to wide synthetic
models on an idle machine.

Preemption: with --checkpoint-dir, SIGTERM and SIGUSR1 (RINGWEAVE_PREEMPT_SIGNALS) make
every rank save a checkpoint after the same step and exit 128 + the signal
(trainer/preempt.py); --resume continues from it.

What it is not: no config files (flags only), no model zoo (the MLP builder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from trainer.sharding.base import TrainConfig

__all__ = ["build_parser", "parse_args", "make_config", "load_data", "main", "run"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
DTYPE_CHOICES = ("float32", "float16", "bfloat16", "float64")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train an MLP with a ringweave sharding strategy "
                    "(launch several ranks with: python -m runtime.launch -n 4 -m trainer ...).")
    g = p.add_argument_group("strategy")
    g.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="sharding strategy (default ddp)")
    g.add_argument("--param-dtype", choices=DTYPE_CHOICES, default="float32",
                   help="compute copy of the parameters and its all-gather (default float32)")
    g.add_argument("--reduce-dtype", choices=DTYPE_CHOICES, default="float32",
                   help="gradient communication dtype (default float32)")
    g.add_argument("--master-dtype", choices=("float32", "float64"), default="float32")
    g.add_argument("--grad-accum", type=_positive_int, default=1, metavar="A",
                   help="micro-batches per optimizer step (default 1)")
    g.add_argument("--clip-norm", type=_positive_float, default=None, metavar="C",
                   help="global-norm gradient clipping (default off)")
    g.add_argument("--compression", default=None, metavar="CODEC",
                   help="gradient codec, e.g. fp16, bf16, int8, topk (ddp all-reduces flat buckets; zero1/2/3 "
                        "and fsdp compress their reduce_scatter block by block; powersgd, which compresses "
                        "matrices, is refused by both); "
                        "append +ef for error feedback, e.g. int8+ef, and codec options after a colon, "
                        "e.g. topk+ef:ratio=0.01 (default none)")
    g.add_argument("--compression-warmup-steps", type=_non_negative_int, default=None, metavar="N",
                   help="topk: steps of Deep Gradient Compression's warm-up (kept fraction 25%%, 6.25%%, "
                        "1.56%%, then the ratio, in equal stages); default two epochs "
                        "(bench/results/trainer.md#compression-warm-up), 0 for none")
    g.add_argument("--bucket-cap-mb", type=_positive_float, default=25.0, help="ddp bucket size (default 25)")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="zero3/fsdp: keep gathered parameters from forward to backward")
    g.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="zero3/fsdp: do not gather the next unit ahead")
    g.add_argument("--loss-scale", choices=("auto", "on", "off"), default="auto",
                   help="dynamic loss scaling (auto: on for float16)")
    g.add_argument("--check-every", type=_non_negative_int, default=0, metavar="N",
                   help="check replicated state is equal across ranks every N steps (default never)")

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=_non_negative_int, default=5)
    g.add_argument("--batch-size", type=_positive_int, default=64, metavar="G",
                   help="global micro-batch size, all ranks together (default 64)")
    g.add_argument("--lr", type=_positive_float, default=2e-3, help="peak learning rate (default 2e-3)")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--momentum", type=float, default=0.9, help="sgd only")
    g.add_argument("--nesterov", action="store_true", help="sgd only")
    g.add_argument("--min-lr", type=float, default=None, help="cosine floor (default lr / 100)")
    g.add_argument("--adam-kernel", choices=("numba", "numpy"), default="numba")
    g.add_argument("--warmup-steps", type=_non_negative_int, default=None,
                   help="linear warm-up steps (default half an epoch)")
    g.add_argument("--seed", type=_non_negative_int, default=0,
                   help="seeds parameters, data order, dropout and the split")

    g = p.add_argument_group("data and model")
    g.add_argument("--data", choices=("digits", "synthetic"), default="digits")
    g.add_argument("--size", type=_positive_int, default=10000, help="synthetic: rows (default 10000)")
    g.add_argument("--in-dim", type=_positive_int, default=64, help="synthetic: features (default 64)")
    g.add_argument("--classes", type=_positive_int, default=10, help="synthetic: classes (default 10)")
    g.add_argument("--val-fraction", type=float, default=0.2)
    g.add_argument("--width", type=_positive_int, default=256, help="hidden width (default 256)")
    g.add_argument("--depth", type=_positive_int, default=2, help="hidden blocks (default 2)")
    g.add_argument("--dropout", type=float, default=0.0)
    g.add_argument("--activation", choices=("gelu", "relu"), default="gelu")

    g = p.add_argument_group("run")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="save checkpoints here")
    g.add_argument("--checkpoint-every", type=_non_negative_int, default=0, metavar="N",
                   help="also save every N optimizer steps (default: end of each epoch only)")
    g.add_argument("--keep-last", type=_positive_int, default=2, help="checkpoints kept (default 2)")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    g.add_argument("--target-accuracy", type=float, default=None, metavar="ACC",
                   help="stop once validation accuracy reaches ACC")
    g.add_argument("--patience", type=_positive_int, default=None,
                   help="stop when validation loss has not improved for N epochs")
    g.add_argument("--no-eval-train", dest="eval_train", action="store_false",
                   help="skip evaluating the whole training set after each epoch")
    g.add_argument("--log-every", type=_non_negative_int, default=10, metavar="N")
    g.add_argument("--blas-threads", type=_positive_int, default=None, metavar="T",
                   help="BLAS threads per rank (default 1)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the history as JSON (rank 0)")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        build_parser().error("--resume needs --checkpoint-dir")
    if not 0.0 < args.val_fraction < 1.0:
        build_parser().error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if not 0.0 <= args.dropout < 1.0:
        build_parser().error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.compression_warmup_steps and not (args.compression or "").startswith("topk"):
        build_parser().error(f"--compression-warmup-steps is a topk option; --compression is {args.compression!r}")
    return args


def compression_spec(args: argparse.Namespace, steps_per_epoch: int) -> str | None:
    """--compression plus the top-k warm-up option, e.g. "topk+ef:warmup_steps=46" (two epochs of
    23 steps: the default, see --compression-warmup-steps); None for no codec."""
    spec = None if args.compression in (None, "none") else args.compression
    if spec is None or not spec.startswith("topk") or "warmup_steps=" in spec:
        return spec
    steps = 2 * steps_per_epoch if args.compression_warmup_steps is None else args.compression_warmup_steps
    if not steps:
        return spec
    return f"{spec}{',' if ':' in spec else ':'}warmup_steps={steps}"


def make_config(args: argparse.Namespace, steps_per_epoch: int) -> TrainConfig:
    """The TrainConfig of the flags; the schedule spans `epochs * steps_per_epoch` steps."""
    total = max(1, args.epochs * steps_per_epoch)
    warmup = steps_per_epoch // 2 if args.warmup_steps is None else args.warmup_steps
    fields = dict(
        strategy=args.strategy, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
        momentum=args.momentum, nesterov=args.nesterov, adam_kernel=args.adam_kernel,
        min_lr=args.lr / 100 if args.min_lr is None else args.min_lr,
        warmup_steps=min(warmup, total), total_steps=total,
        param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype, master_dtype=args.master_dtype,
        grad_accum=args.grad_accum, clip_norm=args.clip_norm,
        compression=compression_spec(args, steps_per_epoch),
        bucket_cap_mb=args.bucket_cap_mb, reshard_after_forward=args.reshard_after_forward,
        prefetch=args.prefetch, loss_scale={"auto": None, "on": True, "off": False}[args.loss_scale],
        seed=args.seed, check_every=args.check_every)
    return TrainConfig(**fields)


def load_data(args: argparse.Namespace):
    """A trainer.data.Split, the same on every rank."""
    from trainer.data import Split, load_digits_split, make_synthetic

    dtype = np.float64 if args.master_dtype == "float64" else np.float32
    if args.data == "digits":
        return load_digits_split(seed=args.seed, val_fraction=args.val_fraction, dtype=dtype)
    x, y = make_synthetic(args.size, args.in_dim, args.classes, seed=args.seed, dtype=dtype)
    n_val = int(round(args.size * args.val_fraction))  # rows are in random order already
    return Split(x[n_val:], y[n_val:], x[:n_val], y[:n_val], args.classes)


def _blas_threads(args) -> int:
    """BLAS threads inside each rank: --blas-threads, else 1 (see the module docstring)."""
    return args.blas_threads or 1


async def run(args: argparse.Namespace) -> int:
    import runtime
    from trainer.loop import EarlyStopping, StopAtAccuracy, fit, steps_per_epoch
    from trainer.nn import mlp
    from trainer.preempt import Preempted, Preemption
    from trainer.sharding import make_strategy

    rt = await runtime.init()
    strategy = None
    try:
        from threadpoolctl import threadpool_limits  # ships with scikit-learn

        limiter = threadpool_limits(limits=_blas_threads(args), user_api="blas")
    except ImportError:  # pragma: no cover - scikit-learn is a dependency
        limiter = None
    try:
        world = rt.world
        data = load_data(args)
        spe = steps_per_epoch(len(data.x_train), args.batch_size, args.grad_accum)
        config = make_config(args, spe)
        model_dtype = np.float64 if args.master_dtype == "float64" else np.float32
        model = mlp(data.in_dim, (args.width,) * args.depth, data.num_classes, activation=args.activation,
                    dropout=args.dropout, pad_to=world.size, dtype=model_dtype)
        strategy = make_strategy(args.strategy, model, config, world)
        await strategy.setup()
        if world.rank == 0 and not args.quiet:
            print(f"{args.strategy} on {world.size} rank(s): {args.data} ({len(data.x_train)} train, "
                  f"{len(data.x_val)} val), MLP {data.in_dim}-{'-'.join([str(args.width)] * args.depth)}-"
                  f"{data.num_classes} ({model.numel:,} parameters), {args.optimizer} lr {args.lr}, "
                  f"batch {args.batch_size} x {args.grad_accum}, {args.epochs} epochs of {spe} steps",
                  file=sys.stderr, flush=True)
        callbacks = []
        if args.target_accuracy is not None:
            callbacks.append(StopAtAccuracy(args.target_accuracy))
        if args.patience is not None:
            callbacks.append(EarlyStopping("val_loss", patience=args.patience))
        try:  # with --checkpoint-dir, the scheduler's signals checkpoint and stop every rank (trainer/preempt.py)
            with Preemption(enabled=bool(args.checkpoint_dir)):
                history = await fit(strategy, data, config, epochs=args.epochs, global_batch_size=args.batch_size,
                                    callbacks=callbacks, checkpoint_dir=args.checkpoint_dir,
                                    keep_last=args.keep_last, resume=args.resume,
                                    log_every=0 if args.quiet else args.log_every,
                                    checkpoint_every=args.checkpoint_every, eval_train=args.eval_train, group=world)
        except Preempted as exc:
            if world.rank == 0:
                print(f"{exc} (resume with --checkpoint-dir {args.checkpoint_dir} --resume)", file=sys.stderr,
                      flush=True)
            return exc.exit_code
        if args.json and world.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "history": history.as_dict()}, f, indent=1, default=str)
    finally:
        if strategy is not None and hasattr(strategy, "close"):
            strategy.close()
        if limiter is not None:
            limiter.restore_original_limits()
        await runtime.shutdown(rt)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import runtime

    return runtime.run(run(args))  # uvloop's event loop when installed
