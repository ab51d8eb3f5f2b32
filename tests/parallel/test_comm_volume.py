"""Bytes on the wire per step against the Megatron-LM formulas, read from the runtime's own counters
(each connection's bytes and frames sent), and the micro-batches of activations each schedule holds.

Per micro-batch of b rows, s positions, width h, L blocks, itemsize e, a tp all-reduce of n bytes
costs each rank 2 (t - 1) / t n (ring; at t = 2 every algorithm sends n). The step's tp all-reduces:

    forward    1 (vocabulary-parallel embedding) + 2 per block (attention's and the MLP's g)
    backward   2 per block (their f) + 1 (the head's f);  + 2 per block again when activation
               checkpointing runs the forward a second time
    loss       the max, then [sum of exp, target logit], of b s rows each

and between two stages each micro-batch sends b s h e bytes forward and as many back; the first and
last stage also all-reduce the tied embedding's gradient (its numel x e at 2 ranks). Measured =
payload + one frame header per frame sent, so the test asserts payload <= sent <= payload + frames x
128 bytes (plus the step's 3-number statistics all-reduce).
"""

import numpy as np
import pytest

from runtime.testing import run_ranks
from trainer.data import iter_local_batches
from trainer.nn import GPT, GPTConfig
from trainer.parallel import Mesh, ParallelConfig, make_parallel_strategy
from trainer.sharding import TrainConfig
from trainer.text import RandomWindows

CONFIG = GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=4, n_embd=8, dropout=0.1)
WINDOWS = RandomWindows(np.random.default_rng(1).integers(0, 11, size=200), 4, num_windows=16, seed=2)
ROWS, E = 8, 8  # global batch of 8 windows, float64
HEADER_MAX = 128  # bytes of a frame's prefix and header, at most (measured: 88 to 102)
STATS = 3 * E * 2  # the step's [loss, inf, sum of squares] all-reduce, at most twice its bytes per rank


def tp_payload(t: int, checkpointing: bool, stage: int = 0, pp: int = 1) -> float:
    """Bytes one rank of pipeline stage ``stage`` sends in the step's tp all-reduces (module docstring),
    all micro-batches together (the blocks split evenly over the stages)."""
    s, h, L = CONFIG.block_size, CONFIG.n_embd, CONFIG.n_layer // pp
    first, last = stage == 0, stage == pp - 1
    activations = ROWS * s * h * (int(first) + 4 * L + int(last) + (2 * L if checkpointing else 0))
    loss = ROWS * s * 3 if last else 0
    return 2 * (t - 1) / t * (activations + loss) * E


async def run_step(dp, tp, pp, schedule, m, checkpointing):
    config = TrainConfig(param_dtype="float64", reduce_dtype="float64", master_dtype="float64",
                         activation_checkpointing=checkpointing)

    async def body(world):
        world.runtime.shm_enabled = False  # every byte on a connection, where the counters are
        mesh = Mesh(world, dp=dp, tp=tp, pp=pp)
        s = make_parallel_strategy("ddp", CONFIG, config, mesh, parallel=ParallelConfig(schedule, m))
        conns = world.runtime.actor.conns
        try:
            await s.setup()
            batch = next(iter_local_batches(len(WINDOWS), ROWS, dp, mesh.coords["dp"], seed=0))
            before = {p: c.statistics() for p, c in conns.items()}
            result = await s.train_step([(*WINDOWS.get(batch.indices), batch.offset, batch.global_size)])
            after = {p: c.statistics() for p, c in conns.items()}
            sent = {p: (after[p].bytes_sent - before[p].bytes_sent, after[p].frames_sent - before[p].frames_sent)
                    for p in conns}
            index, run = s.model_parallel.global_index, s.model_parallel.last_run
            ends = s.units[index.index(0)].numel if 0 in index else 0  # this tp rank's cut
            return mesh.coords, sent, result, run.in_flight_peak, s.memory_bytes()["activations_peak"], ends
        finally:
            s.close()

    return await run_ranks(dp * tp * pp, body)


def assert_payload(sent_bytes: int, frames: int, payload: float) -> None:
    assert payload <= sent_bytes <= payload + frames * HEADER_MAX + STATS, (sent_bytes, frames, payload)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule, checkpointing", [("1f1b", True), ("gpipe", False)])
async def test_tp_and_pp_bytes_per_step_match_the_formulas(schedule, checkpointing):
    for rank, (coords, sent, result, _, _, numel_ends) in enumerate(await run_step(1, 2, 2, schedule, 4,
                                                                                   checkpointing)):
        assert numel_ends < GPT(CONFIG).units[0].numel  # the vocabulary is cut
        tp_peer, pp_peer = rank ^ 1, rank ^ 2  # tp2 x pp2: tp groups [0, 1] [2, 3], pp groups [0, 2] [1, 3]
        assert_payload(*sent[tp_peer], tp_payload(2, checkpointing, coords["pp"], 2))
        between_stages = ROWS * CONFIG.block_size * CONFIG.n_embd * E  # m micro-batches, one way
        assert_payload(*sent[pp_peer], between_stages + numel_ends * E)  # + the tied embedding's gradient
        assert sent[rank ^ 3] == (0, 0) or sent[rank ^ 3][0] <= STATS + 2 * HEADER_MAX  # nothing else
        # the strategy's own accounting (the ring's volume) says the same
        assert result.comm_bytes_by_dim["tp"] == tp_payload(2, checkpointing, coords["pp"], 2)
        assert result.comm_bytes_by_dim["pp"] == between_stages + numel_ends * E


@pytest.mark.timeout(60)
async def test_tp4_ring_all_reduces_send_2_t_minus_1_over_t_of_each_array(monkeypatch):
    monkeypatch.setenv("RINGWEAVE_ALGO_ALL_REDUCE", "ring")  # Megatron's formula is the ring's
    for coords, sent, result, _, _, _ in await run_step(1, 4, 1, "1f1b", 2, False):
        total, frames = (sum(v[k] for v in sent.values()) for k in (0, 1))
        assert_payload(total, frames, tp_payload(4, False))
        assert result.comm_bytes_by_dim["tp"] == tp_payload(4, False)


@pytest.mark.timeout(60)
async def test_1f1b_holds_at_most_pp_micro_batches_on_the_first_stage_and_gpipe_all_of_them():
    pp, m = 2, 4
    peaks = {}
    for schedule in ("1f1b", "gpipe"):
        out = await run_step(1, 1, pp, schedule, m, False)
        peaks[schedule] = [(in_flight, activations) for _, _, _, in_flight, activations, _ in out]
    assert peaks["1f1b"][0][0] == pp and peaks["gpipe"][0][0] == m  # the first stage
    assert peaks["1f1b"][1][0] == 1 and peaks["gpipe"][1][0] == m  # the last stage
    # the activation bytes follow: m / pp times as many under GPipe (equal micro-batches)
    assert peaks["gpipe"][0][1] == pytest.approx(peaks["1f1b"][0][1] * m / pp, rel=0.01)

