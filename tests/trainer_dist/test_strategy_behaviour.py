"""How the strategies behave beyond their numbers: communication launched during the
backward (overlap) and prefetched gathers, replica checksums that name the rank that
drifted, evaluation, and failures that surface instead of hanging."""

import asyncio
import time

import numpy as np
import pytest

from dist_helpers import X, Y, assert_params_close, make_config, reference_run, step_batches, tiny_model
from runtime.errors import CollectiveError
from runtime.testing import run_ranks
from trainer.nn import EVAL
from trainer.nn.loss import cross_entropy_forward
from trainer.sharding import ReplicaMismatchError, make_strategy


def record_events(strategy, log: list) -> None:
    """Logs unit forward/backward calls and collective launches, in program order."""
    launch = strategy.collectives.launch

    def logged_launch(coro):
        log.append(("launch", coro.__qualname__.rsplit(".", 1)[-1]))
        return launch(coro)

    strategy.collectives.launch = logged_launch
    for unit in strategy.model.units:
        for kind in ("forward", "backward"):
            method = getattr(unit, kind)

            def logged(*args, method=method, kind=kind, i=unit.index, **kwargs):
                log.append((kind, i))
                return method(*args, **kwargs)

            setattr(unit, kind, logged)


async def logged_step(name: str, config, accum: int = 1) -> dict[int, list]:
    """One train_step of ``name`` on 2 ranks; each rank's record_events log."""
    log_by_rank = {}

    async def body(group):
        strategy = make_strategy(name, tiny_model(group.size), config, group)
        try:
            await strategy.setup()
            log_by_rank[group.rank] = log = []
            record_events(strategy, log)
            await strategy.train_step(step_batches(group.size, group.rank, accum)[0])
        finally:
            strategy.close()

    await run_ranks(2, body)
    return log_by_rank


@pytest.mark.timeout(30)
async def test_ddp_launches_each_bucket_during_backward():
    log = (await logged_step("ddp", make_config(bucket_cap_mb=1e-4)))[0]
    backward = [e for e in log if e[0] in ("backward", "launch")]
    # the bucket of unit 2 is reduced while units 1 and 0 compute their backward, and so on
    assert backward == [("backward", 2), ("launch", "all_reduce"), ("backward", 1), ("launch", "all_reduce"),
                        ("backward", 0), ("launch", "all_reduce")]


@pytest.mark.timeout(30)
async def test_ddp_accumulation_communicates_only_at_the_boundary():
    log = (await logged_step("ddp", make_config(grad_accum=2), accum=2))[1]
    launches = [k for k, e in enumerate(log) if e[0] == "launch"]
    second_forward = [k for k, e in enumerate(log) if e == ("forward", 0)][1]
    assert len(launches) == 1 and launches[0] > second_forward  # one bucket, after the last micro-batch


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reshard", [True, False])
async def test_fsdp_prefetches_the_next_unit_and_regathers_for_backward(reshard):
    log_by_rank = await logged_step("fsdp", make_config(reshard_after_forward=reshard))
    G, R = ("launch", "all_gather"), ("launch", "_reduce_and_free")
    forward = [G, G, ("forward", 0), G, ("forward", 1), ("forward", 2)]  # unit i+1 travels while i computes
    if reshard:  # units 0 and 1 were freed after their forward; the last unit was kept
        backward = [G, ("backward", 2), R, G, ("backward", 1), R, ("backward", 0), R]
    else:
        backward = [("backward", 2), R, ("backward", 1), R, ("backward", 0), R]
    assert log_by_rank[0] == forward + backward


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["zero1", "zero2"])
async def test_zero_launches_each_units_gather_as_soon_as_its_shard_is_updated(name):
    async def body(group):
        strategy = make_strategy(name, tiny_model(group.size), make_config(), group)
        try:
            await strategy.setup()
            log = []
            record_events(strategy, log)
            step = strategy.optimizer.step

            def logged_step(param, *args, **kw):
                log.append(("update", param.size))
                return step(param, *args, **kw)

            strategy.optimizer.step = logged_step
            await strategy.train_step(step_batches(group.size, group.rank, 1)[0])
            return log, [m.size for m in strategy.master], strategy.collectives.pending
        finally:
            strategy.close()

    for log, shard_sizes, pending in await run_ranks(2, body):
        after_backward = log[[e[0] for e in log].index("update"):]
        G = ("launch", "all_gather")  # unit i's gather travels while units i+1, ... are updated
        assert after_backward == [e for n in shard_sizes for e in (("update", n), G)]
        assert pending == 0  # the step waited for every gather: nothing in flight between steps


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["zero1", "zero2"])
async def test_zero_replicas_are_whole_when_the_step_returns_even_with_slow_gathers(name):
    """Each all_gather starts 20 ms late and rank 1 updates slowly, so the gathers finish long
    after the update; the replicas the next forward reads must still be the reference's
    parameters when train_step returns (bit for bit equal to what full_params gathers)."""
    config = make_config()
    want = [reference_run(config, steps=k)[0] for k in (1, 2)]

    async def body(group):
        strategy = make_strategy(name, tiny_model(group.size), config, group)
        try:
            await strategy.setup()
            all_gather, step = strategy.collectives.all_gather, strategy.optimizer.step

            async def late_all_gather(out, x):
                await asyncio.sleep(0.02)
                await all_gather(out, x)

            def slow_step(*args, **kw):
                if group.rank == 1:
                    time.sleep(0.01)
                return step(*args, **kw)

            strategy.collectives.all_gather, strategy.optimizer.step = late_all_gather, slow_step
            seen = []
            for mbs in step_batches(group.size, group.rank, 1)[:2]:
                await strategy.train_step(mbs)
                seen.append([p[: u.numel].copy() for p, u in zip(strategy._compute_params(), strategy.units)])
            return seen, await strategy.full_params()
        finally:
            strategy.close()

    for seen, full in await run_ranks(3, body):
        for got, reference in zip(seen, want):
            assert_params_close(got, reference)
        for a, b in zip(seen[-1], full):
            np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
async def test_replica_check_names_the_rank_that_drifted(name):
    async def body(group):
        strategy = make_strategy(name, tiny_model(group.size), make_config(), group)
        try:
            await strategy.setup()
            await strategy.train_step(step_batches(group.size, group.rank, 1)[0])
            await strategy.check_replicas()  # identical so far
            if group.rank == 2:  # a bit flip in a replicated parameter
                strategy._compute_params()[1][3] += 1e-9
            with pytest.raises(ReplicaMismatchError) as info:
                await strategy.check_replicas()
            return info.value.ranks, str(info.value)
        finally:
            strategy.close()

    for ranks, message in await run_ranks(4, body):
        assert ranks == [2]
        assert "rank 2 holds other values than ranks 0, 1 and 3" in message


@pytest.mark.timeout(30)
async def test_ddp_checks_replicas_every_n_steps():
    """zero1/zero2 re-gather every parameter after each step, which heals a drifted replica;
    ddp never does, so its check_every catches the drift at the next checked step."""

    async def body(group):
        strategy = make_strategy("ddp", tiny_model(group.size), make_config(check_every=2), group)
        try:
            await strategy.setup()  # checks once: identical at the start
            batches = step_batches(group.size, group.rank, 1)
            await strategy.train_step(batches[0])
            if group.rank == 1:
                strategy.states[0].buffers["exp_avg"][5] *= 2  # optimizer state is replicated too
            with pytest.raises(ReplicaMismatchError) as info:
                await strategy.train_step(batches[1])  # step 2: checked
            return info.value.ranks
        finally:
            strategy.close()

    assert await run_ranks(3, body) == [[1]] * 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3"])
async def test_evaluate_equals_the_single_process_forward(name):
    config = make_config()
    want_params, _ = reference_run(config, steps=2)
    model = tiny_model()
    logits = model.forward([np.pad(p, (0, u.padded_numel - p.size)) for p, u in zip(want_params, model.units)], X,
                           EVAL)
    want_loss, _ = cross_entropy_forward(logits, Y, 1.0)
    want_correct = int((logits.argmax(axis=1) == Y).sum())

    async def body(group):
        strategy = make_strategy(name, tiny_model(group.size), config, group)
        try:
            await strategy.setup()
            for mbs in step_batches(group.size, group.rank, 1)[:2]:
                await strategy.train_step(mbs)
            rows = np.array_split(np.arange(len(X)), group.size + 1)[group.rank]  # the last part: nobody's
            return await strategy.evaluate(X[rows], Y[rows]), await strategy.evaluate(X[:0], Y[:0])
        finally:
            strategy.close()

    results = await run_ranks(3, body)
    rows = np.array_split(np.arange(len(X)), 4)
    left = rows[-1]  # evaluate the last part in the reference too, to compare sums
    left_loss, _ = cross_entropy_forward(logits[left], Y[left], 1.0)
    left_correct = int((logits[left].argmax(axis=1) == Y[left]).sum())
    np.testing.assert_allclose(sum(r[0]["loss"] for r in results), want_loss - left_loss, rtol=1e-12)
    assert sum(r[0]["accuracy"] for r in results) == want_correct - left_correct
    assert all(r[1] == {"loss": 0.0, "accuracy": 0.0} for r in results)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["ddp", "zero3"])
async def test_a_rank_that_never_arrives_fails_the_step_instead_of_hanging(name):
    async def body(group):
        strategy = make_strategy(name, tiny_model(group.size), make_config(), group)
        try:
            await strategy.setup()
            if group.rank == 1:
                raise RuntimeError("rank 1 stops before the step")
            await strategy.train_step(step_batches(group.size, group.rank, 1)[0])
        finally:
            strategy.close()

    rank0, rank1 = await run_ranks(2, body, return_exceptions=True, timeout_s=1.0)
    assert isinstance(rank1, RuntimeError)
    assert isinstance(rank0, CollectiveError), repr(rank0)  # a timeout naming rank 1, within ~1 s


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3"])
async def test_a_step_that_failed_mid_accumulation_leaves_no_gradient_behind(name):
    """The first micro-batch's backward completes, the second's labels are refused: the
    next step must not accumulate into what the failed one left."""

    async def run(fail_first: bool):
        async def body(group):
            strategy = make_strategy(name, tiny_model(group.size), make_config(grad_accum=2), group)
            try:
                await strategy.setup()
                good = step_batches(group.size, group.rank, 2)[0]
                if fail_first:
                    x, y, offset, size = good[1]
                    with pytest.raises(ValueError, match="labels must be in"):
                        await strategy.train_step([good[0], (x, y + 100, offset, size)])
                result = await strategy.train_step(good)
                return result.loss, await strategy.full_params(), strategy.memory_bytes()["transient_now"]
            finally:
                strategy.close()

        return await run_ranks(2, body)

    for (loss, params, transient), (want_loss, want_params, _) in zip(await run(True), await run(False)):
        assert loss == want_loss
        for got, want in zip(params, want_params):
            np.testing.assert_array_equal(got, want)
        assert transient == 0


def test_bad_arguments_are_refused():
    class FakeGroup:
        rank, size = 0, 3

    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        make_strategy("zero4", tiny_model(3), make_config(), FakeGroup())
    with pytest.raises(ValueError, match="TrainConfig.decay must be one of"):
        make_strategy("zero3", tiny_model(1), make_config(decay="biases"), FakeGroup())
    with pytest.raises(ValueError, match="grad_accum"):
        make_strategy("ddp", tiny_model(3), make_config(grad_accum=0), FakeGroup())
    with pytest.raises(ValueError, match="optimizer"):
        make_strategy("ddp", tiny_model(3), make_config(optimizer="lamb"), FakeGroup())
