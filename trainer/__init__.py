"""ringweave trainer: NumPy models with hand-written backward, optimizers, data, precision.

Submodules (import them directly; this file stays thin):
    trainer.nn         layers, flat-buffer units, model, loss
    trainer.optim      SGD, AdamW (NumPy reference + fused Numba kernel), schedules
    trainer.data       distributed sampler, global/local batching, digits, synthetic data
    trainer.precision  dtypes, casting master shards, dynamic loss scaling

What it is not: nothing here communicates; the sharding strategies, checkpoints
and the training loop are separate modules built on these.
"""
