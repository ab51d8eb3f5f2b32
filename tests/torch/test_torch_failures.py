"""A rank that raises or is killed in a torch training loop on the "ringweave" backend surfaces on
the other rank as an exception within a second, under DDP (through its C++ reducer: a RuntimeError
that names ringweave's error) and FSDP2 (ringweave's own error type), not as a hang
(tests/torch/job_fail.py, 2 ranks through our launcher, collective timeouts of 20 s)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from tests.torch.jobrun import launch  # noqa: E402 - after the skip


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
