"""`python -m trainer.sample`: text from a GPT checkpoint, decoded with a KV cache.

    python -m trainer.sample --checkpoint ckpt --prompt "The assert statement" --tokens 200

It reads the checkpoint --checkpoint names, or the newest that reads of the run of the directory
it names (trainer/rundir.py: its one named run, else the checkpoints that name no run, never a mix;
several named runs are an error; a damaged checkpoint is skipped, saying why), from its files
alone: no ranks, whatever world size and strategy saved it. The model is rebuilt from the
checkpoint's "model" entry (`GPT.spec()`), the prompt is encoded as UTF-8 bytes, and `generate`
samples one byte at a time. The prompt and the generated text go to stdout; the checkpoint read
and its step, to stderr.

The context slides, as nanoGPT's: each token is predicted from the last block_size tokens (a
longer prompt is cropped the same way). While the context is filling, the KV cache makes each
token cost one position (`Decoder`); once it is full, every step moves every position by one,
and since the positions are learned embeddings, no cached key stays valid: the cache is rebuilt
for the cropped window (one forward of block_size positions per token, what nanoGPT pays).
Sampling: logits / temperature (0: greedy, the arg-max), optionally only the top_k, then a draw.

What it is not: no batching of prompts, no beam search, no server.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
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

__all__ = ["build_parser", "load_model", "load_model_and_metadata", "check_sampling", "sample_next", "Decoder",
           "generate", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.sample", description="Generate text from a GPT checkpoint.")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a checkpoint directory, or the --checkpoint-dir of a run (its newest checkpoint)")
    p.add_argument("--prompt", default="\n", help="the text to continue (default a newline)")
    p.add_argument("--tokens", type=types.count, default=200, help="bytes to generate (default 200)")
    p.add_argument("--temperature", type=types.temperature, default=0.8,
                   help="softmax temperature, >= 0.001; 0 is greedy (the arg-max)")
    p.add_argument("--top-k", type=types.positive_int, default=None,
                   help="sample among the k most likely bytes only (1 .. the vocabulary, 256)")
    p.add_argument("--seed", type=types.count, default=0)
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="recompute the whole (slid) context for every byte (the reference for the KV cache)")
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
    return load_model_and_metadata(path)[:2]


def load_model_and_metadata(path) -> tuple[GPT, list[np.ndarray], dict]:
    """`load_model`, and the metadata of the checkpoint read ("path", "step", ...)."""
    flats, meta = _read_newest_valid(path)
    model = GPT(_gpt_config(meta))  # its numbers of units agree: building it allocates no parameters
    for unit, flat in zip(model.units, flats):
        if flat.size != unit.numel:
            raise CheckpointError(f"{meta['path']}: unit {unit.index} has {flat.size} parameters, the spec's "
                                  f"model {unit.numel}")
    return model, [np.asarray(f, dtype=np.float32) for f in flats], meta


# ---- decoding ------------------------------------------------------------------------------


def check_sampling(temperature: float, top_k: int | None, vocab_size: int) -> None:
    """Raises ValueError, in one line, unless temperature is 0 (greedy) or a finite number > 0 and
    top_k is None or an int in 1..vocab_size."""
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        t = math.nan
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature must be > 0, or 0 for greedy decoding (the arg-max), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                              or not 1 <= top_k <= vocab_size):
        raise ValueError(f"top_k must be an integer in 1..{vocab_size} (the vocabulary), got {top_k!r}")


def sample_next(logits: np.ndarray, temperature: float, top_k: int | None, rng) -> np.ndarray:
    """One token per row of ``logits`` (B, V): the arg-max at temperature 0, else a draw from
    softmax((logits - max) / temperature) over the ``top_k`` largest (all when None)."""
    check_sampling(temperature, top_k, logits.shape[-1])
    z = np.asarray(logits, dtype=np.float64)  # (B, V)
    if temperature == 0:
        return z.argmax(axis=-1)
    with np.errstate(over="ignore"):  # <= 0 everywhere: at a tiny temperature the others go to -inf, p to 0
        z = (z - z.max(axis=-1, keepdims=True)) / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k][:, None]  # (B, 1)
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(len(row), p=row) for row in p], dtype=np.int64)


class Decoder:
    """The next token's logits of growing sequences, from their last block_size tokens (the module
    docstring). ``use_cache=False`` runs the whole cropped context every time: the reference."""

    def __init__(self, model: GPT, params: list[np.ndarray], *, use_cache: bool = True) -> None:
        self.model, self.params, self.use_cache = model, params, use_cache
        self.block_size = model.config.block_size
        self.dtype = np.result_type(params[0].dtype, np.float32)
        self.caches, self.start, self.fed = None, 0, 0  # fed: tokens of ids[:, start:] in the caches

    def next_logits(self, ids: np.ndarray) -> np.ndarray:
        """Logits (B, V) of the token after ``ids`` (B, t), given ids[:, max(0, t - block_size):]."""
        start = max(0, ids.shape[1] - self.block_size)
        if not self.use_cache:
            return self.model.forward(self.params, ids[:, start:])[:, -1]
        if self.caches is None or start != self.start:  # the window moved: every position changed
            self.caches, self.start, self.fed = self.model.new_caches(len(ids), self.dtype), start, 0
        logits = self.model.logits_cached(self.params, ids[:, start + self.fed :], self.caches)[:, -1]
        self.fed = ids.shape[1] - start
        return logits


def generate(model: GPT, params: list[np.ndarray], prompt: np.ndarray, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> np.ndarray:
    """``prompt`` (B, T0) token ids followed by ``max_new_tokens`` sampled ones, (B, T0 + new); the
    context slides over the last block_size tokens. Draws come from np.random.default_rng(seed).

    Raises:
        ValueError: an empty or non-2-D prompt, a temperature < 0 or not finite, a top_k outside
            1..vocab_size (check_sampling).
    """
    ids = np.asarray(prompt, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError(f"prompt must be (B, T0) token ids with T0 >= 1, got shape {ids.shape}")
    check_sampling(temperature, top_k, model.config.vocab_size)
    rng = np.random.default_rng(seed)
    decoder = Decoder(model, params, use_cache=use_cache)
    for _ in range(max_new_tokens):
        token = sample_next(decoder.next_logits(ids), temperature, top_k, rng)  # (B,)
        ids = np.concatenate([ids, token[:, None]], axis=1)
    return ids


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # every number checked by its type (runtime/args.py)
    try:
        model, params, meta = load_model_and_metadata(args.checkpoint)
    except CheckpointError as exc:
        print(f"trainer.sample: {exc}", file=sys.stderr)
        return 1
    if args.top_k is not None and args.top_k > model.config.vocab_size:
        print(f"trainer.sample: error: argument --top-k: {args.top_k} must be <= the vocabulary size "
              f"{model.config.vocab_size}", file=sys.stderr)
        return 2
    print(f"trainer.sample: checkpoint {meta['path']} (optimizer step {meta['step']})", file=sys.stderr)
    prompt = encode(args.prompt) if args.prompt else encode("\n")
    ids = generate(model, params, prompt[None, :], args.tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed, use_cache=args.cache)
    sys.stdout.write(decode(ids[0]) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
