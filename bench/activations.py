"""Activation memory of the GPT with and without activation checkpointing: the meter, the formula, RSS.

    python bench/activations.py                         # n_layer 2, 4, 8 at the default width, batch 64
    python bench/activations.py --layers 4,8 --batch 32

For each n_layer it runs one training step of the GPT (the default of `python -m
trainer --model gpt`, resized) in a fresh process per configuration, with and without
`checkpoint=True`, and reports:

- the peak of activation bytes the model held for its backward (trainer.nn.ActivationMeter,
  what the run summary shows as "activations peak");
- what the formula says, from sizes measured apart: without checkpointing every block
  keeps its activations, and the peak is at the loss: E + L A; with it every block
  keeps only its input X = B T C floats, and one block's activations exist again
  during its backward, after the head's are gone: max(E + L X, E_embed + L X + A - X)
  (A counts the block's input, which L X already holds).
  A is one block's cache (measured on one block alone), E the rest at the loss (the
  embedding's and the head's caches, the logits and their gradient: the peak of a
  model without blocks) and E_embed the embedding's part of it;
- the peak resident set size of the process (getrusage), which includes everything
  else the process holds (code, parameters, gradients, temporaries).

Validation first: the gradients with and without checkpointing are compared bit for
bit before any figure is printed. Output: a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402


def _model_and_batch(args, n_layer: int):
    from trainer.nn import GPT, GPTConfig
    from trainer.text import load_text_split

    config = GPTConfig(n_layer=n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    x, y = load_text_split(args.block_size).train.get(np.arange(args.batch), epoch=0)
    return GPT(config), x, y


def measure(args, n_layer: int, checkpoint: bool) -> dict:
    """In this process: one step; the meter's peak, the formula's parts, the gradients' digest, RSS."""
    import hashlib
    import resource

    from trainer.nn import ActivationMeter, Context

    model, x, y = _model_and_batch(args, n_layer)
    params, grads = model.init_params(0), model.zeros()
    meter = ActivationMeter()
    model.forward_backward(params, grads, x, y, Context(), checkpoint=checkpoint, meter=meter)
    digest = hashlib.blake2b(b"".join(g.tobytes() for g in grads), digest_size=8).hexdigest()
    # the formula's parts: one block's cache (A), one block's input (X), the model without blocks (E)
    block_meter = ActivationMeter()
    h = np.zeros((args.batch, args.block_size, args.n_embd), np.float32)
    _, cache = model.units[1].forward(params[1], h, Context())
    block_meter.hold(cache)
    ends_only, _, _ = _model_and_batch(args, 1)
    ends_only.calls = [ends_only.calls[0], ends_only.calls[-1]]  # the embedding and the head, no block: E
    e_meter = ActivationMeter()
    ends_only.forward_backward(ends_only.init_params(0), ends_only.zeros(), x, y, Context(), meter=e_meter)
    embed_meter = ActivationMeter()  # the embedding's part of E, held through the whole backward
    ends_only.forward_tape(ends_only.init_params(0), x, Context(), calls=range(1), meter=embed_meter)
    return dict(n_layer=n_layer, checkpoint=checkpoint, peak=meter.peak, A=block_meter.peak,
                X=h.nbytes, E=e_meter.peak, E_embed=embed_meter.peak, grads=digest,
                maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,4,8")
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        n_layer, checkpoint = args.worker.split(":")
        print(json.dumps(measure(args, int(n_layer), checkpoint == "1")))
        return 0
    print(f"# GPT {args.n_head} heads x {args.n_embd} wide, block {args.block_size}, batch {args.batch} windows, "
          f"float32; one step per process; MiB")
    print(f"{'n_layer':>7} {'ckpt':>5} {'peak':>8} {'formula':>8} {'A/block':>8} {'X/block':>8} {'E':>7} "
          f"{'max RSS':>8}  formula")
    failed = 0
    for n_layer in [int(v) for v in args.layers.split(",")]:
        rows = {}
        for checkpoint in (False, True):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"{n_layer}:{int(checkpoint)}",
                   "--n-head", str(args.n_head), "--n-embd", str(args.n_embd), "--block-size",
                   str(args.block_size), "--batch", str(args.batch)]
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
            proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            rows[checkpoint] = json.loads(proc.stdout.splitlines()[-1])
        if rows[False]["grads"] != rows[True]["grads"]:
            print(f"n_layer {n_layer}: gradients differ with checkpointing", file=sys.stderr)
            failed += 1
        for checkpoint, r in rows.items():
            L, A, X, E, E_embed = r["n_layer"], r["A"], r["X"], r["E"], r["E_embed"]
            formula = max(E + L * X, E_embed + L * X + A - X) if checkpoint else E + L * A
            text = "max(E + L X, E_embed + L X + A - X)" if checkpoint else "E + L A"
            mib = 2**20
            print(f"{L:>7} {'yes' if checkpoint else 'no':>5} {r['peak'] / mib:8.1f} {formula / mib:8.1f} "
                  f"{A / mib:8.1f} {X / mib:8.1f} {E / mib:7.1f} {r['maxrss'] / mib:8.0f}  {text}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
