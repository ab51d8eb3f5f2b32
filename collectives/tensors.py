"""torch tensors where the collectives take arrays: in place, through NumPy views of their memory.

    t = torch.ones(4, dtype=torch.bfloat16)
    await C.all_reduce(t)            # t holds the sum; the call returns t itself
    await C.recv(t, src=0)           # p2p too; and every call of the blocking Communicator

A CPU tensor is handed to the call as ``t.detach().numpy()``, an array over the same memory
(bfloat16: its int16 words viewed as ``ml_dtypes.bfloat16``), so the result lands in the caller's
tensor, nothing is copied, and the call returns the tensor it was given. A tensor the call writes
gets its autograd version bumped, as torch's own in-place ops do. A CUDA tensor stays a device
array (collectives/device.py; bfloat16 wrapped as ``kernels.cuda.as_bfloat16`` says). What cannot
be used in place is refused before any message, saying what to do: not contiguous
(``.contiguous()``), requires grad where the call writes (``.detach()``), another device
(``.cpu()``), sparse, or a dtype without a reduction kernel.

torch stays optional: it is imported only when an argument's type comes from a ``torch`` module.

Not here: the checks every array gets after this (ops.py), the torch.distributed backend
(ringweave_torch/).
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

from collectives.kernels.reference import BFLOAT16

__all__ = ["as_array", "is_torch", "takes_tensors"]

_HINTS = {  # torch dtype name -> what to do instead
    "bool": "view it as torch.uint8 (t.view(torch.uint8)): max is a logical or, min a logical and",
    "int16": "convert it (t.to(torch.int32)) and copy the result back",
    "uint16": "convert it (t.to(torch.int32)) and copy the result back",
    "uint32": "convert it (t.to(torch.int64)) and copy the result back",
    "uint64": "convert it (t.to(torch.int64)) and copy the result back",
    "complex64": "pass torch.view_as_real(t) (the same memory as float32 pairs; sum and avg are exact there)",
    "complex128": "pass torch.view_as_real(t) (the same memory as float64 pairs; sum and avg are exact there)",
}
_SUPPORTED = ("float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8")


def is_torch(x) -> bool:
    """True when ``x``'s type comes from a torch module (no import of torch)."""
    return type(x).__module__.partition(".")[0] == "torch"


def as_array(name: str, t, *, writes: bool):
    """The array a collective works on for tensor ``t``: a NumPy view of a CPU tensor's memory,
    or the CUDA tensor itself (bfloat16: its words as ``kernels.cuda.Bits16``). Anything that is
    not a torch tensor is returned as it is, for the usual checks (ops.check_array) to judge.

    Args:
        name: the argument's name, for the errors.
        writes: the call writes its result into ``t`` (then ``t`` may not require grad).

    Raises:
        TypeError: a device other than CPU or CUDA, a sparse or quantized tensor, a tensor
            subclass (DTensor ...), or a dtype without a reduction kernel; each says what to pass.
        ValueError: not contiguous, or requires grad while the call writes into it; the same.
    """
    import torch  # lazy: torch is optional, and already loaded when one of its tensors is here
    if not isinstance(t, torch.Tensor):
        return t
    kind = f"{name} (a torch tensor, {str(t.dtype).removeprefix('torch.')} on {t.device})"
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        local = ".to_local() (this rank's shard)" if hasattr(t, "to_local") else "a plain torch.Tensor"
        raise TypeError(f"{kind} is a {type(t).__name__}; pass {local}")
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{kind} has layout {t.layout}; pass a dense tensor ({name}.to_dense()) and copy the result "
                        f"back")
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{kind}: ringweave reduces CPU tensors in place (CUDA ones through its device path); "
                        f"pass {name}.cpu() and copy the result back ({name}.copy_(result))")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _SUPPORTED:
        hint = _HINTS.get(dtype, "convert it to one of those and copy the result back")
        raise TypeError(f"{kind}: supported dtypes are {', '.join(_SUPPORTED)}; {hint}")
    if writes and t.requires_grad:
        raise ValueError(f"{kind} requires grad, and the call writes its result into it; pass {name}.detach() "
                         f"(the same memory: {name} sees the result) or a tensor made under torch.no_grad()")
    if not t.is_contiguous():
        raise ValueError(f"{kind} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); pass "
                         f"{name}.contiguous() and copy the result back ({name}.copy_(result))")
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{kind} is a lazy negated or conjugated view; pass {name}.resolve_neg() "
                         f"(or .resolve_conj()) and copy the result back")
    plain = t.detach()  # the same memory, without autograd (a leaf's detach is how torch itself writes one)
    if writes:
        torch.autograd.graph.increment_version(t)  # autograd sees the write, as with torch's in-place ops
    if t.device.type == "cuda":
        if dtype != "bfloat16":
            return plain
        from collectives.kernels import cuda as kcuda  # lazy: numba.cuda, for device tensors only
        return kcuda.as_bfloat16(plain.view(torch.int16))
    if dtype == "bfloat16":  # NumPy has no bfloat16: the same bytes as int16, viewed as ml_dtypes' type
        return plain.view(torch.int16).numpy().view(BFLOAT16)
    return plain.numpy()


def takes_tensors(*, writes: tuple[str, ...] = (), reads: tuple[str, ...] = ()):
    """Makes an async collective take torch tensors for the arrays named in ``writes`` (the
    call writes its result there) and ``reads``: each is replaced by :func:`as_array`'s view,
    and a result that is one of those views is returned as the tensor the caller passed.
    NumPy arrays go straight through: the wrapper returns the collective's own coroutine."""
    def wrap(fn):
        params = list(inspect.signature(fn).parameters)
        slots = [(params.index(n), n, n in writes) for n in (*writes, *reads)]

        if len(slots) == 1:  # the in-place calls (all_reduce, broadcast, ...): one argument to look at
            (i, n, _), = slots

            @functools.wraps(fn)
            def call(*args, **kw):  # a plain function: an array's call costs no second coroutine
                a = args[i] if i < len(args) else kw.get(n)
                if type(a) is not np.ndarray and is_torch(a):
                    return with_tensors(args, kw)
                return fn(*args, **kw)
        else:
            @functools.wraps(fn)
            def call(*args, **kw):
                for i, n, _ in slots:
                    a = args[i] if i < len(args) else kw.get(n)
                    if type(a) is not np.ndarray and is_torch(a):
                        return with_tensors(args, kw)
                return fn(*args, **kw)

        async def with_tensors(args, kw):
            args, given = list(args), {}
            for i, n, written in slots:
                where, key = (args, i) if i < len(args) else (kw, n)
                if where is kw and n not in kw:
                    continue
                a = where[key]
                if is_torch(a):
                    where[key] = as_array(n, a, writes=written)
                    given[id(where[key])] = a
            result = await fn(*args, **kw)
            return given.get(id(result), result)
        return call
    return wrap
