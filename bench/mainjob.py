"""The main job, as a user runs it, per strategy: validation accuracy and wall time.

    python bench/mainjob.py                       # 4 ranks, every strategy, default flags
    python bench/mainjob.py --strategies ddp,fsdp --nproc 2

For each strategy it runs ``python -m runtime.launch -n N -m trainer --strategy S``
(the README's main job, nothing tuned), times it from launch to exit, and reads
the final validation accuracy from the trainer's ``--json`` history. The target:
at least 95% on digits in under a minute on this 2-core machine. Load
average is printed beside each row: the time depends on what else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(strategy: str, nproc: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="rw-mainjob-") as tmp:
        out = os.path.join(tmp, "history.json")
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", str(nproc), "-m", "trainer",
                               "--strategy", strategy, "--json", out, *extra], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"strategy": strategy, "error": f"exit {proc.returncode}: {proc.stderr[-500:]}"}
        with open(out) as f:
            history = json.load(f)["history"]
    return {"strategy": strategy, "val_acc": history["epochs"][-1]["val_acc"], "wall_s": wall, "load": load}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--nproc", type=int, default=4)
    args, extra = p.parse_known_args(argv)
    print(f"# python -m runtime.launch -n {args.nproc} -m trainer --strategy S {' '.join(extra)}")
    print(f"# {'strategy':>8s} {'val acc':>8s} {'wall s':>7s}  goal: >= 0.95 in < 60 s")
    failed = 0
    for s in args.strategies.split(","):
        r = run(s, args.nproc, extra)
        if "error" in r:
            failed += 1
            print(f"  {s:>8s} {r['error']}")
            continue
        ok = r["val_acc"] >= 0.95 and r["wall_s"] < 60
        print(f"  {s:>8s} {r['val_acc']:8.4f} {r['wall_s']:7.1f}  {'ok' if ok else 'MISSED'}  (load {r['load']:.1f})",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
