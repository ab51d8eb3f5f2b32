"""`python -m trainer.sample`: text from a GPT checkpoint, decoded with a KV cache.

    python -m trainer.sample --checkpoint ckpt --prompt "The assert statement" --tokens 200

It reads the checkpoint --checkpoint names, or the newest that reads of the run of the directory
it names (trainer/rundir.py: its one named run, else the checkpoints that name no run, never a mix;
several named runs are an error; a damaged checkpoint is skipped, saying why), from its files
alone: no ranks, whatever world size and strategy saved it. The model is rebuilt
from the checkpoint's "model" entry (`GPT.spec()`), the prompt is encoded as UTF-8 bytes, and
`GPT.generate` samples one byte at a time, each costing one position thanks to the KV cache
(trainer/nn/gpt.py). The prompt and the generated text go to stdout.

What it is not: no batching of prompts, no beam search, no server.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from runtime import args as types
from trainer.checkpoint import METADATA, CheckpointError, read_unit_params
from trainer.nn import GPT
from trainer.nn.gpt import GPTConfig
from trainer.rundir import checkpoints_to_read
from trainer.runid import RunError
from trainer.text import decode, encode

__all__ = ["build_parser", "load_model", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.sample", description="Generate text from a GPT checkpoint.")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a checkpoint directory, or the --checkpoint-dir of a run (its newest checkpoint)")
    p.add_argument("--prompt", default="\n", help="the text to continue (default a newline)")
    p.add_argument("--tokens", type=types.count, default=200, help="bytes to generate (default 200)")
    p.add_argument("--temperature", type=types.temperature, default=0.8,
                   help="softmax temperature, >= 0.001; 0 takes the arg-max")
    p.add_argument("--top-k", type=types.positive_int, default=None, help="sample among the k most likely bytes only")
    p.add_argument("--seed", type=types.count, default=0)
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="recompute the whole context for every byte (the reference for the KV cache)")
    return p


def _read_newest_valid(path) -> tuple[list[np.ndarray], dict]:
    """read_unit_params of ``path`` (a checkpoint directory), or of the newest checkpoint of the
    run under it that reads; each one skipped is said on stderr."""
    if (Path(path) / METADATA).is_file():
        return read_unit_params(path)
    try:
        run, candidates = checkpoints_to_read(path)
    except RunError as exc:
        raise CheckpointError(str(exc)) from None
    if not candidates:
        raise CheckpointError(f"no committed checkpoint in {path} (looked for {METADATA} or step-*/{METADATA})")
    skipped = []
    for candidate in reversed(candidates):
        try:
            return read_unit_params(candidate)
        except CheckpointError as exc:
            print(f"trainer.sample: skipping {candidate}: {exc}", file=sys.stderr)
            skipped.append(candidate.name)
    who = (f"run {run.id}" if run.id else "the unnamed run") if run else "a run"
    raise CheckpointError(f"none of the {len(candidates)} checkpoints of {who} in {path} could be read "
                          f"({', '.join(skipped)})")


def _gpt_config(meta: dict) -> GPTConfig:
    """The GPTConfig of a checkpoint's "model" entry, checked before any model is built: every
    field of GPTConfig's type, no other key, and as many blocks as the checkpoint has units."""
    spec = meta.get("model")
    if not spec or spec.get("kind") != "gpt":
        raise CheckpointError(f"{meta['path']} holds no GPT (its model is {str(spec)[:80]}); train with --model gpt")
    fields = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
    config = spec["config"]  # a map of scalars (trainer/ckptschema.py)
    for key, value in config.items():
        if key not in fields or type(value) not in kinds[fields[key]]:
            raise CheckpointError(f"{meta['path']}: model.config.{key} = {repr(value)[:40]} is not a GPTConfig "
                                  f"field of type {fields.get(key, 'none')}")
    try:
        config = GPTConfig(**config)
    except ValueError as exc:
        raise CheckpointError(f"{meta['path']}: model.config: {exc}") from None
    if config.n_layer + 1 != len(meta["units"]):
        raise CheckpointError(f"{meta['path']}: model.config.n_layer = {config.n_layer}, but the checkpoint holds "
                              f"{len(meta['units'])} units (an embedding unit and one per block)")
    return config


def load_model(path) -> tuple[GPT, list[np.ndarray]]:
    """The GPT of a checkpoint (or of the newest valid one of the run under a --checkpoint-dir)
    and its parameters (float32, the unpadded units).

    Raises:
        CheckpointError: no checkpoint that passes trainer/ckptschema.py and its files' checks,
            no GPT in it, or a model whose sizes differ from the parameters stored.
    """
    flats, meta = _read_newest_valid(path)
    model = GPT(_gpt_config(meta))  # its numbers of units agree: building it allocates no parameters
    for unit, flat in zip(model.units, flats):
        if flat.size != unit.numel:
            raise CheckpointError(f"{meta['path']}: unit {unit.index} has {flat.size} parameters, the spec's "
                                  f"model {unit.numel}")
    return model, [np.asarray(f, dtype=np.float32) for f in flats]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # every number checked by its type (runtime/args.py)
    try:
        model, params = load_model(args.checkpoint)
    except CheckpointError as exc:
        print(f"trainer.sample: {exc}", file=sys.stderr)
        return 1
    prompt = encode(args.prompt) if args.prompt else encode("\n")
    ids = model.generate(params, prompt[None, :], args.tokens, temperature=args.temperature, top_k=args.top_k,
                         seed=args.seed, use_cache=args.cache)
    sys.stdout.write(decode(ids[0]) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
