"""The loader parses a checkpoint as untrusted input: metadata.json against trainer/ckptschema.py,
pieces confined to their step directory, each piece's file checked (a regular file, its .npy
header, its size) before anything is allocated. Any violation is a CheckpointError, so
``load_newest_valid`` (what --resume calls) falls back to the newest valid checkpoint and says
why in one line, and ``python -m trainer.sample`` ends with one line and exit code 1
(SECURITY.md, "Checkpoints").

Before (main at 89488d7): a metadata.json that still parsed but was damaged crashed --resume
with KeyError / TypeError; absolute and ``../`` piece paths were followed; a FIFO piece hung the
loader; a huge numel asked for a 3.64 TiB allocation; trainer.sample printed tracebacks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from runtime.testing import run_ranks
from tests.security.ckptutil import copy_root, edit_meta, load_newest, params_of, save_steps
from trainer import checkpoint, sample
from trainer.nn import GPT
from trainer.nn.gpt import GPTConfig
from trainer.sharding import TrainConfig, make_strategy

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Two checkpoints (steps 1 and 2, zero3 at 2 ranks), saved once; tests attack copies."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    asyncio.run(save_steps(root, 2))
    return root


def _rename(meta, old, new):
    meta[new] = meta.pop(old)
    return meta


def _set(path: str, value):
    """An edit that sets ``meta[k1][k2]...`` (keys split on '/'; digits index lists)."""
    def edit(meta):
        *keys, last = path.split("/")
        node = meta
        for k in keys:
            node = node[int(k)] if k.isdigit() else node[k]
        node[int(last) if last.isdigit() else last] = value
        return meta
    return edit


DAMAGE = {  # damage that still parses as JSON
    "arrays renamed arraqs": (lambda m: _rename(m, "arrays", "arraqs"), "the key 'arrays' is missing"),
    "a string for step": (_set("step", "2"), "metadata.step: expected an integer"),
    "pieces null": (_set("arrays/unit0.param/pieces", None), "pieces: expected a list"),
    "units missing": (lambda m: {k: v for k, v in m.items() if k != "units"}, "the key 'units' is missing"),
    "a float numel": (_set("arrays/unit1.exp_avg/numel", 8.5), "numel: expected an integer"),
    "a negative start": (_set("arrays/unit0.param/pieces/0/start", -4), "start: expected an integer in [0"),
    "crc32 as a list": (_set("arrays/unit0.param/pieces/1/crc32", [1]), "crc32: expected an integer"),
    "an unknown key": (_set("path", "/etc"), "unknown key 'path'"),
    "the scaler's scale NaN": (_set("scaler/scale", float("nan")), "scale: expected a finite number"),
    "a piece gap": (_set("arrays/unit0.param/pieces/1/start", 1), "does not continue the pieces before it"),
    "a run id not hex": (_set("run", {"id": "x" * 32, "config": {}}), "run.id: expected a string matching"),
}


@pytest.mark.parametrize("what", list(DAMAGE))
async def test_damaged_metadata_falls_back_to_the_checkpoint_before(pristine, tmp_path, caplog, what):
    edit, why = DAMAGE[what]
    caplog.set_level(logging.WARNING, "ringweave.checkpoint")
    paths = copy_root(pristine, tmp_path)
    root = paths[0].parent
    edit_meta(paths[1], edit)
    meta, params = await load_newest(root)
    assert meta["step"] == 1
    for got, want in zip(params, params_of(paths[0])):
        np.testing.assert_array_equal(got, want)
    [line] = [r.getMessage() for r in caplog.records if "step-00000002 cannot be loaded" in r.getMessage()]
    assert why in line and "\n" not in line, line
    with pytest.raises(checkpoint.CheckpointError, match=f"metadata.json: .*{why[:20]}"):
        checkpoint.read_full_params(paths[1])


def _outside_copy(tmp_path: Path, ckpt: Path) -> Path:
    """A piece of another checkpoint (the job owner's own file, outside this one)."""
    other = tmp_path / "elsewhere"
    other.mkdir(exist_ok=True)
    shutil.copy(ckpt / "rank00000" / "unit0.param.npy", other / "unit0.param.npy")
    return other / "unit0.param.npy"


@pytest.mark.parametrize("trick", ["absolute", "dotdot", "other rank's directory", "nested"])
async def test_piece_paths_stay_inside_their_step_directory(pristine, tmp_path, caplog, trick):
    """Absolute and ``../`` piece paths pointing at a real .npy elsewhere (same
    numbers, same CRC: only the path is wrong). Before: followed, and the parameters loaded from
    outside the checkpoint."""
    caplog.set_level(logging.WARNING, "ringweave.checkpoint")
    paths = copy_root(pristine, tmp_path)
    root = paths[0].parent
    outside = _outside_copy(tmp_path, paths[1])
    file = {"absolute": str(outside), "dotdot": f"rank00000/../../../{outside.parent.name}/{outside.name}",
            "other rank's directory": "rank00001/unit0.param.npy",
            "nested": "rank00000/x/unit0.param.npy"}[trick]
    (paths[1] / "rank00000" / "unit0.param.npy").unlink()
    edit_meta(paths[1], _set("arrays/unit0.param/pieces/0/file", file))
    with pytest.raises(checkpoint.CheckpointError, match=r"pieces\[[01]\]\.file: .* is not rank<NNNNN>/"):
        checkpoint.read_full_params(paths[1])
    meta, _ = await load_newest(root)
    assert meta["step"] == 1


async def test_a_fifo_piece_does_not_block_the_loader(pristine, tmp_path):
    """A FIFO in a piece's place. Before: the loader blocked in open() forever."""
    paths = copy_root(pristine, tmp_path)
    root = paths[0].parent
    piece = paths[1] / "rank00001" / "unit1.param.npy"
    piece.unlink()
    os.mkfifo(piece, 0o600)
    t0 = time.monotonic()
    with pytest.raises(checkpoint.CheckpointError, match="non-regular file"):
        checkpoint.read_full_params(paths[1])
    meta, _ = await load_newest(root)
    assert meta["step"] == 1 and time.monotonic() - t0 < 10


def _huge(numel: int):
    """Claims unit 0 holds ``numel`` elements, consistently (units, arrays, the last piece)."""
    def edit(meta):
        meta["units"][0]["numel"] = numel
        for name, entry in meta["arrays"].items():
            if name.startswith("unit0."):
                entry["numel"] = numel
                entry["pieces"][-1]["stop"] = numel
        return meta
    return edit


async def test_a_huge_numel_is_refused_before_anything_is_allocated(pristine, tmp_path):
    """numel 2**40 (4 TiB of float32). Before: the loader asked NumPy for it.
    Now each piece's file size is compared with what the metadata claims first."""
    paths = copy_root(pristine, tmp_path)
    root = paths[0].parent
    edit_meta(paths[1], _huge(2**40))
    tracemalloc.start()
    try:
        with pytest.raises(checkpoint.CheckpointError, match=r"rank00001/unit0.param.npy \(unit0.param\) holds "):
            checkpoint.read_unit_params(paths[1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak
    assert (await load_newest(root))[0]["step"] == 1


def _sample(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.sample", *args], cwd=str(REPO), capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))


async def _gpt_checkpoint(root: Path) -> Path:
    """A tiny GPT checkpoint (step 0: as initialized)."""
    async def body(group):
        s = make_strategy("ddp", GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)),
                          TrainConfig(seed=1), group)
        try:
            await s.setup()
            return await checkpoint.save(s, root)
        finally:
            s.close()

    return (await run_ranks(1, body))[0]


GPT_DAMAGE = {
    "n_layer huge": (_set("model/config/n_layer", 10**9), "n_layer = 1000000000, but the checkpoint holds 2 units"),
    "n_embd a string": (_set("model/config/n_embd", "8"), "model.config.n_embd = '8' is not a GPTConfig field"),
    "an unknown field": (_set("model/config/evil", 1), "model.config.evil = 1 is not a GPTConfig field"),
    "n_head not dividing": (_set("model/config/n_head", 3), "model.config: n_embd=8 must be a multiple of n_head=3"),
    "units missing": (lambda m: {k: v for k, v in m.items() if k != "units"}, "the key 'units' is missing"),
    "a piece outside": (_set("arrays/unit0.param/pieces/0/file", "/etc/hostname"), "is not rank<NNNNN>"),
}


async def test_trainer_sample_ends_crafted_checkpoints_with_one_line(tmp_path, capsys):
    """trainer.sample on crafted checkpoints: one line on stderr, exit code 1, no
    traceback (the model's sizes are checked against the checkpoint before it is built). Before:
    raw tracebacks; n_layer = 10**9 built a billion blocks."""
    ckpt = await _gpt_checkpoint(tmp_path / "good")
    ok = _sample("--checkpoint", str(ckpt), "--tokens", "4", "--prompt", "ab")
    assert ok.returncode == 0 and ok.stdout.startswith("ab"), ok.stderr
    for what, (edit, why) in GPT_DAMAGE.items():
        bad = tmp_path / what.replace(" ", "-")
        shutil.copytree(ckpt, bad)
        edit_meta(bad, edit)
        assert sample.main(["--checkpoint", str(bad), "--tokens", "4"]) == 1, what
        err = capsys.readouterr().err
        assert err.startswith("trainer.sample: ") and err.count("\n") == 1 and why in err, (what, err)
    shutil.rmtree(bad / "rank00000")
    done = _sample("--checkpoint", str(bad))  # as users run it: the real exit code, nothing but the line
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("trainer.sample: ") and done.stdout == ""
