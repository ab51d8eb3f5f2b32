"""The default GPT as a user runs it, per strategy: validation loss, bits per byte, wall time; then a sample.

    python bench/gpt_job.py                           # 4 ranks, every strategy, default flags
    python bench/gpt_job.py --strategies fsdp --nproc 4 -- --epochs 4

For each strategy it runs ``python -m runtime.launch -n N -m trainer --model gpt --strategy S``
(nothing tuned; arguments after ``--`` are passed on), times it from launch to exit, and
reads the final validation loss from the trainer's ``--json`` history. It prints the
corpus's unigram baseline (the loss of predicting every byte by its frequency in the
training text) beside it, and the load average before and after each run: the time
depends on what else runs. The last strategy's checkpoint then goes through
``python -m trainer.sample`` (seed 0, temperature 0.8), whose text is printed.

The goal: a validation loss clearly below the unigram baseline within 10 minutes at
4 ranks on this 2-core machine, for every strategy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(strategy: str, nproc: int, extra: list[str], ckpt: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="rw-gpt-") as tmp:
        out = os.path.join(tmp, "history.json")
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", str(nproc), "-m", "trainer",
                               "--model", "gpt", "--strategy", strategy, "--json", out, "--checkpoint-dir", ckpt,
                               "--log-every", "0", *extra], cwd=ROOT, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"strategy": strategy, "error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}
        with open(out) as f:
            history = json.load(f)["history"]
    final = history["epochs"][-1]
    return {"strategy": strategy, "val_loss": final["val_loss"], "bpb": final["val_bits_per_byte"],
            "val_acc": final["val_acc"], "epochs": len(history["epochs"]), "wall_s": wall,
            "train_s": history["train_time_s"], "load": load, "load_after": os.getloadavg()[0],
            "peak_rss_mib": max(r["maxrss_bytes"] for r in history["ranks"]) / 2**20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--sample-tokens", type=int, default=300)
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    sys.path.insert(0, ROOT)
    from trainer.text import load_text_split

    baseline = load_text_split(64).unigram_loss
    print(f"# python -m runtime.launch -n {args.nproc} -m trainer --model gpt --strategy S {' '.join(extra)}")
    print(f"# unigram baseline of the validation text: {baseline:.4f} nats per byte "
          f"({baseline / math.log(2):.3f} bits); goal: clearly below it in < 600 s")
    print("| strategy | val loss | bits/byte | next-byte acc | epochs | wall s | training s | peak RSS MiB | "
          "load before / after | goal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |", flush=True)
    failed, ckpt = 0, None
    with tempfile.TemporaryDirectory(prefix="rw-gpt-ckpt-") as keep:
        for s in args.strategies.split(","):
            ckpt = os.path.join(keep, s)
            r = run(s, args.nproc, extra, ckpt)
            if "error" in r:
                failed += 1
                print(f"| {s} | {r['error']} |")
                continue
            ok = r["val_loss"] < baseline - 1.0 and r["wall_s"] < 600
            print(f"| {s} | {r['val_loss']:.4f} | {r['bpb']:.3f} | {r['val_acc']:.3f} | {r['epochs']} | "
                  f"{r['wall_s']:.0f} | {r['train_s']:.0f} | {r['peak_rss_mib']:.0f} | {r['load']:.1f} / "
                  f"{r['load_after']:.1f} | {'ok' if ok else 'MISSED'} |", flush=True)
        if ckpt and os.path.isdir(ckpt):
            cmd = [sys.executable, "-m", "trainer.sample", "--checkpoint", ckpt, "--prompt", "The ", "--tokens",
                   str(args.sample_tokens), "--temperature", "0.8", "--seed", "0"]
            sample = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
            print(f"\n# {' '.join(cmd[1:4])} <last checkpoint> {' '.join(cmd[5:])}\n")
            print(sample.stdout if sample.returncode == 0 else sample.stderr[-800:])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
