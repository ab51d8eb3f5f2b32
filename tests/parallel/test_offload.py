"""Offload: optimizer state (and master weights) in memory-mapped files give the same bits as without,
the files are the rank's alone, the run reports the bytes moved out of memory, and what cannot be
offloaded is refused."""

import os
import stat

import numpy as np
import pytest

from mesh_cases import CONFIG, step_batches
from runtime.testing import run_ranks
from trainer.nn import GPT
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.parallel.offload import Offload, make_offload_strategy
from trainer.sharding import TrainConfig, make_strategy


def config(**kw) -> TrainConfig:
    return TrainConfig(lr=2e-2, seed=5, weight_decay=0.1, param_dtype="bfloat16", **kw)


async def train(name, world, cfg, *, mesh=None, steps=3):
    async def body(group):
        if mesh:
            m = Mesh(group, **mesh)
            s = make_parallel_strategy(name, CONFIG, cfg, m, parallel=ParallelConfig(micro_batches=2))
            dp, dp_rank = m.shape["dp"], m.coords["dp"]
        else:
            model = GPT(CONFIG)
            s = (make_offload_strategy if cfg.offload else make_strategy)(name, model, cfg, group)
            dp, dp_rank = group.size, group.rank
        try:
            await s.setup()
            files = None
            if cfg.offload:
                st = os.stat(s.offload.dir), os.stat(s.offload.path)
                files = (stat.S_IMODE(st[0].st_mode), stat.S_IMODE(st[1].st_mode), st[1].st_uid == os.getuid(),
                         s.offload.dir)
            losses = [(await s.train_step(mbs)).loss for mbs in step_batches(dp, dp_rank, 1)[:steps]]
            state = [b.tobytes() for st in s.states for b in st.buffers.values()]
            master = sum(m.nbytes for m in s.master)  # the float32 master (shards, or replicas under ddp)
            mem = {**s.memory_bytes(), "master": master}
            return [p.tobytes() for p in await s.full_params()], losses, state, mem, files
        finally:
            s.close()

    return await run_ranks(world, body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, world, mesh, kind", [("fsdp", 2, None, "params"), ("ddp", 1, None, "optimizer"),
                                                     ("zero2", 2, None, "params"),
                                                     ("zero1", 4, {"tp": 2, "pp": 2}, "optimizer")])
async def test_offload_gives_the_same_bits_and_moves_the_bytes_out_of_memory(tmp_path, name, world, mesh, kind):
    plain = await train(name, world, config(), mesh=mesh)
    offloaded = await train(name, world, config(offload=kind, offload_dir=str(tmp_path)), mesh=mesh)
    for (p0, l0, s0, m0, _), (p1, l1, s1, m1, files) in zip(plain, offloaded):
        assert p1 == p0 and l1 == l0 and s1 == s0  # the same bits
        dir_mode, file_mode, mine, directory = files
        assert (dir_mode, file_mode, mine) == (0o700, 0o600, True)
        assert os.path.dirname(directory) == str(tmp_path) and not os.path.exists(directory)  # removed at close
        moved = m1["optim"] + (m1["master"] if kind == "params" else 0)
        assert m1["offloaded"] == moved and m1["resident"] == m1["total"] - moved
        assert "offloaded" not in m0


def test_the_file_is_made_exclusively_and_never_through_a_link(tmp_path):
    off = Offload("optimizer", str(tmp_path), 0)
    os.symlink("/dev/null", off.path)  # a link planted where the file will be
    with pytest.raises(FileExistsError):
        off.adopt([{"exp_avg": np.zeros(10, np.float32)}])
    off.close()
    off = Offload("optimizer", str(tmp_path), 0)
    arrays = off.adopt([{"exp_avg": np.arange(3, dtype=np.float32)}, {"exp_avg": np.ones(5000, np.float32)}])
    off.prefetch(1)
    arrays[1]["exp_avg"] += 1  # written, released behind, read back from the file
    off.release(1)
    off.finish()
    assert arrays[1]["exp_avg"].sum() == 10000 and arrays[0]["exp_avg"].tolist() == [0, 1, 2]
    assert off.nbytes == 4 * 5003 and os.path.getsize(off.path) == 4096 * 6  # page-aligned arrays
    off.close()
    assert os.listdir(tmp_path) == []


def test_a_failed_write_back_names_the_unit_and_the_file(tmp_path):
    off = Offload("optimizer", str(tmp_path), 0)
    off.adopt([{"exp_avg": np.zeros(10, np.float32)}, {"exp_avg": np.zeros(10, np.float32)}])
    real = off._mm

    class FullDisk:  # the mapping's msync fails as on a full disk
        def flush(self, *a):
            raise OSError(28, "No space left on device")

    off._mm = FullDisk()
    off.release(1)
    with pytest.raises(OSError, match="unit 1 back failed: No space left on device") as info:
        off.finish()
    assert info.value.errno == 28 and info.value.filename == off.path
    off._mm = real
    off.close()


@pytest.mark.timeout(30)
async def test_what_cannot_be_offloaded_is_refused():
    async def body(group):
        with pytest.raises(ValueError, match="offload 'params' keeps the float32 master weights on disk"):
            make_offload_strategy("fsdp", GPT(CONFIG), TrainConfig(offload="params"), group)
        with pytest.raises(ValueError, match="build the strategy with trainer.parallel.make_offload_strategy"):
            make_strategy("ddp", GPT(CONFIG), TrainConfig(offload="optimizer"), group)
        with pytest.raises(ValueError, match="must be one of"):
            make_offload_strategy("ddp", GPT(CONFIG), TrainConfig(offload="gradients"), group)
        return True

    assert await run_ranks(1, body) == [True]
