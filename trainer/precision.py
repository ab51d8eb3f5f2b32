"""Mixed precision: dtype names, casting fp32 master shards, and dynamic loss scaling.

What it is:

* `resolve_dtype("bfloat16")` and friends: float64 / float32 / float16 / bfloat16 (ml_dtypes', a
  real NumPy dtype, so arrays of it can be sent, cast and summed like any other).
* `PrecisionPolicy`: which dtype the master weights, the compute copy and the gradient reduction
  use (a strategy reads it; nothing here communicates).
* `cast_to(master, dtype, out=None)`: round-to-nearest-even cast of a float32 master shard into a
  compute buffer (e.g. the one then all-gathered); overflow becomes +-inf silently, the signal
  loss scaling looks for. float16 stays float16 through the model, while ml_dtypes promotes
  bfloat16 matmuls to float32; on a CPU the gain is memory and bytes on the wire, not FLOPs.
* `unscale_(grad, scale) -> found_inf`: grad /= scale in place; whether THIS shard holds inf/NaN.
* `DynamicLossScaler` (torch.cuda.amp.GradScaler's rule): on inf/NaN skip the step and multiply
  the scale by backoff (0.5); after `growth_interval` good steps in a row by growth (2); the
  transition is the pure `next_scaler_state(state, found_inf, ...)`.

`update(found_inf)` takes `found_inf` as GIVEN: every rank must pass the same value, so the caller
first ORs its local `unscale_` results across ranks (an all_reduce, max of 0/1); otherwise ranks
would disagree on whether to step and their weights would diverge.

What it is not: no autocast, no per-op precision lists, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPES", "resolve_dtype", "dtype_name", "PrecisionPolicy", "cast_to", "has_inf_or_nan", "unscale_",
    "ScalerState", "next_scaler_state", "DynamicLossScaler",
]

DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


def resolve_dtype(dtype) -> np.dtype:
    """A dtype from a name ("bf16" and "fp16" too) or anything np.dtype accepts; floats only."""
    aliases = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    if isinstance(dtype, str):
        name = aliases.get(dtype, dtype)
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)} or {sorted(aliases)}")
        return DTYPES[name]
    dt = np.dtype(dtype)
    if dt not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dt}; expected one of {sorted(DTYPES)}")
    return dt


def dtype_name(dtype) -> str:
    """Canonical name, e.g. dtype_name(ml_dtypes.bfloat16) == "bfloat16"."""
    return resolve_dtype(dtype).name


@dataclass(frozen=True)
class PrecisionPolicy:
    master: str = "float32"  # optimizer's copy and state, e.g. "float32"
    compute: str = "float32"  # forward/backward parameters, e.g. "bfloat16"
    reduce: str = "float32"  # gradient all-reduce / reduce-scatter, e.g. "float32"

    def __post_init__(self) -> None:
        for name in (self.master, self.compute, self.reduce):
            resolve_dtype(name)

    @property
    def needs_loss_scaling(self) -> bool:
        """float16 has 5 exponent bits, so small gradients underflow without a scale."""
        return "float16" in (dtype_name(self.compute), dtype_name(self.reduce))


def cast_to(master: np.ndarray, dtype, out: np.ndarray | None = None) -> np.ndarray:
    """Cast (round to nearest even) into `out` if given, else a new array; overflow -> inf."""
    dt = resolve_dtype(dtype)
    with np.errstate(over="ignore"):  # intended: fp16 overflow must become inf, not a warning
        if out is None:
            return master.astype(dt)
        if out.shape != master.shape or out.dtype != dt:
            raise ValueError(f"out must be {dt} of shape {master.shape}, got {out.dtype} of shape {out.shape}")
        np.copyto(out, master, casting="unsafe")
    return out


def has_inf_or_nan(*arrays: np.ndarray) -> bool:
    """True if any element of any array is inf or NaN (local only; see the module docstring)."""
    return not all(bool(np.isfinite(a).all()) for a in arrays)


def unscale_(grad: np.ndarray, scale: float) -> bool:
    """grad *= 1 / scale in place; returns found_inf for this shard."""
    if scale <= 0:
        raise ValueError(f"loss scale must be > 0, got {scale}")
    with np.errstate(invalid="ignore", over="ignore"):  # inf * c stays inf; checked right below
        grad *= 1.0 / scale
    return has_inf_or_nan(grad)


@dataclass(frozen=True)
class ScalerState:
    scale: float  # current loss scale, e.g. 65536.0
    good_steps: int  # finite steps since the last growth or backoff, e.g. 17


def next_scaler_state(state: ScalerState, found_inf: bool, *, growth_factor: float = 2.0,
                      backoff_factor: float = 0.5, growth_interval: int = 2000) -> ScalerState:
    """The transition (pure):

    found_inf                          -> (scale * backoff, 0)
    not found_inf, good + 1 == interval -> (scale * growth, 0)   (scale kept if that overflows)
    not found_inf, otherwise           -> (scale, good + 1)
    """
    if found_inf:
        return ScalerState(state.scale * backoff_factor, 0)
    if state.good_steps + 1 >= growth_interval:
        grown = state.scale * growth_factor
        return ScalerState(grown if math.isfinite(grown) else state.scale, 0)
    return ScalerState(state.scale, state.good_steps + 1)


class DynamicLossScaler:
    """Holds a ScalerState; `scale` multiplies dloss, `update(found_inf)` says whether to step.

    Typical step (found_inf agreed across ranks by the caller):
        loss = model.forward_backward(..., grad_scale=scaler.scale)
        local_inf = any(unscale_(g, scaler.scale) for g in grad_shards)
        found_inf = <OR of local_inf over ranks>
        if scaler.update(found_inf):
            optimizer.step(...)
    With enabled=False the scale is 1 and update always returns True.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(
                "need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1; got "
                f"{init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.enabled = growth_interval, enabled
        self.state = ScalerState(float(init_scale) if enabled else 1.0, 0)

    @property
    def scale(self) -> float:
        return self.state.scale

    def update(self, found_inf: bool) -> bool:
        """Advance the state; returns True if the optimizer step should be applied."""
        if not self.enabled:
            return True
        self.state = next_scaler_state(self.state, bool(found_inf), growth_factor=self.growth_factor,
                                       backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)
        return not found_inf

    def state_dict(self) -> dict:
        return {"scale": self.state.scale, "good_steps": self.state.good_steps}

    def load_state_dict(self, d: dict) -> None:
        self.state = ScalerState(float(d["scale"]), int(d["good_steps"]))
