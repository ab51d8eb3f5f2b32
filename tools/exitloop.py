"""Run one script many times through the launcher, several runs at once, and count the runs
that failed: a crash that shows once in twenty runs (a signal at interpreter exit) needs many.

    python -m tools.exitloop tests/launch/exit_without_close.py                 # 50 runs x 2 ranks, 5 at once
    python -m tools.exitloop --runs 25 -n 4 --parallel 2 my_script.py --its-arg

Each run is ``python -X faulthandler -m runtime.launch -n N script [args]`` (faulthandler: a
rank that dies of a signal says where, when Python can). Prints one line per failed run (its
exit code, signal name, and last lines), then ``R runs, F failed``; exits 1 if any failed.

Not here: what the script checks (tests/launch/test_exit_without_close.py uses both).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
import subprocess
import sys
from dataclasses import dataclass

from runtime import args as types


@dataclass
class Run:
    index: int
    returncode: int
    output: str

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    def describe(self) -> str:
        code = self.returncode
        if code > 128 and code - 128 in signal.valid_signals():
            how = f"exit code {code} ({signal.Signals(code - 128).name})"
        elif code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        last = self.output.strip().splitlines()[-6:]
        return f"run {self.index}: {how}" + "".join(f"\n    | {line}" for line in last)


def run_once(index: int, script: str, args: list[str], nproc: int, timeout_s: float, env=None) -> Run:
    cmd = [sys.executable, "-X", "faulthandler", "-m", "runtime.launch", "-n", str(nproc), script, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:  # its output is bytes whatever text= said
        out = "".join(b.decode(errors="replace") if isinstance(b, bytes) else b
                      for b in (exc.stdout or "", exc.stderr or ""))
        return Run(index, 124, out + f"\n(timed out after {timeout_s:g} s)")
    return Run(index, proc.returncode, proc.stdout + proc.stderr)


def run_loop(script: str, args: list[str] = (), *, runs: int = 50, parallel: int = 5, nproc: int = 2,
             timeout_s: float = 120.0, env=None) -> list[Run]:
    """Runs ``script`` ``runs`` times, ``parallel`` at once; returns every run, in order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(run_once, i, script, list(args), nproc, timeout_s, env) for i in range(runs)]
        return [f.result() for f in futures]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.exitloop", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=types.positive_int, default=50, help="how many runs (default 50)")
    p.add_argument("--parallel", type=types.positive_int, default=5, help="runs at once (default 5)")
    p.add_argument("-n", "--nproc", type=types.positive_int, default=2, help="ranks per run (default 2)")
    p.add_argument("--timeout-s", type=types.positive_seconds, default=120.0, help="one run's limit (default 120)")
    p.add_argument("script", help="the script to launch")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    results = run_loop(a.script, a.args, runs=a.runs, parallel=a.parallel, nproc=a.nproc, timeout_s=a.timeout_s)
    failed = [r for r in results if r.failed]
    for r in failed:
        print(r.describe())
    print(f"{len(results)} runs of {a.nproc} ranks, {a.parallel} at once: {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
