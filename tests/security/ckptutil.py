"""Small real checkpoints to attack, for tests/security/test_checkpoint_*.py and bench/security.py.

    paths = await save_steps(root, 2)           # root/step-00000001 and step-00000002, zero3 at 2 ranks
    paths = copy_root(pristine, tmp_path)      # a fresh copy of a root saved once per module
    meta, params = await load_newest(root)     # load_newest_valid at world size 1: its metadata, unit params
    edit_meta(paths[-1], fn)                   # metadata.json rewritten as fn(meta) returns it

A tiny MLP (4 -> 6 -> 3, float32, AdamW) trained one step per checkpoint on synthetic rows, so
each checkpoint has 2 units x 3 arrays, each array in 2 pieces (one per rank).

    race_tmp_steps(root, victim, "notes.txt", running, made)   # the .tmp-step-S racer, as the attacker
    monkeypatch.setattr(ckptfs.Dir, "write_new", after_each_piece(fn))   # fn(rank, name) once each piece is durable

Not here: the other attacks (each test file writes its own).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from runtime.testing import run_ranks
from trainer import checkpoint, ckptfs
from trainer.data import iter_local_batches, make_synthetic
from trainer.nn import mlp
from trainer.sharding import TrainConfig, make_strategy

X, Y = make_synthetic(32, in_dim=4, num_classes=3, seed=1)


def model(pad_to: int = 1):
    return mlp(4, (6,), 3, pad_to=pad_to)


def config() -> TrainConfig:
    return TrainConfig(lr=1e-2, seed=3)


def _batches(world: int, rank: int) -> list[list[tuple]]:
    local = list(iter_local_batches(len(X), 8, world, rank, seed=2, epoch=0))
    return [[(X[b.indices], Y[b.indices], b.offset, b.global_size)] for b in local]


async def save_steps(root, steps: int, *, world: int = 2, name: str = "zero3", first: int = 0,
                     keep_last: int = 100) -> list[Path]:
    """Trains ``first + steps`` steps of ``name`` on ``world`` ranks, saving after each of the last
    ``steps``; returns the checkpoints' paths (rank 0's answers)."""

    async def body(group):
        s = make_strategy(name, model(group.size), config(), group)
        try:
            await s.setup()
            paths = []
            for k, mbs in enumerate(_batches(group.size, group.rank)[: first + steps]):
                await s.train_step(mbs)
                if k >= first:
                    paths.append(await checkpoint.save(s, root, keep_last=keep_last))
            return paths
        finally:
            s.close()

    return await _first(world, body)


async def _first(world: int, body):
    """Rank 0's answer; the first rank's exception itself (not a group of them) when one raised."""
    results = await run_ranks(world, body, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results[0]


async def load_newest(root, *, world: int = 1, name: str = "ddp"):
    """``load_newest_valid`` on a fresh strategy; returns (metadata or None, unit params)."""

    async def body(group):
        s = make_strategy(name, model(group.size), config(), group)
        try:
            await s.setup()
            meta = await checkpoint.load_newest_valid(s, root)
            return meta, await s.full_params()
        finally:
            s.close()

    return await _first(world, body)


def copy_root(src: Path, dst: Path) -> list[Path]:
    """A copy of checkpoint root ``src`` at ``dst / "ckpt"`` (modes kept); its checkpoints' paths."""
    root = Path(dst) / "ckpt"
    shutil.copytree(src, root)
    return checkpoint.list_checkpoints(root)


def edit_meta(ckpt: Path, fn) -> None:
    """Rewrites ``ckpt``'s metadata.json with ``fn(meta)`` (as the file's owner would)."""
    path = Path(ckpt) / checkpoint.METADATA
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def params_of(ckpt: Path) -> list[np.ndarray]:
    """The unit parameters stored in a checkpoint, read from its files."""
    return checkpoint.read_unit_params(ckpt)[0]


def after_each_piece(fn):
    """A ``ckptfs.Dir.write_new`` that calls ``fn(rank, name)`` after a save's piece
    ``.tmp-step-S/rankRRRRR/<name>.npy`` is written and fsynced (and does nothing else new): where
    a test makes a save fail, hang or race between one piece and the next."""
    write_new = ckptfs.Dir.write_new

    def write_new_then(self, filename: str, write) -> None:
        write_new(self, filename, write)
        here = self.path
        if here.parent.name.startswith(".tmp-step-") and here.name.startswith("rank") and filename.endswith(".npy"):
            fn(int(here.name[len("rank"):]), filename[: -len(".npy")])

    return write_new_then


def race_tmp_steps(root: str, victim: str, target: str, running, made: dict) -> None:
    """As the attacker: makes checkpoint root ``root`` (0777), then, while ``running()``, swaps
    every ``.tmp-step-S`` that appears for a directory whose ``rank00000``, ``rank00001`` link to
    directory ``victim`` and whose ``metadata.json`` links to ``victim/target``. Counts its swaps
    in ``made["swaps"]`` as it goes (the caller may be stopped inside)."""
    os.mkdir(root)
    os.chmod(root, 0o777)
    while running():
        for name in os.listdir(root):
            if name.startswith(".tmp-step-") and ".gone" not in name:
                try:
                    os.rename(os.path.join(root, name), os.path.join(root, f"{name}.gone{made['swaps']}"))
                    fake = os.path.join(root, name)
                    os.mkdir(fake, 0o777)
                    for link in ("rank00000", "rank00001"):
                        os.symlink(victim, os.path.join(fake, link))
                    os.symlink(os.path.join(victim, target), os.path.join(fake, "metadata.json"))
                    made["swaps"] += 1
                except OSError:
                    pass
        time.sleep(0.0002)
