"""``bits_equal``: the bit-exact comparison the codec tests use (Numba / CUDA against the NumPy reference).

Not a test module (no ``test_`` prefix); imported as ``tests.compress.bits`` (tests/conftest.py puts the
repository root on sys.path, also for the CUDA simulator's subprocess run).
"""

import numpy as np


def bits_equal(a, b) -> bool:
    """Same dtype, same shape, same bits; NaNs count as equal whatever their payload."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = a.view(f"u{a.itemsize}") == b.view(f"u{b.itemsize}")
    if a.dtype.kind in "fV":
        raw |= np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return bool(raw.all())
