"""Makes ``tests.conformance`` importable for the store tests.

The suites live in ``tests/conformance`` (a package) so that every backend's
tests share them; ``tests`` itself is not a package and the repository root is
not on ``sys.path`` under a plain ``pytest`` run, so put it there. A
``tests/conftest.py`` doing this once for every suite would be the better home.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
