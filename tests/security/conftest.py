"""Fixtures of the tests where another local user (uid nobody) works beside the job."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shared_dir():
    """A directory like /tmp: mode 1777, everyone may create in it; removed after the test."""
    base = tempfile.mkdtemp(prefix="rw-shared-", dir="/tmp")
    os.chmod(base, 0o1777)
    yield Path(base)
    subprocess.run(["rm", "-rf", base], check=False)
