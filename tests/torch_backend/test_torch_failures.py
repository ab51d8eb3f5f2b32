"""A rank that raises or is killed in a torch training loop on the "ringweave" backend surfaces on
the other rank as an exception within a second, under DDP (through its C++ reducer: a RuntimeError
that names ringweave's error) and FSDP2 (ringweave's own error type), not as a hang
(tests/torch_backend/job_fail.py, 2 ranks through our launcher, collective timeouts of 20 s); and ranks
started by hand meet through ``init_method="ringweave://"``."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tests.torch_backend.jobrun import ROOT, launch  # noqa: E402 - after the skip


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, kind, error", [
    ("raise", "ddp", r"RuntimeError after [\d.]+ s: .*PeerAbortedError: rank 1 aborted the job: ValueError: rank 1 "
                     r"gives up at step 2"),
    ("kill", "fsdp", r"PeerLostError after [\d.]+ s: rank 1 (was lost|\(pid \d+\) is gone)"),  # socket or shm
], ids=["raise-ddp", "kill-fsdp"])
def test_a_failed_rank_surfaces_on_the_other(how, kind, error):
    proc = launch("job_fail.py", how, kind, timeout_s=80, ranks_timeout_s=20)
    assert proc.returncode != 0
    seen = re.search(r"\[rank 0\] rank 0 step 2 saw " + error, proc.stdout)
    assert seen, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert float(re.search(r"after ([\d.]+) s", seen.group(0)).group(1)) < 5.0  # not the 20 s timeout
    assert "rank 1 finished" not in proc.stdout and "rank 0 finished" not in proc.stdout


@pytest.mark.timeout(90)
def test_ranks_started_by_hand_meet_through_the_ringweave_url(tmp_path):
    """Without our launcher: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand and
    ``init_method="ringweave://"`` (rank 0 hosts ringweave's store at MASTER_PORT)."""
    script = tmp_path / "by_hand.py"
    script.write_text("import torch, torch.distributed as dist, ringweave_torch\n"
                      "dist.init_process_group('ringweave', init_method='ringweave://')\n"
                      "t = torch.ones(2) * (dist.get_rank() + 1)\n"
                      "dist.all_reduce(t)\n"
                      "print('rank', dist.get_rank(), t.tolist(), flush=True)\n"
                      "dist.destroy_process_group()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "RANK": str(r),
                                              "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                              "RINGWEAVE_TIMEOUT_S": "20"}) for r in range(2)]
    try:
        outs = [p.communicate(timeout=80)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r, out in enumerate(outs):
        assert f"rank {r} [3.0, 3.0]" in out, out[-3000:]
