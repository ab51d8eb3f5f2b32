"""Shared test set-up: the repository root on sys.path (for tests.conformance)
and the multi-rank fixture ``ranks`` from runtime.testing."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

pytest_plugins = ["runtime.testing"]
