"""Checkpoints are their user's alone: roots, step directories and files are created 0700 / 0600
whatever the umask; a root another user made, or one others may write in, is refused; a link
planted anywhere under a root is never followed (SECURITY.md, "Checkpoints").

The attacker is uid nobody (tests/security/stranger.py) working in a shared directory like /tmp
(mode 1777). Before (main at 89488d7): files 0644 and directories 0755 (0666 / 0777 under umask
0); a root nobody made was used, so its planted step-99999999 was loaded by --resume and a racer
that swapped ``.tmp-step-S`` for a directory of links made the save overwrite the owner's files.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from tests.security.ckptutil import after_each_piece, edit_meta, load_newest, params_of, race_tmp_steps, save_steps
from tests.security.stranger import NOBODY, Stopped, Stranger, as_stranger, needs_root
from trainer import checkpoint, ckptfs
from trainer.parallel.offload import Offload

pytestmark = pytest.mark.timeout(60)
PRECIOUS = b"the job owner's own file\n"


@pytest.fixture
def victim(tmp_path):
    """The job owner's own files, which no save may touch."""
    d = tmp_path / "victim"
    d.mkdir()
    for name in ("precious.txt", "unit0.param.npy", "index.json"):
        (d / name).write_bytes(PRECIOUS)
    return d


def untouched(victim: Path) -> bool:
    return sorted(os.listdir(victim)) == ["index.json", "precious.txt", "unit0.param.npy"] and all(
        (victim / n).read_bytes() == PRECIOUS for n in os.listdir(victim))


def modes(root: Path) -> dict[str, tuple[int, int]]:
    """{path below root: (mode, uid)} of everything, the root included."""
    out = {".": (stat.S_IMODE(root.stat().st_mode), root.stat().st_uid)}
    for p in root.rglob("*"):
        st = p.lstat()
        out[str(p.relative_to(root))] = (stat.S_IMODE(st.st_mode), st.st_uid)
    return out


# ---- created private ------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
async def test_roots_step_directories_and_files_are_private_whatever_the_umask(tmp_path, umask):
    """Before: 0755 / 0644 under umask 022, 0777 / 0666 under umask 0: anyone could read the model."""
    root = tmp_path / "runs" / "ckpt"
    old = os.umask(umask)
    try:
        await save_steps(root, 1)
    finally:
        os.umask(old)
    found = modes(root)
    assert {k for k in found if "/" not in k} == {".", "step-00000001"}
    for path, (mode, uid) in found.items():
        want = 0o600 if path.endswith((".npy", ".json")) else 0o700
        assert (mode, uid) == (want, os.geteuid()), (path, oct(mode), uid)


async def test_checkpoints_made_before_these_rules_still_load(tmp_path):
    """A root, step directories and files of an older version (0755 / 0644), this user's: loaded."""
    root = tmp_path / "ckpt"
    paths = await save_steps(root, 2)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    meta, params = await load_newest(root)
    assert meta["step"] == 2
    for got, want in zip(params, params_of(paths[-1])):
        np.testing.assert_array_equal(got, want)
    assert checkpoint.read_full_params(root)  # the files-only reader too


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
async def test_a_root_others_may_write_in_is_refused(tmp_path, mode):
    root = tmp_path / "ckpt"
    await save_steps(root, 1)
    os.chmod(root, mode)
    with pytest.raises(checkpoint.CheckpointError, match=f"has mode {mode:04o}; group and others must not write"):
        await load_newest(root)
    with pytest.raises(checkpoint.CheckpointError, match=f"has mode {mode:04o}"):
        await save_steps(root, 1, first=1)
    assert sorted(os.listdir(root)) == ["step-00000001"]  # nothing written
    for reader in (checkpoint.list_checkpoints, checkpoint.read_metadata, checkpoint.read_full_params):
        with pytest.raises(checkpoint.CheckpointError, match="group and others must not write"):
            reader(root)


async def test_a_link_as_the_root_is_refused(tmp_path):
    real = tmp_path / "real"
    await save_steps(real, 1)
    link = tmp_path / "ckpt"
    link.symlink_to(real)
    with pytest.raises(checkpoint.CheckpointError, match="is a symbolic link.*real path"):
        await load_newest(link)
    with pytest.raises(checkpoint.CheckpointError, match="symbolic link"):
        await save_steps(link, 1, first=1)
    assert sorted(os.listdir(real)) == ["step-00000001"]


# ---- another user's root ------------------------------------------------------------------------


def _plant(root: str, stage: str) -> list[str]:
    """As nobody: make the checkpoint root (0777) and copy a forged checkpoint into it."""
    os.mkdir(root)
    os.chmod(root, 0o777)
    shutil.copytree(stage, os.path.join(root, "step-99999999"))
    return sorted(os.listdir(root))


@needs_root
async def test_a_planted_checkpoint_in_a_root_nobody_made_is_never_loaded(tmp_path, shared_dir, victim):
    """uid nobody makes the root and plants step-99999999 (the job's own weights negated,
    CRCs fixed). Before: --resume loaded it. Now the root itself is refused, and a save into it
    writes nothing."""
    good = tmp_path / "good"
    paths = await save_steps(good, 1)
    stage = shared_dir / "stage"
    shutil.copytree(paths[0], stage)
    for npy in stage.glob("rank*/unit*.param.npy"):
        np.save(npy, -np.load(npy))

    def forge(meta):
        meta["step"] = 99999999
        for name, entry in meta["arrays"].items():
            for piece in entry["pieces"]:
                if name.endswith(".param"):
                    piece["crc32"] = checkpoint._crc(np.load(stage / piece["file"]))
        return meta

    edit_meta(stage, forge)
    for p in [stage, *stage.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)  # so that nobody can copy it
    root = shared_dir / "ckpt"
    assert as_stranger(_plant, str(root), str(stage)) == ["step-99999999"]

    with pytest.raises(checkpoint.CheckpointError, match=f"belongs to uid {NOBODY.pw_uid}, not to this user"):
        await load_newest(root)
    for reader in (checkpoint.list_checkpoints, checkpoint.read_metadata, checkpoint.read_unit_params):
        with pytest.raises(checkpoint.CheckpointError, match="another user may have made it"):
            reader(root)
    with pytest.raises(checkpoint.CheckpointError, match="belongs to uid"):
        await save_steps(root, 1)
    assert {uid for _, uid in modes(root).values()} == {NOBODY.pw_uid}  # not one file of ours in it


def _race(root: str, victim: str) -> dict:
    """As nobody: the .tmp-step-S racer (ckptutil.race_tmp_steps) until stopped."""
    made = {"swaps": 0}
    try:
        race_tmp_steps(root, victim, "precious.txt", lambda: True, made)
    except Stopped:
        return made


@needs_root
async def test_the_tmp_racer_gets_nothing(shared_dir, victim):
    """uid nobody makes the root and swaps ``.tmp-step-S`` for a directory of links into
    the owner's files as soon as it appears. Before: the save wrote through the links (won on the
    first save). Now the root is refused before anything is made in it."""
    root = shared_dir / "ckpt"
    with Stranger(_race, str(root), str(victim)) as racer:
        while not root.exists():
            time.sleep(0.01)
        for _ in range(3):
            with pytest.raises(checkpoint.CheckpointError, match="belongs to uid"):
                await save_steps(root, 1)
    assert racer.result == {"swaps": 0}
    assert untouched(victim)


async def test_a_tmp_directory_swapped_during_a_save_is_not_committed(tmp_path, victim, monkeypatch):
    """Defence in depth, in a root that is ours: ``.tmp-step-S`` is swapped for a directory of
    links after the first piece is written. The ranks keep writing through the descriptors they
    hold (into the directory they made, not the links), and the commit sees the swap and refuses;
    the checkpoint before stays the newest. (Before: every later piece went through the links.)"""
    root = tmp_path / "ckpt"
    await save_steps(root, 1, world=1)
    swapped = []

    def swap(rank, name):
        if rank == 0 and not swapped:
            tmp = root / ".tmp-step-00000002"
            tmp.rename(root / "elsewhere")
            tmp.mkdir()
            (tmp / "rank00000").symlink_to(victim)
            (tmp / "metadata.json").symlink_to(victim / "precious.txt")
            swapped.append(name)

    monkeypatch.setattr(ckptfs.Dir, "write_new", after_each_piece(swap))
    with pytest.raises(checkpoint.CheckpointError, match="was replaced while saving; not committed"):
        await save_steps(root, 1, first=1, world=1)
    assert swapped and untouched(victim)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step-00000001"]
    monkeypatch.undo()
    assert (await load_newest(root))[0]["step"] == 1


async def test_links_under_a_root_are_never_followed(tmp_path, victim, caplog):
    """Links planted as a step, a rank directory, a piece, metadata.json or a stale temporary
    directory: never read through, never written through, never removed through."""
    caplog.set_level(logging.WARNING, "ringweave.checkpoint")
    root = tmp_path / "ckpt"
    paths = await save_steps(root, 3)
    elsewhere = tmp_path / "copy"
    shutil.copytree(paths[2], elsewhere)
    (root / "step-00000009").symlink_to(elsewhere)  # a whole checkpoint by link: not listed
    shutil.rmtree(paths[2] / "rank00001")
    (paths[2] / "rank00001").symlink_to(elsewhere / "rank00001")  # a rank directory by link
    piece = paths[1] / "rank00000" / "unit0.param.npy"
    piece.unlink()
    piece.symlink_to(elsewhere / "rank00000" / "unit0.param.npy")  # a piece by link
    (root / ".tmp-step-00000004").symlink_to(victim)  # a stale temporary directory by link
    assert [p.name for p in checkpoint.list_checkpoints(root)] == [p.name for p in paths]
    meta, _ = await load_newest(root)
    assert meta["step"] == 1
    assert "step-00000003 cannot be loaded" in caplog.text and "symbolic link" in caplog.text
    await save_steps(root, 1, first=3)  # removes the stale link (not what it points at)
    assert untouched(victim) and not (root / ".tmp-step-00000004").exists()
    assert (root / "step-00000009").is_symlink() and elsewhere.is_dir()


@needs_root
async def test_only_our_own_step_directories_are_loaded_or_pruned(tmp_path, caplog):
    """A newer step directory of another uid inside our root (left from when the root was open
    to others): ignored by the loader, saying so, and neither pruned nor counted when pruning.
    (Before: loaded; and it counted as the newest, so keep_last=1 deleted the save just made.)"""
    caplog.set_level(logging.WARNING, "ringweave.checkpoint")
    root = tmp_path / "ckpt"
    paths = await save_steps(root, 2)
    foreign = root / "step-99999999"
    shutil.copytree(paths[-1], foreign)
    for p in [foreign, *foreign.rglob("*")]:
        os.chown(p, NOBODY.pw_uid, NOBODY.pw_gid)
    meta, _ = await load_newest(root)
    assert meta["step"] == 2
    assert f"ignoring {foreign}: it belongs to uid {NOBODY.pw_uid}" in caplog.text
    await save_steps(root, 1, first=2, keep_last=1)
    assert sorted(os.listdir(root)) == ["step-00000003", "step-99999999"]
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint's name"):
        from trainer.ckptfs import open_root  # the one way a checkpoint is deleted refuses other names
        with open_root(root) as rootdir:
            checkpoint.remove_checkpoint(rootdir, "..")


# ---- offload --------------------------------------------------------------------------------------


def test_offload_files_are_private_and_made_through_the_checked_directory(tmp_path, victim):
    """The offload directory is 0700 and its file 0600 whatever the umask, and the file is made
    relative to the directory's descriptor: a directory swapped for a link after it was made is
    not written through. (Before: the file was opened by path, through the link.)"""
    old = os.umask(0o277)
    try:
        off = Offload("optimizer", str(tmp_path / "off"), 0)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(off.dir).st_mode) == 0o700
        os.rename(off.dir, tmp_path / "moved")
        os.symlink(victim, off.dir)
        off.adopt([{"exp_avg": np.ones(1000, np.float32)}])
        assert untouched(victim)
        made = tmp_path / "moved" / os.path.basename(off.path)
        assert stat.S_IMODE(made.stat().st_mode) == 0o600
    finally:
        off.close()
    assert not made.exists() and untouched(victim)
