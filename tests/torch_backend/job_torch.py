"""torch.distributed on the "ringweave" backend at 2 ranks, run by tests/torch_backend/test_torch_backend.py as
``python -m runtime.launch -n 2 tests/torch_backend/job_torch.py``:

1. every call, each checked against its closed-form answer (rank r contributes values made from
   r); prints ``rank R: N calls agree``, or raises at the first call that does not;
2. a small model trained with DDP and with FSDP2 (``fully_shard``), on "ringweave" and on Gloo from
   the same seed, and once in one process on both ranks' data (the reference: the average of the
   ranks' mean losses is the mean loss of the whole batch); rank 0 prints one JSON line, the
   largest difference of any parameter from the reference per run.
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import ringweave_torch

# -- 1. every call ---------------------------------------------------------------------------------

dist.init_process_group("ringweave")
r, n = dist.get_rank(), dist.get_world_size()
assert n == 2 and dist.get_backend() == "ringweave"
assert isinstance(dist.group.WORLD, ringweave_torch.ProcessGroupRingweave)
checked = []


def check(name, got, want):
    got = got.tolist() if isinstance(got, torch.Tensor) else got
    assert got == want, f"rank {r}: {name}: {got} != {want}"
    checked.append(name)


for op, want in ((dist.ReduceOp.SUM, 3.0), (dist.ReduceOp.AVG, 1.5), (dist.ReduceOp.PRODUCT, 2.0),
                 (dist.ReduceOp.MIN, 1.0), (dist.ReduceOp.MAX, 2.0)):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = torch.full((3,), r + 1.0, dtype=dtype)
        dist.all_reduce(t, op=op)
        check(f"all_reduce {op} {dtype}", t, [want] * 3)
t = torch.full((2,), r + 1, dtype=torch.int64)
dist.all_reduce(t)
check("all_reduce int64", t, [3, 3])
works = [dist.all_reduce(torch.full((4,), float(i + r)), async_op=True) for i in range(3)]
check("async all_reduce", [w.wait() and w.is_completed() for w in works], [True] * 3)
check("async future", works[0].get_future().wait()[0], [1.0] * 4)

out = [torch.zeros(2) for _ in range(n)]
dist.all_gather(out, torch.tensor([r, 10.0 * r]))
check("all_gather", [o.tolist() for o in out], [[0.0, 0.0], [1.0, 10.0]])
flat = torch.zeros(2 * n, dtype=torch.bfloat16)
dist.all_gather_into_tensor(flat, torch.tensor([r, 10.0 * r], dtype=torch.bfloat16))
check("all_gather_into_tensor bf16", flat, [0.0, 0.0, 1.0, 10.0])
o = torch.zeros(2)
dist.reduce_scatter_tensor(o, torch.arange(4.0) * (r + 1))
check("reduce_scatter_tensor", o, [[0.0, 3.0], [6.0, 9.0]][r])
o = torch.zeros(2)
dist.reduce_scatter(o, [torch.arange(2.0) * (r + 1), torch.arange(2.0, 4.0) * (r + 1)], op=dist.ReduceOp.MAX)
check("reduce_scatter max", o, [[0.0, 2.0], [4.0, 6.0]][r])
b = torch.tensor([r + 5.0])
dist.broadcast(b, src=1)
check("broadcast", b, [6.0])
x = torch.tensor([float(r + 1)])
dist.reduce(x, dst=0)
check("reduce", x, [3.0] if r == 0 else [2.0])
gl = [torch.zeros(1) for _ in range(n)] if r == 0 else None
dist.gather(torch.tensor([r + 1.0]), gl, dst=0)
check("gather", gl and [g.tolist() for g in gl], [[1.0], [2.0]] if r == 0 else None)
o = torch.zeros(1)
dist.scatter(o, [torch.tensor([7.0]), torch.tensor([8.0])] if r == 0 else None, src=0)
check("scatter", o, [7.0 + r])
o = torch.zeros(2)
dist.all_to_all_single(o, torch.tensor([r * 10.0, r * 10 + 1]))
check("all_to_all_single", o, [r, 10.0 + r])
o = torch.zeros(3)  # uneven: rank 0 sends 1 row to 0 and 2 to 1; rank 1 sends 2 to 0 and 1 to 1
dist.all_to_all_single(o, torch.arange(3.0) + 10 * r, output_split_sizes=[1, 2] if r == 0 else [2, 1],
                       input_split_sizes=[1, 2] if r == 0 else [2, 1])
check("all_to_all_single splits", o, [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]][r])
outs = [torch.zeros(1 + i) for i in range(n)]
dist.all_to_all(outs, [torch.full((1 + r,), 10.0 * r + i) for i in range(n)])
check("all_to_all lists", [v.tolist() for v in outs], [[r * 1.0], [10.0 + r, 10.0 + r]])
dist.barrier()
if r == 0:
    dist.send(torch.tensor([42.0]), dst=1, tag=3)
    dist.send(torch.tensor([43.0], dtype=torch.bfloat16), dst=1)
else:
    x = torch.zeros(1)
    dist.recv(x, src=0, tag=3)
    check("send/recv", x, [42.0])
    y = torch.zeros(1, dtype=torch.bfloat16)
    check("recv from any rank", [dist.recv(y), y.tolist()], [0, [43.0]])
objs = [None] * n
dist.all_gather_object(objs, {"rank": r})
check("all_gather_object", objs, [{"rank": 0}, {"rank": 1}])

# sub-groups: torch makes each on its members only; later groups still line up on every rank
alone = [dist.new_group([1]), dist.new_group([0])]
both = dist.new_group([0, 1])
t = torch.ones(1) * (r + 1)
dist.all_reduce(t, group=alone[1 - r])
check("group of one", t, [r + 1.0])
t = torch.ones(1) * (r + 1)
dist.all_reduce(t, group=both)
check("group of both", t, [3.0])

for call, match in ((lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND), "allreduce: op BAND"),
                    (lambda: dist.monitored_barrier(), "monitored_barrier"),
                    (lambda: dist.all_reduce(torch.zeros(3, dtype=torch.bool)), "supported dtypes"),
                    (lambda: dist.all_reduce(torch.zeros(4, 4).t()), r"contiguous")):
    try:
        call()
    except (NotImplementedError, TypeError, ValueError, RuntimeError) as exc:
        assert match in str(exc), f"{match!r} not in {exc}"
        checked.append(match)
    else:
        raise AssertionError(f"no error for {match}")
dist.barrier()
dist.destroy_process_group()
print(f"rank {r}: {len(checked)} calls agree", flush=True)

# -- 2. training ----------------------------------------------------------------------------------

STEPS, BATCH = 4, 6


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


def train(m: torch.nn.Module, data: list) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()


def run(kind: str) -> list:
    m = model()
    if kind.startswith("ddp"):
        m = DistributedDataParallel(m)
        if kind == "ddp_int8":
            m.register_comm_hook(None, ringweave_torch.hooks.compressed_allreduce_hook("int8"))
        train(m, batches(dist.get_rank()))
        return [p.detach().clone() for p in m.module.parameters()]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if kind == "fsdp_bf16" \
        else MixedPrecisionPolicy()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(m, mp_policy=policy)
    train(m, batches(dist.get_rank()))
    return [p.full_tensor().detach().clone() for p in m.parameters()]


reference = model()
train(reference, [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(batches(0), batches(1))])
start = [p.detach().clone() for p in model().parameters()]
runs = {}
for backend, kinds in (("ringweave", ("ddp", "fsdp", "fsdp_bf16", "ddp_int8")), ("gloo", ("ddp", "fsdp", "fsdp_bf16"))):
    dist.init_process_group(backend)
    rank = dist.get_rank()
    for kind in kinds:
        runs[f"{backend} {kind}"] = run(kind)
    dist.destroy_process_group()


def diff(a: list, b: list) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


if rank == 0:
    out = {name: diff(params, list(reference.parameters())) for name, params in runs.items()}
    out["moved"] = diff(start, list(reference.parameters()))  # training changed the parameters
    out.update({f"{k} vs gloo": diff(runs[f"ringweave {k}"], runs[f"gloo {k}"]) for k in ("ddp", "fsdp", "fsdp_bf16")})
    print(json.dumps(out), flush=True)
