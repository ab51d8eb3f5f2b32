"""bench/collectives.py --device cuda and bench/kernels.py --device cuda: they refuse clearly where
no GPU is usable, and under the CUDA simulator (tiny sizes) they run through: validation against
the closed forms / the NumPy reference, the table, the JSON. Never a speed: the simulator's times
mean nothing, and the figures come from a GPU run (README.md, "GPU tests")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cudasim

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def run(*cmd, simulator: bool, timeout_s=200):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NUMBA_ENABLE_CUDASIM")}
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.parametrize("script", ["collectives.py", "kernels.py"])
def test_device_cuda_refuses_without_a_gpu(script):
    pytest.importorskip("numba.cuda")
    if cudasim.gpu_usable():
        pytest.skip("a GPU is usable here: nothing to refuse")
    proc = run(f"bench/{script}", "--device", "cuda", simulator=False)
    assert proc.returncode != 0 and "--device cuda:" in proc.stderr and "GPU" in proc.stderr, proc.stderr


def test_collectives_device_cuda_runs_under_the_simulator(tmp_path):
    pytest.importorskip("numba.cuda")
    out = tmp_path / "d.json"
    proc = run("bench/collectives.py", "-n", "2", "--device", "cuda", "--ops", "all_reduce,reduce_scatter,broadcast",
               "--sizes", "64,4K", "--iters", "1", "--warmup", "0", "--json", str(out), simulator=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "simulator" in proc.stdout and "pinned pool" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["op"], r["bytes"]) for r in rows} == {(op, b) for op in ("all_reduce", "reduce_scatter", "broadcast")
                                                     for b in (64, 4096)}  # fmt: skip
    assert all(r["rw"] > 0 for r in rows) and all(r["rw-fold"] > 0 for r in rows if r["op"] == "all_reduce")


def test_kernels_device_cuda_runs_under_the_simulator():
    pytest.importorskip("numba.cuda")
    proc = run("-W", "ignore:overflow encountered in scalar:RuntimeWarning", "bench/kernels.py", "--device", "cuda",
               "--n", "64", "--repeat", "1", simulator=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for label in ("reduce_into sum float16", "reduce_into max float32", "topk encode", "int8 residual (fused)"):
        assert label in proc.stdout
