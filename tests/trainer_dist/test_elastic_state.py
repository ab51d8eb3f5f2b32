"""Elastic training's state (trainer/sharding/redundancy.py): a step is all or nothing, the buddy's
copy of its neighbour's shard is bit-identical to it, and re-sharding onto the survivors of a lost
rank gives the training a single process does on the same global batches (float64, 1e-12)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dist_helpers import assert_params_close, make_config, reference_run, step_batches, tiny_model
from runtime.store import MemoryStore
from runtime.testing import run_ranks
from trainer.sharding import ShardLostError, StepAbortedError, make_strategy
from trainer.sharding.redundancy import REFRESH_EVERY, Redundancy, memory_nbytes, step_bytes

pytestmark = pytest.mark.timeout(90)
CONFIG = dict(clip_norm=0.05)  # the clip bites: the buddy must apply the same coefficient


def elastic_strategy(name, group, store, **config):
    return make_strategy(name, tiny_model(), make_config(**{**CONFIG, **config}), group,
                         redundancy=Redundancy(store, timeout=5.0))


def snapshot(s) -> list[bytes]:
    """Every byte of state a step may change: parameters, optimizer and buddy state, scaler, step."""
    arrays = [s._master_shard(i) for i in range(len(s.units))] + list(s._replicated_arrays())
    arrays += getattr(s, "compute_shards", []) + getattr(s, "compute", [])
    for st in s.states + s.redundancy.states:
        arrays += list(st.buffers.values())
    arrays += s.redundancy.masters
    scalars = [s.step, s.scaler.state.scale, s.scaler.state.good_steps, *(st.step for st in s.states + s.redundancy.states)]
    return [np.ascontiguousarray(a).tobytes() for a in arrays] + [repr(scalars).encode()]


def assert_buddies_exact(strategies) -> None:
    """Rank r's copy of rank r+1's master shard and optimizer state equals rank r+1's, bit for bit."""
    n = len(strategies)
    for r, s in enumerate(strategies):
        b = strategies[(r + 1) % n]
        for i in range(len(s.units)):
            assert s.redundancy.masters[i].tobytes() == b._master_shard(i).tobytes(), (r, i)
            assert s.redundancy.states[i].step == b.states[i].step
            for key, buf in b.states[i].buffers.items():
                assert s.redundancy.states[i].buffers[key].tobytes() == buf.tobytes(), (r, i, key)


@pytest.mark.parametrize("name,config", [("zero1", {}), ("zero2", {}), ("fsdp", {}), ("zero2", {"grad_accum": 2}),
                                         ("zero2", {"param_dtype": "float32"}), ("zero3", {"optimizer": "sgd"})])
async def test_buddy_copies_equal_their_neighbours_shards_bit_for_bit(name, config):
    store = MemoryStore()
    strategies = [None] * 3

    async def body(g):
        s = strategies[g.rank] = elastic_strategy(name, g, store, **config)
        try:
            await s.setup()
            for mbs in step_batches(g.size, g.rank, s.config.grad_accum)[:3]:
                await s.train_step(mbs)
            return await s.full_params()
        finally:
            s.close()

    per_rank = await run_ranks(3, body)
    assert_buddies_exact(strategies)
    assert any(st.buffers and np.any(next(iter(st.buffers.values()))) for st in strategies[0].redundancy.states)
    if config.get("param_dtype") is None:  # float64 throughout: the plain training's numbers
        want, _ = reference_run(make_config(**{**CONFIG, **config}), 3)
        for params in per_rank:
            assert_params_close(params, want)


@pytest.mark.parametrize("name", ["ddp", "zero2", "fsdp"])
async def test_a_peer_lost_mid_backward_aborts_the_step_on_every_survivor_with_no_state_changed(name):
    store, victim = MemoryStore(), 1

    async def body(g):
        g.shm_enabled = False  # in-process ranks share a pid: shared memory sees a lost peer at the deadline only
        s = elastic_strategy(name, g, store)
        try:
            await s.setup()
            batches = step_batches(g.size, g.rank, 1)
            await s.train_step(batches[0])
            before = snapshot(s)
            if g.rank == victim:
                loop, hooks = asyncio.get_running_loop(), s._hooks

                def lost_in_backward(sync, params, grads):
                    made = hooks(sync, params, grads)
                    ready = made.get("grad_ready", lambda i: None)

                    def grad_ready(i):  # the last unit's gradient is ready: die before the others
                        if i == len(s.units) - 1:
                            asyncio.run_coroutine_threadsafe(g.runtime.actor.close(), loop).result(10)
                        ready(i)
                    return {**made, "grad_ready": grad_ready}
                s._hooks = lost_in_backward
            try:
                await s.train_step(batches[1])
            except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
                return exc, before == snapshot(s), s.step
            return None, before == snapshot(s), s.step
        finally:
            s.close()

    results = await run_ranks(4, body, timeout_s=20)
    for r, (exc, unchanged, step) in enumerate(results):
        if r == victim:
            continue
        assert isinstance(exc, StepAbortedError) and exc.step == 1, (r, exc)
        assert unchanged and step == 1, r
    assert await store.get("commit/1") == b"0"


@pytest.mark.parametrize("name,lost", [("zero1", [2]), ("zero2", [2]), ("fsdp", [2]), ("zero3", [1, 3]),
                                       ("zero2", [0])])
async def test_survivors_reshard_and_train_on_as_one_process_would(name, lost):
    """4 ranks train 2 steps, ranks ``lost`` go, the survivors re-shard and train 3 more: the
    global batches are the same, so the parameters equal single-process training's to 1e-12."""
    store, before, after = MemoryStore(), 2, 3
    survivors = [r for r in range(4) if r not in lost]
    strategies = {}

    async def body(g):
        s = elastic_strategy(name, g, store)
        try:
            await s.setup()
            for mbs in step_batches(4, g.rank, 1)[:before]:
                await s.train_step(mbs)
            new = g.new_group(survivors)  # every rank of the old world makes it, the lost ones too
            if g.rank in lost:
                await g.runtime.actor.close()  # gone
                return None
            await s.reshard(new, lost)
            assert (s.N, s.rank) == (len(survivors), survivors.index(g.rank))
            strategies[s.rank] = s
            for mbs in step_batches(new.size, new.rank, 1)[before : before + after]:
                await s.train_step(mbs)
            return await s.full_params()
        finally:
            s.close()

    per_rank = await run_ranks(4, body, timeout_s=20)
    want, _ = reference_run(make_config(**CONFIG), before + after)
    for r in survivors:
        assert_params_close(per_rank[r], want)
    assert_buddies_exact([strategies[k] for k in range(len(survivors))])


async def test_an_error_in_one_ranks_backward_aborts_the_step_everywhere_with_no_state_changed():
    """Rank 1's backward raises (a bug, not a lost peer): it records "no"; the others' collectives
    with it reach their deadline; every rank raises StepAbortedError and keeps its state."""
    store = MemoryStore()

    async def body(g):
        s = elastic_strategy("zero2", g, store)
        try:
            await s.setup()
            before = snapshot(s)
            if g.rank == 1:
                hooks = s._hooks

                def failing(sync, params, grads):
                    def boom(i):
                        raise RuntimeError("backward failed")
                    return {**hooks(sync, params, grads), "grad_ready": boom}
                s._hooks = failing
            with pytest.raises(StepAbortedError) as info:
                await s.train_step(step_batches(g.size, g.rank, 1)[0])
            return type(info.value.__cause__).__name__, before == snapshot(s)
        finally:
            s.close()

    results = await run_ranks(3, body, timeout_s=2)
    assert results[1] == ("RuntimeError", True) and all(unchanged for _, unchanged in results), results
    assert await store.get("commit/0") == b"0"


@pytest.mark.parametrize("name", ["zero1", "zero2"])
async def test_a_peer_lost_after_the_commit_counts_the_step_and_the_survivors_go_on_from_it(name):
    """The victim dies in its update (after the vote), while zero's parameter all_gathers travel:
    the step is applied on every survivor, counted, and the re-shard goes on from it."""
    store, victim, survivors = MemoryStore(), 2, [0, 1, 3]
    strategies = {}

    async def body(g):
        g.shm_enabled = False
        s = elastic_strategy(name, g, store)
        try:
            await s.setup()
            batches = step_batches(4, g.rank, 1)
            await s.train_step(batches[0])
            if g.rank == victim:
                loop, launch = asyncio.get_running_loop(), s._launch_gather

                def dying_launch(i):
                    if i == 1:
                        asyncio.run_coroutine_threadsafe(g.runtime.actor.close(), loop).result(10)
                    launch(i)
                s._launch_gather = dying_launch
            try:
                await s.train_step(batches[1])
                failed = None
            except Exception as exc:  # noqa: BLE001
                failed = exc
            new = g.new_group(survivors)
            if g.rank == victim:
                return None
            assert failed is not None and not isinstance(failed, StepAbortedError) and s.step == 2, failed
            await s.reshard(new, [victim])
            strategies[s.rank] = s
            for mbs in step_batches(3, new.rank, 1)[2:4]:
                await s.train_step(mbs)
            return await s.full_params()
        finally:
            s.close()

    per_rank = await run_ranks(4, body, timeout_s=20)
    want, _ = reference_run(make_config(**CONFIG), 4)
    for r in survivors:
        assert_params_close(per_rank[r], want)
    assert_buddies_exact([strategies[k] for k in range(3)])


async def test_a_shard_whose_rank_and_holder_are_both_lost_asks_for_the_checkpoint():
    store, lost = MemoryStore(), [1, 2]  # rank 1 held rank 2's replica

    async def body(g):
        s = elastic_strategy("zero2", g, store)
        try:
            await s.setup()
            await s.train_step(step_batches(4, g.rank, 1)[0])
            new = g.new_group([0, 3])
            if g.rank in lost:
                return None
            with pytest.raises(ShardLostError, match="checkpoint") as info:
                await s.reshard(new, lost)
            return info.value.ranks
        finally:
            s.close()

    assert await run_ranks(4, body) == [[2], None, None, [2]]


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "fsdp"])
async def test_the_extra_bytes_per_step_are_the_accounted_ones_and_the_buddy_memory_is_stated(name):
    store = MemoryStore()

    async def body(g):
        plain = make_strategy(name, tiny_model(), make_config(**CONFIG), g)
        elastic = elastic_strategy(name, g, store)
        try:
            await plain.setup()
            await elastic.setup()
            mbs = step_batches(g.size, g.rank, 1)[0]
            sent = [(await s.train_step(mbs)).comm_bytes for s in (plain, elastic)]
            return sent, elastic.lengths, memory_nbytes(elastic)
        finally:
            plain.close()
            elastic.close()

    for (plain, elastic), lengths, nbytes in await run_ranks(3, body):
        assert elastic - plain == step_bytes(name, lengths, 3, reduce_itemsize=8) > 0
        shard_elements = sum(length // 3 for length in lengths)
        copies = {"ddp": 0, "zero1": 3, "zero2": 3, "fsdp": 3}[name]  # the master shard, Adam's m and v
        logged = REFRESH_EVERY if copies else 0  # a full log: that many buddy messages
        assert nbytes == (copies + logged) * shard_elements * 8


async def test_elastic_refuses_what_it_cannot_keep_whole(ranks):
    async def body(g):
        with pytest.raises(ValueError, match="compression"):
            make_strategy("zero2", tiny_model(), make_config(compression="int8"), g, redundancy=Redundancy(MemoryStore()))
    await ranks(2, body)
