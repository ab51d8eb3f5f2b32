"""tools.exitloop: a run past its limit is reported with what it wrote to stdout and stderr."""

from __future__ import annotations

import subprocess

from tools import exitloop


def test_a_timed_out_run_keeps_its_stdout_and_stderr(monkeypatch):
    def timed_out(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=b"[rank 0] step 3\n",
                                        stderr=b"[rank 1] Fatal Python error: Segmentation fault\n")

    monkeypatch.setattr(exitloop.subprocess, "run", timed_out)
    run = exitloop.run_once(7, "script.py", [], 2, 1.5)
    assert run.returncode == 124 and run.failed
    assert run.output == ("[rank 0] step 3\n[rank 1] Fatal Python error: Segmentation fault\n"
                          "\n(timed out after 1.5 s)")
    assert "Segmentation fault" in run.describe()
