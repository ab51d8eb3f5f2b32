"""``python -m runtime.launch --elastic MIN:MAX --rejoin-delay-s S``: a lost rank's slot gets its joiner S
seconds after the exit (default 0.5), said in --help and refused without --elastic."""

from __future__ import annotations

import subprocess
import sys

import pytest

from el_launch import REPO, environ
from runtime.launch_config import REJOIN_DELAY_S, build_parser, parse_args

pytestmark = pytest.mark.timeout(60)
# slot 1's first process writes the time and exits 3; its joiner writes the time it started and exits 0;
# rank 0 exits 0 once the joiner's file is there (or after 30 s: the test then fails on the missing file)
SCRIPT = """
import os, sys, time
from pathlib import Path
from runtime import env
out, rank, joiner = Path(sys.argv[1]), os.environ["RANK"], env.ELASTIC_JOIN.get()
if rank == "1":
    (out / ("joined" if joiner else "exited")).write_text(repr(time.time()))
    sys.exit(0 if joiner else 3)
deadline = time.monotonic() + 30
while not (out / "joined").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_the_option_is_documented_defaulted_and_checked():
    assert "--rejoin-delay-s" in build_parser().format_help()
    assert parse_args(["--elastic", "1:2", "-n", "2", "x.py"]).rejoin_delay_s == REJOIN_DELAY_S == 0.5
    assert parse_args(["--elastic", "1:2", "-n", "2", "--rejoin-delay-s", "10", "x.py"]).rejoin_delay_s == 10
    with pytest.raises(ValueError, match="--rejoin-delay-s 10 is for --elastic"):
        parse_args(["-n", "2", "--rejoin-delay-s", "10", "x.py"])
    with pytest.raises(SystemExit):
        parse_args(["--elastic", "1:2", "-n", "2", "--rejoin-delay-s", "-1", "x.py"])


def test_the_joiner_starts_the_delay_after_the_lost_ranks_exit(tmp_path):
    delay = 1.5
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, "-m", "runtime.launch", "--elastic", "1:2", "-n", "2", "--rejoin-delay-s",
                        str(delay), "--grace-s", "1", str(script), str(tmp_path)], cwd=REPO, env=environ(),
                       capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"starting a joiner in its place in {delay:g} s" in p.stdout + p.stderr
    waited = float((tmp_path / "joined").read_text()) - float((tmp_path / "exited").read_text())
    assert delay <= waited < delay + 10, waited  # + the joiner's interpreter start
