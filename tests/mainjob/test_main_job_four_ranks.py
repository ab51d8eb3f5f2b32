"""The README's main job, unchanged, at 4 ranks: it must reach 95% validation accuracy.
(One strategy here; tests/trainer_dist shows every strategy computes the same parameters.
How long it takes is measured by bench/mainjob.py, not asserted.)"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_main_job_at_four_ranks_reaches_95_percent(tmp_path):
    out = tmp_path / "history.json"
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "4", "-m", "trainer", "--strategy", "fsdp",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    history = json.loads(out.read_text())["history"]
    assert history["world_size"] == 4 and len(history["epochs"]) == 5
    assert history["epochs"][-1]["val_acc"] >= 0.95
