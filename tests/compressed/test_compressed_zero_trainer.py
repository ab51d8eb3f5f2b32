"""ZeRO / FSDP with compressed gradient reduce_scatter (ZeRO++'s qgZ): training the default model
(`python -m trainer`: digits, MLP 64-256-256-10, AdamW) on 2 in-process ranks, against the same
strategy uncompressed.

The exact path (compression off) is held bit for bit to the single-process reference by
test_equivalence.py; here the codec must actually be used (fewer bytes, other numbers), and the
run must end close to the uncompressed one.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.testing import run_ranks
from tests.compressed.trainer_runs import train as _train
from trainer.cli import make_config, parse_args
from trainer.nn import mlp
from trainer.sharding import make_strategy

pytestmark = pytest.mark.timeout(180)


async def test_zero2_int8_trains_like_uncompressed():
    base = await _train(["--strategy", "zero2"])
    int8 = await _train(["--strategy", "zero2", "--compression", "int8"])
    print(f"zero2 none: val_loss {base['val_loss']:.4f} val_acc {base['val_acc']:.4f} bytes {base['comm_bytes']}; "
          f"int8: val_loss {int8['val_loss']:.4f} val_acc {int8['val_acc']:.4f} bytes {int8['comm_bytes']}")
    assert base["val_acc"] >= 0.97
    assert int8["val_acc"] >= base["val_acc"] - 0.01
    assert int8["val_loss"] <= base["val_loss"] * 1.1 + 0.01
    assert not all(np.array_equal(a, b) for a, b in zip(int8["params"], base["params"]))  # the codec was used
    # gradients: int8 + one float32 scale per 256-element block instead of float32, the all_gather of the
    # parameters unchanged: the run sends between 1/2 and 2/3 of the uncompressed bytes
    assert 0.5 * base["comm_bytes"] < int8["comm_bytes"] < 0.67 * base["comm_bytes"]


@pytest.mark.parametrize("strategy", ["zero1", "zero3", "fsdp"])
async def test_other_sharded_strategies_take_the_codec(strategy):
    """One epoch with error-feedback int8: runs, the replicas agree, fewer bytes than exact."""
    base = await _train(["--strategy", strategy, "--epochs", "1"])
    int8 = await _train(["--strategy", strategy, "--epochs", "1", "--compression", "int8+ef"])
    assert int8["val_acc"] >= base["val_acc"] - 0.03
    # zero1: gradients are half the bytes (int8: ~0.63 of exact); zero3/fsdp gather twice, a third (~0.75)
    assert int8["comm_bytes"] < 0.8 * base["comm_bytes"]


@pytest.mark.parametrize("strategy,why", [
    ("zero2", "powersgd"),  # zero reduce-scatters block by block; powersgd compresses whole matrices
])
async def test_powersgd_is_refused_at_construction(strategy, why):
    async def body(group):
        with pytest.raises(ValueError, match=why):
            make_strategy(strategy, mlp(4, (8,), 2, pad_to=group.size),
                          make_config(parse_args(["--compression", "powersgd"]), 1), group)
    await run_ranks(2, body)


def test_a_codec_option_that_is_not_a_number_names_the_spec_and_option():
    from trainer.sharding import make_codec
    with pytest.raises(ValueError, match=r"'topk:ratio=abc'.*'ratio'.*'abc'"):
        make_codec("topk:ratio=abc")
