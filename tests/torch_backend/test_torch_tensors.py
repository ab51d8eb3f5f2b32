"""torch tensors in the collectives (collectives/tensors.py): every dtype in place (the caller's
tensor comes back, its memory unchanged, its values those of a NumPy reference), p2p and the
blocking facade, the errors that say what to do, and torch left unimported by NumPy programs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import collectives as C  # noqa: E402 - after the skip
from collectives import Communicator  # noqa: E402
from collectives.kernels.reference import BFLOAT16  # noqa: E402

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32, "float64": np.float64,
          "int8": np.int8, "int32": np.int32, "int64": np.int64, "uint8": np.uint8}


def _values(rank: int, n: int, dtype) -> np.ndarray:
    """Small values, exact in every dtype (bfloat16 included), that differ by rank."""
    return ((np.arange(n) % 7) + 3 * rank).astype(np.float32).astype(dtype)


def _tensor(a: np.ndarray) -> "torch.Tensor":
    """A torch tensor holding ``a``'s values, in memory of its own (not NumPy's)."""
    if a.dtype == BFLOAT16:
        return torch.tensor(a.astype(np.float32), dtype=torch.bfloat16)
    return torch.tensor(a)


def _numpy(t: "torch.Tensor") -> np.ndarray:
    return t.float().numpy().astype(np.float64) if t.dtype == torch.bfloat16 else t.numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", list(DTYPES))
async def test_every_dtype_reduces_in_place(ranks, dtype):
    n = 11

    async def body(g):
        t = _tensor(_values(g.rank, n, DTYPES[dtype]))
        ptr, version = t.data_ptr(), t._version
        out = await C.all_reduce(t, op="sum")
        assert out is t and t.data_ptr() == ptr and t._version > version
        ref = sum(_values(r, n, DTYPES[dtype]).astype(np.float64) for r in range(g.size))
        np.testing.assert_array_equal(_numpy(t), ref)
        return None

    await ranks(2, body)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int64"])
async def test_gather_scatter_broadcast_and_p2p_take_tensors(ranks, dtype):
    n = 6
    np_dtype = DTYPES[dtype]

    async def body(g):
        x = _tensor(_values(g.rank, n, np_dtype))
        out = _tensor(np.zeros(g.size * n, np_dtype))
        ptr = out.data_ptr()
        assert await C.all_gather(out, x) is out and out.data_ptr() == ptr
        np.testing.assert_array_equal(_numpy(out), np.concatenate([_values(r, n, np_dtype) for r in range(g.size)]
                                                                  ).astype(np.float64))
        block = _tensor(np.zeros(n // 2, np_dtype))
        assert await C.reduce_scatter(block, x[: g.size * (n // 2)]) is block
        ref = sum(_values(r, n, np_dtype).astype(np.float64) for r in range(g.size))
        np.testing.assert_array_equal(_numpy(block), ref[g.rank * (n // 2):(g.rank + 1) * (n // 2)])
        b = x.clone()
        assert await C.broadcast(b, src=1) is b
        np.testing.assert_array_equal(_numpy(b), _values(1, n, np_dtype).astype(np.float64))
        v = _tensor(np.zeros(3, np_dtype))
        await C.all_gather_v(v, x[: 1 + g.rank], counts=[1, 2])  # counts per rank: collectives/uneven.py
        np.testing.assert_array_equal(_numpy(v), np.concatenate([_values(0, 1, np_dtype), _values(1, 2, np_dtype)]))
        if g.rank == 0:
            await C.send(x, dst=1, tag=3)
        else:
            got = _tensor(np.zeros(n, np_dtype))
            ptr = got.data_ptr()
            assert await C.recv(got, src=0, tag=3) == 0 and got.data_ptr() == ptr
            np.testing.assert_array_equal(_numpy(got), _values(0, n, np_dtype).astype(np.float64))
        return None

    await ranks(2, body, transport="tcp")


async def test_a_parameter_reads_as_it_is_and_is_written_through_detach(ranks):
    async def body(g):
        w = torch.nn.Parameter(torch.full((4,), float(g.rank + 1)))
        out = torch.zeros(8)
        await C.all_gather(out, w)  # read only: a parameter that requires grad is fine
        assert out.tolist() == [1.0] * 4 + [2.0] * 4
        d = w.detach()
        await C.all_reduce(d)  # written through its detached view: the same memory
        assert w.tolist() == [3.0] * 4 and w.requires_grad
        return None

    await ranks(2, body)


def _refused(make, match, error):
    async def body(g):
        with pytest.raises(error, match=match):
            await C.all_reduce(make())
        return None
    return body


@pytest.mark.parametrize("make, match, error", [
    (lambda: torch.zeros(4, 4).t(), r"not contiguous .*\.contiguous\(\)", ValueError),
    (lambda: torch.zeros(3, requires_grad=True), r"requires grad.*\.detach\(\)", ValueError),
    (lambda: torch.nn.Parameter(torch.zeros(3)), r"requires grad.*\.detach\(\)", ValueError),
    (lambda: torch.zeros(3, dtype=torch.bool), r"supported dtypes are .*torch\.uint8", TypeError),
    (lambda: torch.zeros(3, dtype=torch.int16), r"int16.*t\.to\(torch\.int32\)", TypeError),
    (lambda: torch.zeros(3, dtype=torch.complex64), r"view_as_real", TypeError),
    (lambda: torch.zeros(3, device="meta"), r"on meta.*\.cpu\(\)", TypeError),
    (lambda: torch.zeros(3).to_sparse(), r"to_dense\(\)", TypeError),
    (lambda: torch._neg_view(torch.zeros(3)), r"resolve_neg\(\)", ValueError),
])
async def test_a_tensor_that_cannot_be_used_in_place_is_refused_saying_what_to_do(ranks, make, match, error):
    await ranks(2, _refused(make, match, error))  # before any message: no rank waits for another


async def test_a_tensor_that_requires_grad_is_sent_but_not_received_into(ranks):
    async def body(g):
        t = torch.full((3,), 5.0 * g.rank, requires_grad=True)
        if g.rank == 1:
            await C.send(t, dst=0)  # read only
            return None
        with pytest.raises(ValueError, match=r"x \(a torch tensor.*\.detach\(\)"):
            await C.recv(t, src=1)
        assert await C.recv(t.detach(), src=1) == 1 and t.tolist() == [5.0] * 3
        return None

    await ranks(2, body)


@pytest.mark.timeout(60)
def test_the_blocking_facade_takes_tensors():
    with Communicator(rank=0, world_size=1, timeout=30) as comm:
        t = torch.arange(4, dtype=torch.bfloat16)
        assert comm.all_reduce(t, op="max") is t
        h = comm.broadcast_async(t, src=0)
        assert h.wait(30) is t and t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_numpy_programs_never_import_torch():
    code = ("import sys, asyncio, numpy as np\n"
            "import collectives as C\n"
            "from runtime.testing import run_ranks\n"
            "async def body(g):\n"
            "    x = np.ones(3); await C.all_reduce(x); return x.tolist()\n"
            "print(asyncio.run(run_ranks(2, body)), 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]] False"
