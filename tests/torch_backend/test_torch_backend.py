"""The "ringweave" torch.distributed backend. In one run of tests/torch_backend/job_torch.py at 2 ranks
through our launcher: every call through torch.distributed against its closed-form answer
(reductions in each op and dtype, gathers, scatters, all-to-all even and uneven, p2p from a rank
and from any, object calls, sub-groups made on their members only, the errors of what is not
supported), and DDP and FSDP2 training to the parameters Gloo gives from the same seed and to
those of one process on the whole batch (the compressed DDP hook, int8: near them, not on them).
In process: the torch store over the job's store, call for call against torch's HashStore; the
rendezvous it answers; the DDP hook's errors."""

from __future__ import annotations

import datetime
import json
import re

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402 - after the skip

import ringweave_torch  # noqa: E402
from collectives import Communicator  # noqa: E402
from ringweave_torch.job import JobStore, torch_rendezvous  # noqa: E402
from tests.torch_backend.jobrun import launch  # noqa: E402


@pytest.fixture(scope="module")
def job_run():
    """The output of one run of tests/torch_backend/job_torch.py (both ranks exited 0)."""
    proc = launch("job_torch.py", timeout_s=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(120)
def test_every_call_through_torch_distributed(job_run):
    counts = {int(r): int(n) for r, n in re.findall(r"\[rank (\d)\] rank \d: (\d+) calls agree", job_run)}
    assert counts.keys() == {0, 1} and min(counts.values()) >= 35, job_run[-3000:]


@pytest.mark.timeout(120)
def test_ddp_and_fsdp2_train_as_gloo_does(job_run):
    diffs = json.loads(next(x for x in job_run.splitlines() if x.startswith("[rank 0] {")).removeprefix("[rank 0] "))
    assert diffs["moved"] > 0.05  # training changed the parameters: the comparisons below can fail
    for kind in ("ddp", "fsdp"):
        assert diffs[f"{kind} vs gloo"] <= 1e-6 and diffs[f"ringweave {kind}"] <= 1e-5, diffs
    assert diffs["fsdp_bf16 vs gloo"] <= 1e-6 and diffs["ringweave fsdp_bf16"] < 0.05, diffs  # bfloat16 gathers
    assert 1e-6 < diffs["ringweave ddp_int8"] < 0.02, diffs  # the hook ran (int8 is lossy) and stayed close


def _store_calls(store) -> list:
    """What a sequence of torch store calls returns (exceptions by type name)."""
    out = []
    for call in (lambda: store.set("a", "1"), lambda: store.get("a"), lambda: store.add("n", 3),
                 lambda: store.add("n", 2), lambda: store.get("n"), lambda: store.compare_set("c", "", "x"),
                 lambda: store.compare_set("c", "x", "y"), lambda: store.compare_set("c", "q", "z"),
                 lambda: store.get("c"), lambda: store.check(["a", "n"]), lambda: store.check(["a", "zz"]),
                 lambda: store.delete_key("a"), lambda: store.delete_key("a"), lambda: store.check(["a"]),
                 lambda: store.wait(["n", "c"]), lambda: store.multi_get(["n", "c"])):
        out.append(call())
    return out


@pytest.mark.timeout(60)
def test_the_job_store_answers_as_torch_stores_do():
    with Communicator(rank=0, world_size=1, timeout=30) as comm:
        store = JobStore(comm, datetime.timedelta(seconds=5))
        before = store.num_keys()
        assert _store_calls(store) == _store_calls(dist.HashStore())
        assert store.num_keys() - before == 2  # n and c
        prefixed = dist.PrefixStore("default_pg", store)  # as init_process_group wraps it
        prefixed.set("k", b"v")
        assert prefixed.get("k") == b"v" and store.get("default_pg/k") == b"v"
        store.set_timeout(datetime.timedelta(seconds=0.2))
        with pytest.raises(Exception, match="missing"):  # every wait is bounded
            store.wait(["never"])
        assert isinstance(store.clone(), JobStore)


def test_the_rendezvous_is_the_jobs_under_our_launcher_only(monkeypatch):
    handlers = torch_rendezvous._rendezvous_handlers
    assert "ringweave" in handlers and getattr(handlers["env"], "ringweave", False)
    monkeypatch.delenv("RINGWEAVE_STORE_HOSTED", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="env:// rendezvous: environment variable"):  # torch's own, as before
        next(handlers["env"]("env://", rank=0, world_size=1))


def test_the_hook_refuses_an_unknown_codec_and_another_backend():
    with pytest.raises(ValueError, match="unknown codec"):
        ringweave_torch.hooks.compressed_allreduce_hook("zip")
    hook = ringweave_torch.hooks.compressed_allreduce_hook("int8", block=64)
    with pytest.raises(TypeError, match="runs on the ringweave backend"):
        hook(dist.ProcessGroup(0, 1), None)
