"""Optional packages: the module a feature needs, or an error that names the extra installing it.

What it is: `need(module, package=, extra=, what=)` imports ``module`` or raises `MissingExtra`
(an ImportError) in one line, e.g. "the digits data set needs scikit-learn, which is not
installed: pip install -e '.[trainer]' (or pip install 'ringweave[trainer]')". The extras are
pyproject.toml's: trainer (scikit-learn and SciPy: the digits data set, the exact GELU's reference
kernel), plot (matplotlib: trainer.plot). The runtime and the collectives need none of them.

What it is not: no installing, no version checks.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtra", "need"]


class MissingExtra(ImportError):
    """An optional package a feature needs is not installed; the message names the extra."""


def need(module: str, *, package: str, extra: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, or MissingExtra naming ``package`` and ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{what} needs {package}, which is not installed: pip install -e '.[{extra}]' "
                           f"(or pip install 'ringweave[{extra}]')") from None
