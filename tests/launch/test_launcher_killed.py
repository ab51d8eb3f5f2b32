"""A launcher killed with SIGKILL cannot stop its ranks; they stop themselves
(PR_SET_PDEATHSIG armed by runtime.init), so nothing of the job is left."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.faults.harness import alive

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, os, runtime
        async def main():
            rt = await runtime.init()
            open(os.path.join({str(tmp_path)!r}, f"pid{{rt.rank}}"), "w").write(str(os.getpid()))
            await asyncio.sleep(60)
        runtime.run(main())
    """))
    launcher = subprocess.Popen([sys.executable, "-m", "runtime.launch", "-n", "2", str(script)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)
    time.sleep(0.1)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their SIGKILLed launcher"


def test_a_ranks_children_do_not_inherit_the_launcher_pid():
    """RINGWEAVE_LAUNCHER_PID names a rank's parent. A process the rank starts (a worker, a
    nested job) that calls runtime.init must not read it: its parent is not that pid, and it
    would SIGTERM itself as if the launcher had died."""
    code = textwrap.dedent("""
        import os, subprocess, sys
        from runtime.init import die_with_launcher
        os.environ["RINGWEAVE_LAUNCHER_PID"] = str(os.getppid())  # as the launcher sets it
        assert die_with_launcher()
        assert "RINGWEAVE_LAUNCHER_PID" not in os.environ
        child = subprocess.run([sys.executable, "-c",
                                "from runtime.init import die_with_launcher; print(die_with_launcher(), 'alive')"],
                               capture_output=True, text=True, timeout=30)
        print(child.returncode, child.stdout.strip())
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0 False alive"
