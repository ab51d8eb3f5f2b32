"""A store port already in use names the port and what set it (--master-port, MASTER_PORT,
the master_port argument), in the launcher and in a rank 0 that hosts the store itself."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

import runtime
from runtime.errors import ConnectError

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_the_launcher_names_the_port_and_its_option(busy_port, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print('never runs')\n")
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "1", "--master-port", str(busy_port),
                           str(script)], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 1, proc.stderr
    assert f"port {busy_port} (--master-port {busy_port}) is in use" in proc.stderr, proc.stderr
    assert "never runs" not in proc.stdout


async def test_rank_0_names_the_port_and_the_variable(busy_port, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(busy_port))
    monkeypatch.delenv("RINGWEAVE_STORE_HOSTED", raising=False)
    with pytest.raises(ConnectError, match=f"port {busy_port} \\(set by MASTER_PORT={busy_port}\\) is in use"):
        await runtime.init(rank=0, world_size=2, timeout_s=5)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ConnectError, match=f"set by the master_port argument={busy_port}"):
        await runtime.init(rank=0, world_size=2, master_port=busy_port, timeout_s=5)
