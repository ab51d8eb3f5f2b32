"""One helper for the compressed-trainer tests: train the default model (`python -m trainer`:
digits, MLP 64-256-256-10) on in-process ranks with the CLI's arguments."""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits

from runtime.testing import run_ranks
from trainer.cli import load_data, make_config, parse_args
from trainer.loop import fit, steps_per_epoch
from trainer.nn import mlp
from trainer.sharding import make_strategy


async def train(argv: list[str], world: int = 2) -> dict:
    """Rank 0's last-epoch record (val_acc, val_loss, ...) plus ``comm_bytes`` (all ranks, the run)
    and ``params`` (the full parameters), after checking that every rank ended with the same
    parameters (each decodes the same payloads) and the same record."""
    args = parse_args(["--quiet", "--no-eval-train", *argv])
    data = load_data(args)

    async def body(group):
        spe = steps_per_epoch(len(data.x_train), args.batch_size, args.grad_accum)
        config = make_config(args, spe)
        model = mlp(data.in_dim, (args.width,) * args.depth, data.num_classes, activation=args.activation,
                    dropout=args.dropout, pad_to=group.size, dtype=np.float32)
        strategy = make_strategy(args.strategy, model, config, group)
        try:
            await strategy.setup()
            history = await fit(strategy, data, config, epochs=args.epochs, global_batch_size=args.batch_size,
                                log_every=0, eval_train=False, group=group)
            params = await strategy.full_params()
        finally:
            strategy.close()
        return dict(history.as_dict()["epochs"][-1], comm_bytes=history.comm_bytes, params=params)

    with threadpool_limits(limits=1, user_api="blas"):
        results = await run_ranks(world, body, timeout_s=60)
    for r in results[1:]:
        assert r["val_acc"] == results[0]["val_acc"]
        for a, b in zip(r["params"], results[0]["params"]):
            np.testing.assert_array_equal(a, b)
    return results[0]
