"""ActivationMeter: the bytes of activations a forward pass keeps for its backward.

What it is: a counter the model feeds as it stores and frees caches. `hold(cache)`
walks a cache (arrays inside tuples, lists and dicts), counts each distinct
underlying buffer once (a view is charged to the array it views, and an array
held by two caches, as a block's output that is the next block's input, once),
and returns a ticket; `release(ticket)` gives those bytes back. `live` is what is
held now, `peak` the most held at once since the last `reset_peak()`.

    meter = ActivationMeter()
    model.forward_backward(..., meter=meter)
    meter.peak      # e.g. 6_553_600 bytes at the deepest point of the step

Used from one thread (the strategy's compute thread). What it is not: not the
process's memory (parameters, gradients, temporaries inside a layer are not
counted; `resource.getrusage` measures the whole process).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ActivationMeter", "cache_arrays"]


def cache_arrays(obj, out: list | None = None) -> list[np.ndarray]:
    """Every ndarray inside `obj` (nested tuples, lists, dicts)."""
    out = [] if out is None else out
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            cache_arrays(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            cache_arrays(item, out)
    return out


def _owner(a: np.ndarray) -> np.ndarray:
    """The array that owns `a`'s memory (itself when it is not a view of another array)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class ActivationMeter:
    """See the module docstring."""

    def __init__(self) -> None:
        self.live = 0  # bytes held now
        self.peak = 0  # most bytes held at once
        self._held: dict[int, list] = {}  # id(owner) -> [holders, nbytes, owner]

    def hold(self, cache) -> list[int]:
        """Counts the buffers of `cache` (each once); returns the ticket for `release`."""
        ticket = []
        for a in cache_arrays(cache):
            owner = _owner(a)
            key = id(owner)
            if key in ticket:
                continue
            ticket.append(key)
            entry = self._held.get(key)
            if entry is None:
                self._held[key] = [1, owner.nbytes, owner]  # keeping owner alive keeps its id unique
                self.live += owner.nbytes
            else:
                entry[0] += 1
        self.peak = max(self.peak, self.live)
        return ticket

    def release(self, ticket: list[int]) -> None:
        for key in ticket:
            entry = self._held[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self._held[key]

    def reset_peak(self) -> None:
        self.peak = self.live

    def clear(self) -> None:
        """Forgets everything held (a step that failed midway never released its tickets)."""
        self._held.clear()
        self.live = 0
