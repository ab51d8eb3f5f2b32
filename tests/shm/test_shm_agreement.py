"""Ranks agree on the shared-memory path at init: one rank with RINGWEAVE_SHM=0
turns it off for the whole job, instead of the ranks picking different algorithms."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_one_rank_without_shm_turns_it_off_everywhere(tmp_path):
    script = tmp_path / "mixed.py"
    script.write_text(textwrap.dedent("""
        import os, numpy as np, runtime, collectives
        if os.environ["RANK"] == "1":
            os.environ["RINGWEAVE_SHM"] = "0"        # only this rank opts out
        async def main():
            rt = await runtime.init()
            rt.tracer.out_dir = os.environ["OUT"]
            x = np.full(1000, rt.rank + 1, np.float32)
            await collectives.all_reduce(x)
            assert (x == 1 + 2 + 3).all(), x[:3]
            print("rank", rt.rank, "shm", rt.shm_enabled, "algo", rt.tracer.events[-1]["args"]["algorithm"])
            await runtime.shutdown()
        runtime.run(main())
    """))
    env = dict(os.environ, OUT=str(tmp_path))
    env.pop("RINGWEAVE_SHM", None)
    out = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "3", "--timeout-s", "20", str(script)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(3):
        line = next(ln for ln in out.stdout.splitlines() if f"rank {r} shm" in ln)
        assert "shm False" in line and "algo shm" not in line, line
