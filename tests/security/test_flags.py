"""Every number a command line or a ``RINGWEAVE_*`` variable takes is checked where it is read:
finite, in range, ports 1..65535; a bad one is argparse's one-line error and exit status 2 (a
variable: a SettingError naming it), never a traceback or a silent wrong value
(runtime/args.py, runtime/env.py; SECURITY.md, "Careless input").

Before: ``runtime.launch --timeout-s nan|inf|1e309`` started the ranks, which all died with a
traceback; ``--max-time-s nan`` exited 124 at once; ``tools.status --timeout-s nan|-1`` raised
and ``--master-port 99999`` connected to port 34463 (99999 mod 65536); ``trainer --lr inf`` and
``RINGWEAVE_TIMEOUT_S=inf`` were taken.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import env
from runtime.errors import SettingError

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
NON_FINITE = ["nan", "inf", "-inf", "1e309"]


def _clean_env(tmp_path) -> dict:
    """No job to find: no job files (XDG_RUNTIME_DIR of our own), no store in the environment."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RINGWEAVE_JOB", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")
    out = {k: v for k, v in os.environ.items() if k not in drop}
    return dict(out, PYTHONPATH=str(ROOT), XDG_RUNTIME_DIR=str(tmp_path))


def _usage_error(proc: subprocess.CompletedProcess, flag: str, value: str) -> None:
    """Exit status 2, no traceback, and one error line naming the flag and the value."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0] and repr(value) in errors[0], proc.stderr


@pytest.mark.parametrize("flag, value", [
    ("--timeout-s", "nan"), ("--timeout-s", "inf"), ("--timeout-s", "1e309"), ("--timeout-s", "0"),
    ("--max-time-s", "nan"), ("--max-time-s", "inf"), ("--grace-s", "nan"), ("--grace-s", "-1"),
    ("--master-port", "99999"), ("--nnodes", "0"), ("--max-restarts", "1.5"),
])
def test_the_launcher_refuses_a_bad_number_before_starting_a_rank(tmp_path, flag, value):
    script = tmp_path / "rank.py"
    script.write_text("print('a rank ran')\n")
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "-n", "1", f"{flag}={value}", str(script)],
                          cwd=str(ROOT), env=_clean_env(tmp_path), capture_output=True, text=True, timeout=50)
    assert "a rank ran" not in proc.stdout
    _usage_error(proc, flag, value)


@pytest.mark.parametrize("flag, value", [
    ("--timeout-s", "nan"), ("--timeout-s", "-1"), ("--timeout-s", "inf"), ("--timeout-s", "0"),
    ("--master-port", "99999"), ("--master-port", "0"), ("--master-port", "-5"), ("--master-port", "http"),
])
def test_tools_status_refuses_a_bad_number(tmp_path, flag, value):
    proc = subprocess.run([sys.executable, "-m", "tools.status", "--master-addr", "127.0.0.1", f"{flag}={value}"],
                          cwd=str(ROOT), env=_clean_env(tmp_path), capture_output=True, text=True, timeout=50)
    _usage_error(proc, flag, value)


TRAINER_BAD = [(flag, v) for flag in ("--lr", "--min-lr", "--weight-decay", "--momentum", "--clip-norm",
                                      "--bucket-cap-mb", "--dropout", "--val-fraction", "--target-accuracy")
               for v in NON_FINITE] + [
    ("--momentum", "1"), ("--momentum", "-0.1"), ("--weight-decay", "-0.01"), ("--min-lr", "-1e-5"),
    ("--target-accuracy", "1.5"), ("--target-accuracy", "0"), ("--clip-norm", "0"),
    ("--epochs", "1.5"), ("--epochs", "nan"), ("--batch-size", "inf"), ("--warmup-steps", "-1"), ("--seed", "-1"),
    ("--tp", "0"), ("--keep-last", "0"), ("--log-every", "x"),
]


@pytest.mark.parametrize("flag, value", TRAINER_BAD)
def test_the_trainer_refuses_a_bad_number(flag, value, capsys):
    from trainer.cli import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args([f"{flag}={value}"])  # "=": "-inf" would read as an option
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0] and repr(value) in errors[0], errors


def test_the_trainer_takes_the_numbers_it_should():
    from trainer.cli import parse_args

    a = parse_args(["--lr", "1e-3", "--min-lr", "0", "--weight-decay", "0", "--momentum", "0", "--dropout", "0.1",
                    "--val-fraction", "0.25", "--target-accuracy", "1", "--clip-norm", "1.0", "--epochs", "0"])
    assert (a.lr, a.min_lr, a.weight_decay, a.momentum, a.dropout, a.val_fraction, a.target_accuracy,
            a.clip_norm, a.epochs) == (1e-3, 0.0, 0.0, 0.0, 0.1, 0.25, 1.0, 1.0, 0)


@pytest.mark.parametrize("flag, value", [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"), ("--temperature", "1e-320"),
    ("--top-k", "0"), ("--top-k", "2.5"), ("--tokens", "-1"), ("--tokens", "1e3"), ("--seed", "-1"),
])
def test_trainer_sample_refuses_a_bad_number_before_reading_a_checkpoint(tmp_path, flag, value, capsys):
    from trainer.sample import main

    with pytest.raises(SystemExit) as info:
        main(["--checkpoint", str(tmp_path / "none"), f"{flag}={value}"])
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0] and repr(value) in errors[0], errors


def _numeric_settings() -> list[env.Setting]:
    """Every declared setting whose parser gives a number (a float or an int)."""
    out = []
    for s in env.SETTINGS.values():
        if isinstance(s, env.Setting):
            try:
                value = s.parse("4")
            except ValueError:
                continue
            if type(value) in (int, float):
                out.append(s)
    return out


def test_the_numeric_settings_are_the_ones_we_know():
    names = {s.name for s in _numeric_settings()}
    assert {"RINGWEAVE_TIMEOUT_S", "RINGWEAVE_MISMATCH_CHECK_S", "RINGWEAVE_PREEMPT_CHECK_S",
            "RINGWEAVE_INLINE_WAIT_US", "RINGWEAVE_PINNED_POOL_MIB"} <= names, names


@pytest.mark.parametrize("setting", _numeric_settings(), ids=lambda s: s.name)
@pytest.mark.parametrize("raw", NON_FINITE)
def test_a_numeric_setting_refuses_nan_and_infinity(setting, raw):
    """RINGWEAVE_TIMEOUT_S=inf was a deadline that never came; RINGWEAVE_PINNED_POOL_MIB=inf an
    OverflowError far from the variable."""
    with pytest.raises(SettingError, match=f"{setting.name}={raw!r}"):
        setting.get({setting.name: raw})


def _bare_number_flags(path: Path) -> list[str]:
    """``add_argument(..., type=int|float)`` calls in a file: a number no rule checks."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for kw in node.keywords:
                if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_command_line_number_goes_through_runtime_args():
    """The shipped command lines (runtime/, trainer/, tools/, collectives/) take no bare
    ``type=int`` or ``type=float``: each number has a rule of runtime/args.py."""
    found = [hit for package in ("runtime", "trainer", "tools", "collectives")
             for path in sorted((ROOT / package).rglob("*.py")) for hit in _bare_number_flags(path)]
    assert not found, f"flags without a rule (use runtime/args.py): {found}"


@pytest.mark.parametrize("raw", ["99999", "65536", "-1"])
def test_master_port_from_the_environment_must_be_a_port(raw):
    """MASTER_PORT=99999 was taken, and a socket then used 99999 mod 65536 = 34463."""
    from runtime import RingweaveError, read_env

    with pytest.raises(RingweaveError, match=f"MASTER_PORT={int(raw)} is not a port"):
        read_env({"MASTER_PORT": raw, "RANK": "0", "WORLD_SIZE": "2"})
    assert read_env({"MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"})["master_port"] == 29500
