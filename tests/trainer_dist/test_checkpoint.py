"""Sharded, atomic checkpoints: resharding across world sizes and strategies, crash safety,
exact resume, export of named parameters."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dist_helpers import assert_params_close, make_config, step_batches, tiny_model
from runtime.testing import run_ranks
from tests.security.ckptutil import after_each_piece
from trainer import checkpoint, ckptfs
from trainer.sharding import make_strategy

REPO = Path(__file__).resolve().parents[2]


async def train_and_save(root, name, world, steps, *, config=None, keep_last=3, extra=None):
    """Trains ``steps`` steps and saves; returns per rank (full params, losses, checkpoint path)."""
    config = config or make_config()

    async def body(group):
        strategy = make_strategy(name, tiny_model(group.size), config, group)
        try:
            await strategy.setup()
            losses = [(await strategy.train_step(mbs)).loss
                      for mbs in step_batches(group.size, group.rank, config.grad_accum)[:steps]]
            path = await checkpoint.save(strategy, root, keep_last=keep_last, extra=extra or {"steps": steps})
            return await strategy.full_params(), losses, path
        finally:
            strategy.close()

    return await run_ranks(world, body)


async def load_and_train(root, name, world, steps_after, *, config=None, start=None):
    """Loads the newest checkpoint into a fresh strategy; returns per rank (params at load,
    losses of the next steps, params after them, metadata)."""
    config = config or make_config()

    async def body(group):
        strategy = make_strategy(name, tiny_model(group.size), config, group)
        try:
            await strategy.setup()
            meta = checkpoint.load(strategy, root)
            loaded = await strategy.full_params()
            first = meta["step"] if start is None else start
            losses = [(await strategy.train_step(mbs)).loss
                      for mbs in step_batches(group.size, group.rank, config.grad_accum)[first : first + steps_after]]
            return loaded, losses, await strategy.full_params(), meta
        finally:
            strategy.close()

    return await run_ranks(world, body)


@pytest.mark.timeout(30)
async def test_save_zero3_at_4_load_ddp_at_2_and_at_1(tmp_path):
    saved = await train_and_save(tmp_path, "zero3", 4, 3)
    want = saved[0][0]
    for name, world in [("ddp", 2), ("zero3", 1), ("zero1", 3)]:
        for loaded, *_ in await load_and_train(tmp_path, name, world, 0):
            assert_params_close(loaded, want, rtol=0)  # bit-identical: loading is copying
    # the files alone, without any strategy or group
    files = checkpoint.read_full_params(saved[0][2])
    model = tiny_model()
    for i, unit in enumerate(model.units):
        for spec in unit.param_specs:
            np.testing.assert_array_equal(files[f"{i}.{spec.name}"], want[i][spec.offset : spec.end].reshape(spec.shape))
    meta = checkpoint.read_metadata(tmp_path)
    assert (meta["strategy"], meta["world_size"], meta["step"], meta["extra"]) == ("zero3", 4, 3, {"steps": 3})
    pieces = meta["arrays"]["unit1.param"]["pieces"]
    assert [p["file"].split("/")[0] for p in pieces] == [f"rank{r:05d}" for r in range(4)]  # each rank its own


@pytest.mark.timeout(30)
async def test_ddp_writes_replicated_state_once(tmp_path):
    await train_and_save(tmp_path, "ddp", 3, 1)
    meta = checkpoint.read_metadata(tmp_path)
    assert all(len(a["pieces"]) == 1 for a in meta["arrays"].values())
    assert sorted(p.name for p in checkpoint.latest(tmp_path).iterdir()) == ["metadata.json", "rank00000",
                                                                               "rank00001", "rank00002"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,world,load_name,load_world", [
    ("zero2", 2, "zero2", 2), ("zero3", 4, "ddp", 2), ("ddp", 1, "zero3", 3)])
async def test_resume_gives_the_same_losses(tmp_path, name, world, load_name, load_world):
    config = make_config(grad_accum=2)
    uninterrupted = await train_and_save(tmp_path / "full", name, world, 5, config=config)
    await train_and_save(tmp_path / "half", name, world, 2, config=config)
    resumed = await load_and_train(tmp_path / "half", load_name, load_world, 3, config=config)
    want_losses, want_params = uninterrupted[0][1][2:], uninterrupted[0][0]
    exact = (name, world) == (load_name, load_world)
    for _, losses, params, meta in resumed:
        assert meta["step"] == 2
        if exact:  # same layout: the very same arithmetic
            assert losses == want_losses
            assert_params_close(params, want_params, rtol=0)
        else:  # resharded: the summation order of the gradients differs
            np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
            assert_params_close(params, want_params)


@pytest.mark.timeout(30)
async def test_a_failed_save_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    good = await train_and_save(tmp_path, "zero3", 3, 2)

    def fail_on_rank_1(rank, name):
        if rank == 1 and name == "unit1.param":  # after unit 0's pieces are already on disk
            raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(ckptfs.Dir, "write_new", after_each_piece(fail_on_rank_1))

    async def body(group):
        strategy = make_strategy("zero3", tiny_model(group.size), make_config(), group)
        try:
            await strategy.setup()
            for mbs in step_batches(group.size, group.rank, 1)[:4]:
                await strategy.train_step(mbs)
            with pytest.raises(checkpoint.CheckpointError, match=r"failed on rank 1; the previous checkpoint is intact"):
                await checkpoint.save(strategy, tmp_path)
            return True
        finally:
            strategy.close()

    assert await run_ranks(3, body) == [True] * 3
    assert checkpoint.latest(tmp_path).name == "step-00000002"
    assert not list(tmp_path.glob(".tmp-*"))
    monkeypatch.undo()
    for loaded, *_ in await load_and_train(tmp_path, "zero3", 3, 0):
        assert_params_close(loaded, good[0][0], rtol=0)


KILLED_SAVER = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    from dist_helpers import make_config, step_batches, tiny_model
    from runtime.testing import run_ranks
    from tests.security.ckptutil import after_each_piece
    from trainer import checkpoint, ckptfs
    from trainer.sharding import make_strategy
    root, flag = Path(sys.argv[1]), Path(sys.argv[2])

    def hang_after_first_piece(rank, name):
        if name == "unit0.exp_avg":
            flag.write_text("writing")
            time.sleep(60)  # the parent kills us here, mid-save

    async def body(group):
        s = make_strategy("zero2", tiny_model(group.size), make_config(), group)
        await s.setup()
        batches = step_batches(group.size, group.rank, 1)
        await s.train_step(batches[0])
        await checkpoint.save(s, root)
        await s.train_step(batches[1])
        ckptfs.Dir.write_new = after_each_piece(hang_after_first_piece)
        await checkpoint.save(s, root)

    asyncio.run(run_ranks(1, body))
""")


@pytest.mark.timeout(60)
async def test_a_save_killed_midway_leaves_the_last_good_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER.format(repo=str(REPO), tests=str(Path(__file__).parent)))
    root, flag = tmp_path / "ckpt", tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(flag)])
    try:
        deadline = time.monotonic() + 45
        while not flag.exists():
            assert proc.poll() is None, f"the saver exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "the saver never reached its second save"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert checkpoint.latest(root).name == "step-00000001"
    assert [p.name for p in root.glob(".tmp-*")] == [".tmp-step-00000002"]  # the half-written save
    (loaded, _, _, meta), = await load_and_train(root, "zero2", 1, 0)
    assert meta["step"] == 1
    # the next save clears the debris and commits
    await train_and_save(root, "zero2", 1, 2)
    assert not list(root.glob(".tmp-*"))
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step-00000001", "step-00000002"]


@pytest.mark.timeout(30)
async def test_keep_last(tmp_path):
    config = make_config()

    async def body(group):
        strategy = make_strategy("zero1", tiny_model(group.size), config, group)
        try:
            await strategy.setup()
            for mbs in step_batches(group.size, group.rank, 1)[:4]:
                await strategy.train_step(mbs)
                await checkpoint.save(strategy, tmp_path, keep_last=2)
        finally:
            strategy.close()

    await run_ranks(2, body)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]


@pytest.mark.timeout(30)
async def test_corrupt_or_mismatched_checkpoints_are_refused(tmp_path):
    saved = await train_and_save(tmp_path, "zero3", 2, 1)
    path = saved[0][2]

    async def load_error(config, world):
        async def body(group):
            strategy = make_strategy("zero3", tiny_model(group.size), config, group)
            try:
                await strategy.setup()
                checkpoint.load(strategy, tmp_path)
            finally:
                strategy.close()

        return await run_ranks(world, body, return_exceptions=True)

    # another optimizer: the state it needs is not there (every rank says so)
    for exc in await load_error(make_config(optimizer="sgd"), 2):
        assert isinstance(exc, checkpoint.CheckpointError) and "no array 'unit0.momentum'" in str(exc)
    # a flipped byte in rank 1's piece of unit 1: at world size 1 the only rank reads it
    piece = path / "rank00001" / "unit1.param.npy"
    data = bytearray(piece.read_bytes())
    data[-1] ^= 0xFF
    piece.write_bytes(bytes(data))
    (exc,) = await load_error(make_config(), 1)
    assert isinstance(exc, checkpoint.CheckpointError) and "rank00001/unit1.param.npy" in str(exc)
    assert "corrupt" in str(exc)
    with pytest.raises(checkpoint.CheckpointError, match="no committed checkpoint"):
        checkpoint.read_metadata(tmp_path / "nothing-here")


@pytest.mark.timeout(30)
async def test_export_npz_of_named_parameters(tmp_path):
    config = make_config()

    async def body(group):
        strategy = make_strategy("zero3", tiny_model(group.size), config, group)
        try:
            await strategy.setup()
            await strategy.train_step(step_batches(group.size, group.rank, 1)[0])
            out = await checkpoint.export_npz(strategy, tmp_path / "model.npz")
            return out, await strategy.full_params()
        finally:
            strategy.close()

    (out, full), (none, _) = await run_ranks(2, body)
    assert none is None
    with np.load(out) as z:
        names = list(z.keys())
        assert names == ["0.0.weight", "0.0.bias", "0.1.weight", "0.1.bias", "1.0.weight", "1.0.bias",
                         "1.1.weight", "1.1.bias", "2.0.weight", "2.0.bias"]
        assert z["0.0.weight"].shape == (10, 12)  # Linear's W is (in, out)
        flat = np.concatenate([z[n].ravel() for n in names if n.startswith("1.")])
        np.testing.assert_array_equal(flat, full[1])
