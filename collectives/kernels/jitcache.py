"""Where Numba keeps the compiled kernels of this package: the user's cache directory, not the
package's source tree.

Numba caches a ``cache=True`` function next to its source (``__pycache__``) when that is
writable: into the installed package itself, for every user of one installation, and into a
tree that may be read-only or shared. Importing this module (first thing in each module that
defines cached kernels) puts a locator in front of Numba's: for files of the ``collectives``
package, and of the packages a caller adds with ``serve(folder)`` (the trainer's kernels), the
cache goes to ``$XDG_CACHE_HOME/ringweave/numba`` (default ``~/.cache/ringweave/numba``), one
folder per source folder. ``NUMBA_CACHE_DIR``, when set, is
the user's choice and wins (Numba's own locator then serves every function); functions of
other packages are left to Numba's rules.

Not here: the kernels (cpu.py, halfbits.py, collectives/slots/memops.py, collectives/compress/cpu.py).
"""

from __future__ import annotations

import os

from numba.core import caching, config

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../collectives
_PACKAGES = [_PACKAGE]  # the folders whose kernels cache under cache_root(); serve() adds more


def serve(package_dir: str) -> None:
    """Also keep the cached kernels of the package in ``package_dir`` under :func:`cache_root`."""
    path = os.path.abspath(package_dir)
    if path not in _PACKAGES:
        _PACKAGES.append(path)


def cache_root() -> str:
    """``$XDG_CACHE_HOME/ringweave/numba``, default ``~/.cache/ringweave/numba``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ringweave", "numba")


class PackageCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """Numba's cache locator for this package's kernels (see the module docstring)."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(cache_root(), self.get_suitable_cache_subpath(py_file))

    def get_cache_path(self):
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        if config.CACHE_DIR or not any(os.path.abspath(py_file).startswith(p + os.sep) for p in _PACKAGES):
            return None  # NUMBA_CACHE_DIR set, or not ours: Numba's own locators decide
        return super().from_function(py_func, py_file)  # None when the folder cannot be written


def install() -> None:
    """Puts :class:`PackageCacheLocator` first in Numba's list (once)."""
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    if PackageCacheLocator not in impl._locator_classes:
        impl._locator_classes.insert(0, PackageCacheLocator)


install()
