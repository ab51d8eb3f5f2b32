"""The data-parallel strategy classes by name, and the classes made by putting mixins in front of them.

What it is: `strategy_class("fsdp", MeshMixin, OffloadMixin)` -> (a class whose method order is
the mixins', then FSDPStrategy's; the keywords FSDPStrategy's constructor wants, e.g.
{"name": "fsdp"}). A class is made once per combination (type() with the mixins as bases), so
strategies of one kind share a class, as hand-written subclasses would.

What it is not: no strategy logic (trainer/sharding and the mixins hold it).
"""

from __future__ import annotations

from trainer.sharding.data_parallel import STRATEGIES
from trainer.sharding.ddp import DDPStrategy
from trainer.sharding.fsdp import FSDPStrategy
from trainer.sharding.zero import ZeroStrategy

__all__ = ["strategy_class"]

_BASES = {"ddp": (DDPStrategy, {}), "zero1": (ZeroStrategy, {"stage": 1}), "zero2": (ZeroStrategy, {"stage": 2}),
          "zero3": (FSDPStrategy, {"name": "zero3"}), "fsdp": (FSDPStrategy, {"name": "fsdp"})}
_MADE: dict[tuple, type] = {}


def strategy_class(name: str, *mixins: type) -> tuple[type, dict]:
    """(the strategy ``name``'s class behind ``mixins``, its constructor's keywords).

    Raises:
        ValueError: an unknown strategy name.
    """
    if name not in _BASES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    base, kwargs = _BASES[name]
    key = (base, *mixins)
    if key not in _MADE:
        prefix = "".join(m.__name__.removesuffix("Mixin") for m in mixins)
        _MADE[key] = type(f"{prefix}{base.__name__}", (*mixins, base), {}) if mixins else base
    return _MADE[key], dict(kwargs)
