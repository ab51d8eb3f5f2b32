"""The types of every command line's numbers, for argparse's ``type=``: the launcher, the trainer,
``trainer.sample``, the tools and bench/ take their numbers through these, so one rule holds
everywhere and a flag agrees with the variable it sets (``--timeout-s`` and
``RINGWEAVE_TIMEOUT_S`` refuse the same texts: both use runtime/env.py's parsers)::

    p.add_argument("--timeout-s", type=args.positive_seconds)
    p.add_argument("--master-port", type=args.port)

A text that does not fit is argparse's one-line usage error, exit status 2, naming the flag, the
text and the rule, never a traceback::

    python -m trainer: error: argument --lr: 'inf' must be > 0 and finite

Every float is finite (``nan``, ``inf`` and ``1e309``, which reads as infinity, are refused);
ports are 1..65535 (0, "any free port", only where a program listens: ``port_or_any``).

Not here: rules between flags (each program's own parse_args), settings (runtime/env.py).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from runtime import env


def flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=`` from a runtime/env.py parser: its ValueError becomes argparse's
    usage error, with the text and the parser's reason."""
    def convert(raw: str) -> Any:
        try:
            return parse(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{raw!r} {exc}") from None
    convert.__name__ = getattr(parse, "__name__", "value")
    convert.__doc__ = parse.__doc__
    return convert


def _integer(ok: Callable[[int], bool], must: str) -> Callable[[str], int]:
    return flag_type(env.integer("an integer", ok, must))


def _number(unit: str, ok: Callable[[float], bool], must: str) -> Callable[[str], float]:
    return flag_type(env.number(unit, ok, must))


# integers
count = _integer(lambda v: v >= 0, "must be >= 0")  # epochs, restarts, steps, seeds
positive_int = _integer(lambda v: v >= 1, "must be >= 1")  # ranks, batch sizes, widths
port = flag_type(env.integer("a port number", lambda v: 1 <= v <= 65535, "must be a port in 1..65535"))
port_or_any = flag_type(env.integer("a port number", lambda v: 0 <= v <= 65535,
                                    "must be a port in 1..65535, or 0 for any free port"))

# seconds
positive_seconds = flag_type(env.positive_seconds)  # deadlines: the same rule as RINGWEAVE_TIMEOUT_S
seconds = _number("seconds", lambda v: v >= 0, "must be >= 0 seconds and finite")  # graces

# plain numbers
positive = _number("", lambda v: v > 0, "must be > 0 and finite")  # learning rates, norms, sizes
non_negative = _number("", lambda v: v >= 0, "must be >= 0 and finite")  # decays, floors, temperatures
fraction = _number("", lambda v: 0 <= v < 1, "must be in [0, 1)")  # dropout, momentum
open_fraction = _number("", lambda v: 0 < v < 1, "must be in (0, 1)")  # a validation share
probability = _number("", lambda v: 0 < v <= 1, "must be in (0, 1]")  # a target accuracy
# a softmax temperature: logits / t must stay finite (1e-320 made them inf, then NaN); below 1e-3 the
# draw is the arg-max in all but name, so 0 says that
temperature = _number("", lambda v: v == 0 or v >= 1e-3, "must be 0 (the arg-max) or >= 0.001, and finite")
