"""A configuration error under the launcher is one message, written once, with no traceback.

``--tp 3`` at ``-n 2`` (the trainer's rank 0 says why, the launcher ends the job): at most 3
lines; a misspelled flag (argparse's usage and error on every rank, folded by the launcher to
one error line): at most 5. The launcher's first line names the job.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "2", "-m", "trainer", *args],
                          cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=50)


def lines_of(r: subprocess.CompletedProcess) -> list[str]:
    return (r.stdout + r.stderr).splitlines()


def check_job_line(lines: list[str]) -> str:
    m = re.fullmatch(r"\[launch\] job (job-[0-9a-f]+): 2 ranks \(python -m tools.status --job \1 shows what each "
                     r"is doing\)", lines[0])
    assert m, lines
    return m.group(1)


@pytest.mark.timeout(60)
def test_a_mesh_that_does_not_fit_the_world_is_three_lines():
    r = launch("--model", "gpt", "--tp", "3")
    lines = lines_of(r)
    assert r.returncode == 2, lines
    assert len(lines) <= 3, lines
    job = check_job_line(lines)
    assert [line for line in lines if "error:" in line] == [
        "[rank 0] trainer: error: the world of 2 ranks does not divide into tp=3 x pp=1 (tp * pp = 3); "
        "choose sizes whose product divides 2"], lines
    assert lines[-1] == f"[launch] job {job} stopped by the usage error above; exiting with 2"
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(60)
def test_a_misspelled_flag_is_one_error_line_not_a_usage_per_rank():
    r = launch("--modle", "gpt")
    lines = lines_of(r)
    assert r.returncode == 2, lines
    assert len(lines) <= 5, lines
    check_job_line(lines)
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and re.fullmatch(r"\[rank [01]\] python -m trainer: error: unrecognized arguments: "
                                             r"--modle gpt \(usage: python -m trainer --help\)", errors[0]), lines
    assert "usage error above" in lines[-1], lines


def test_help_describes_both_models():
    from trainer.cli import build_parser
    description = build_parser().description
    assert "MLP" in description and "GPT" in description, description
