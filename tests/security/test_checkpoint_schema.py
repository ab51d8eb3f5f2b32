"""trainer/ckptschema.py, the one table every checkpoint reader checks metadata.json against: what
``save`` writes passes; each kind of violation is one CheckpointError naming the field; the
optional "run" entry follows its contract ({"id": 32 lowercase hex digits, "config": {identifier:
a JSON scalar or a list of at most 4096 of them}}); unknown keys are refused at every level but
inside "extra" (the caller's JSON, bounded)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

from tests.security.ckptutil import save_steps
from trainer import ckptschema
from trainer.ckptschema import CheckpointError, validate


@pytest.fixture(scope="module")
def meta(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("schema") / "ckpt"
    [path] = asyncio.run(save_steps(root, 1))
    return json.loads((Path(path) / ckptschema.METADATA).read_text())


RUN = {"id": "0123456789abcdef0123456789abcdef",
       "config": {"model": "gpt", "n_layer": 2, "lr": 3e-4, "bias": True, "seed": None, "mesh": [2, 1, 2],
                  "names": ["a", "b"], "big": 2**40, "neg": -1.5}}


def with_(meta: dict, path: str, value) -> dict:
    """A copy of meta with ``meta[k1][k2]...`` set (keys split on '/', digits index lists)."""
    out = copy.deepcopy(meta)
    *keys, last = path.split("/")
    node = out
    for k in keys:
        node = node[int(k)] if k.isdigit() else node[k]
    node[int(last) if last.isdigit() else last] = value
    return out


def test_what_save_writes_passes_and_so_does_a_run_entry(meta):
    assert validate(meta) is meta
    validate(with_(meta, "run", RUN))
    validate(with_(meta, "extra/loss", float("nan")))  # a diverged run's numbers are data
    validate(with_(meta, "model", None))
    old = {k: v for k, v in meta.items() if k not in ("run", "mesh", "model", "created_unix_s", "extra")}
    validate(old)  # what older versions wrote


VIOLATIONS = [  # (path, value, what the message says)
    ("format", "other", "metadata.format: expected 'ringweave-checkpoint'"),
    ("version", 2, "metadata.version: expected 1"),
    ("step", True, "metadata.step: expected an integer"),
    ("step", 2**60, "metadata.step: expected an integer in [0, 9007199254740992]"),
    ("world_size", 0, "metadata.world_size: expected an integer in [1,"),
    ("strategy", "zero3; rm -rf /", "metadata.strategy: expected a string matching"),
    ("master_dtype", "object", "metadata.master_dtype: expected one of"),
    ("scaler/scale", 0, "metadata.scaler.scale: expected a number in (0"),
    ("units/0/index", 1, "units[0].index: expected 0, got 1"),
    ("units/0/params/0/shape", [10**6, 10**6], "ends past the unit's"),
    ("units/0/params/0/name", "../w", "params[0].name: expected a string matching"),
    ("arrays/unit0.param/dtype", "|O", "dtype: expected one of"),
    ("arrays/unit0.param/pieces/0/file", "/abs/unit0.param.npy", "is not rank<NNNNN>/<array>.npy"),
    ("arrays/unit0.param/pieces/0/file", "rank00000/unit1.param.npy", "is not rank<NNNNN>/unit0.param.npy"),
    ("arrays/unit0.param/pieces/0/file", "rank00009/unit0.param.npy", "of a rank below the world size 2"),
    ("arrays/unit0.param/pieces/0/file", "rank0000000/unit0.param.npy", "is not rank<NNNNN>/unit0.param.npy"),
    ("arrays/unit0.param/numel", 5, "numel: 5 differs from unit 0's"),
    ("arrays/unit9.param", {"numel": 0, "dtype": "float32", "pieces": []}, "names unit 9, but there are 2 units"),
    ("arrays/unit0.param/pieces/1/stop", 10**9, "pieces: cover [0, 1000000000), not the"),
    ("arrays/unit0.param/pieces/1/start", 5, "pieces[1]: [5, 42) does not continue the pieces before it"),
    ("extra/deep", json.loads("[" * 20 + "]" * 20), "nested deeper than 16"),
    ("extra/text", "x" * 5000, "a string of at most 4096 characters"),
    ("extra/loop", {"epoch": "1"}, "metadata.extra.loop.epoch: expected an integer"),
    ("mesh", {"tp": 0}, "metadata.mesh['tp']: expected an integer in [1,"),
    ("evil", 1, "metadata: unknown key 'evil'"),
    ("units/0/evil", 1, "metadata.units[0]: unknown key 'evil'"),
]

RUN_VIOLATIONS = [  # the "run" contract
    ("run/id", "0123456789ABCDEF0123456789ABCDEF", "metadata.run.id: expected a string matching"),
    ("run/id", "0123456789abcdef", "metadata.run.id"),
    ("run/config/bad-key", 1, "metadata.run.config: key 'bad-key' does not match"),
    ("run/config/1x", 1, "key '1x' does not match"),
    ("run/config/s", "x" * 257, "run.config['s']: expected a scalar or a list of <= 4096 scalars"),
    ("run/config/l", list(range(4097)), "run.config['l']: expected a scalar or a list"),
    ("run/config/d", {"a": 1}, "run.config['d']: expected a scalar or a list"),
    ("run/config/n", [1, [2]], "run.config['n']: expected a scalar or a list"),
    ("run/config/f", float("inf"), "run.config['f']"),
    ("run/extra", 1, "metadata.run: unknown key 'extra'"),
    ("run", {"id": RUN["id"]}, "metadata.run: the key 'config' is missing"),
]


@pytest.mark.parametrize("path, value, says", VIOLATIONS + RUN_VIOLATIONS)
def test_each_violation_is_one_line_naming_the_field(meta, path, value, says):
    bad = with_(with_(meta, "run", RUN), path, value) if path.startswith("run/") else with_(meta, path, value)
    with pytest.raises(CheckpointError) as info:
        validate(bad)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_key_that_is_missing_is_named(meta):
    for key in ("format", "step", "units", "arrays", "scaler"):
        with pytest.raises(CheckpointError, match=f"the key '{key}' is missing"):
            validate({k: v for k, v in meta.items() if k != key})
    with pytest.raises(CheckpointError, match="metadata: expected a map, got \\[\\]"):
        validate([])
