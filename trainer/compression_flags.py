"""The trainer's gradient-compression flags: ``--compression``, ``--compression-warmup-steps`` and
``--compression-start``; what they refuse together, the codec spec they give and the step the
codec starts at (trainer/cli.py reads them into TrainConfig).

Warm-ups are counted in optimizer steps, which a checkpoint restores, so a resumed run goes on
where the uninterrupted one is: PowerSGD's ``--compression-warmup-steps`` is ``compression_start``
(not the codec's own ``vanilla_steps``, which counts the calls of a process), and top-k's DGC ramp
follows the strategy's step (``AccountedCollectives.start_step``). docs/design.md, "Compressed
collectives".
"""

from __future__ import annotations

import argparse

from runtime import args as types

__all__ = ["add_arguments", "refusal", "spec", "start"]


def add_arguments(g) -> None:
    """The flags, in argument group ``g``."""
    g.add_argument("--compression", default=None, metavar="CODEC",
                   help="gradient codec, e.g. fp16, bf16, int8, topk (ddp all-reduces flat buckets; zero1/2/3 "
                        "and fsdp compress their reduce_scatter block by block); powersgd compresses matrices: "
                        "ddp only, per parameter of each bucket; "
                        "append +ef for error feedback, e.g. int8+ef, and codec options after a colon, "
                        "e.g. topk+ef:ratio=0.01 (default none)")
    g.add_argument("--compression-warmup-steps", type=types.count, default=None, metavar="N",
                   help="topk: steps of Deep Gradient Compression's warm-up (kept fraction 25%%, 6.25%%, 1.56%%, "
                        "then the ratio, in equal stages); default two epochs, 0 for none. powersgd (ddp): steps "
                        "sent uncompressed first, as torch's start_powerSGD_iter: the same as --compression-start "
                        "(default none)")
    g.add_argument("--compression-start", type=types.count, default=0, metavar="N",
                   help="any codec, any strategy: the first N steps' gradients uncompressed (default 0)")


def refusal(args: argparse.Namespace) -> str | None:
    """Why these flags cannot go together, or None."""
    codec = args.compression or ""
    if args.compression_warmup_steps and not codec.startswith(("topk", "powersgd")):
        return f"--compression-warmup-steps is a topk and powersgd option; --compression is {args.compression!r}"
    if args.compression_warmup_steps and args.compression_start and codec.startswith("powersgd"):
        return "--compression-warmup-steps is --compression-start for powersgd: give one of them"
    return None


def spec(args: argparse.Namespace, steps_per_epoch: int) -> str | None:
    """--compression plus the top-k warm-up option, e.g. "topk+ef:warmup_steps=46" (two epochs of
    23 steps: the default, see --compression-warmup-steps); None for no codec."""
    text = None if args.compression in (None, "none") else args.compression
    if text is None or not text.startswith("topk") or "warmup_steps=" in text:
        return text
    steps = 2 * steps_per_epoch if args.compression_warmup_steps is None else args.compression_warmup_steps
    if not steps:
        return text
    return f"{text}{',' if ':' in text else ':'}warmup_steps={steps}"


def start(args: argparse.Namespace) -> int:
    """The uncompressed steps: --compression-start, or PowerSGD's --compression-warmup-steps."""
    if (args.compression or "").startswith("powersgd") and args.compression_warmup_steps:
        return args.compression_warmup_steps
    return args.compression_start
