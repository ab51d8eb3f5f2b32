"""Element-wise reduction kernels with one dispatch function, :func:`reduce_into`.

Three implementations of one contract (``reference.py`` states it):

* ``reference`` -- plain NumPy, the definition.
* ``cpu`` -- Numba ``@njit(nogil=True)``, bit-identical to the reference.
* ``cuda`` -- numba.cuda, for device arrays (imported only when one shows up,
  so that ``NUMBA_ENABLE_CUDASIM`` can still be set by then); bfloat16 device
  arrays are ``cuda.Bits16`` (uint16 words with the logical dtype beside).

Choosing a backend, first match wins:

1. ``backend=`` argument: ``"numpy"``, ``"numba"`` or ``"cuda"``;
2. device arrays (``__cuda_array_interface__`` or simulator arrays) -> ``cuda``;
3. environment ``RINGWEAVE_KERNELS=numpy|numba``;
4. ``numba`` for C-contiguous host arrays, ``numpy`` otherwise.

Nothing here communicates; the collectives call these between receives.
"""

from __future__ import annotations

import numpy as np

from runtime import env

from . import reference
from .reference import DTYPES, OPS

BACKENDS = ("numpy", "numba", "cuda")
ENV_VAR = env.KERNELS.name

__all__ = ["BACKENDS", "DTYPES", "OPS", "choose_backend", "divide_into", "is_device_array", "reduce_into", "scale_into"]
# Imported only from inside collectives/ (tests/tree/test_surfaces.py): the backends, reached
# through reduce_into and choose_backend; jitcache is public (trainer's kernels use it).
_INTERNAL = ("cpu", "cuda", "halfbits", "reference")


def is_device_array(a) -> bool:
    """True for numba device arrays (real or simulated), ``__cuda_array_interface__`` objects
    and ``cuda.Bits16`` (16-bit words with their logical dtype)."""
    return type(a).__name__ in ("FakeCUDAArray", "Bits16") or hasattr(a, "__cuda_array_interface__")


def choose_backend(*arrays, backend: str | None = None) -> str:
    """The backend :func:`reduce_into` would use for ``arrays`` (see module docstring).

    Raises:
        ValueError: an unknown backend name, here or in ``RINGWEAVE_KERNELS``.
        TypeError: host arrays with ``backend="cuda"``, or device arrays with a host backend.
    """
    on_device = [is_device_array(a) for a in arrays]
    if any(on_device) and not all(on_device):
        kinds = ", ".join(f"{type(a).__name__} ({'device' if d else 'host'})" for a, d in zip(arrays, on_device))
        raise TypeError(f"mixing device and host arrays: {kinds}; copy explicitly first")
    if backend is None and not any(on_device):
        backend = env.KERNELS.get()  # SettingError (a ValueError) unless numpy or numba
    if backend is None:
        if any(on_device):
            return "cuda"
        contiguous = all(a.flags.c_contiguous for a in arrays)
        return "numba" if contiguous else "numpy"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if (backend == "cuda") != any(on_device):
        where = "device" if any(on_device) else "host"
        raise TypeError(f"backend {backend!r} cannot take {where} arrays")
    return backend


def _module(name: str):
    if name == "numpy":
        return reference
    if name == "numba":
        from . import cpu  # lazy: numba, compiled or loaded from its cache at first use

        return cpu
    from . import cuda  # lazy: numba.cuda, for device arrays only

    return cuda


def reduce_into(dst, src, op: str, *, backend: str | None = None):
    """``dst = dst <op> src`` element-wise, in place; returns ``dst``.

    Args:
        dst, src: same shape and dtype; NumPy arrays or device arrays.
        op: ``"sum" | "prod" | "min" | "max"`` (avg: sum, then :func:`divide_into`).
        backend: ``None`` (choose), ``"numpy"``, ``"numba"`` or ``"cuda"``.

    Raises:
        ValueError / TypeError: see ``reference.check_operands`` and :func:`choose_backend`.

    Example (two ranks' buffers, as the ring's reduce step sees them)::

        >>> a = np.array([1.0, 2.0], np.float32); b = np.array([10.0, 20.0], np.float32)
        >>> reduce_into(a, b, "sum")
        array([11., 22.], dtype=float32)
    """
    return _module(choose_backend(dst, src, backend=backend)).reduce_into(dst, src, op)


def divide_into(dst: np.ndarray, n: int, *, backend: str | None = None) -> np.ndarray:
    """``dst /= n`` (floor for integers), host arrays only; see ``reference.divide_into``."""
    return _module(choose_backend(dst, backend=backend)).divide_into(dst, n)


def scale_into(dst: np.ndarray, factor, *, backend: str | None = None) -> np.ndarray:
    """``dst *= factor``, host arrays only; see ``reference.scale_into``."""
    return _module(choose_backend(dst, backend=backend)).scale_into(dst, factor)
