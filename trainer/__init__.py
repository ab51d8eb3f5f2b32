"""ringweave trainer: NumPy models with hand-written backward, optimizers, data, strategies, the loop.

Submodules (import them directly; this file stays thin):
    trainer.nn          layers, flat-buffer units, the MLP and the GPT, losses, Numba kernels
    trainer.optim       SGD, AdamW (NumPy reference + fused Numba kernel), schedules, decay groups
    trainer.data        distributed sampler, global/local batching, data sets, digits, synthetic data
    trainer.text        the pydoc corpus, the byte tokenizer, random and consecutive windows
    trainer.precision   dtypes, casting master shards, dynamic loss scaling
    trainer.sharding    DDP, ZeRO-1/2, ZeRO-3/FSDP over the same flat-buffer model
    trainer.parallel    the dp x tp x pp mesh: tensor and pipeline parallelism of the GPT, offload
    trainer.checkpoint  sharded atomic checkpoints, loading onto any world size and strategy
                        (its files: trainer.ckptfs; its metadata's schema: trainer.ckptschema)
    trainer.runid       a run's identity and what it does with a checkpoint directory (RunError)
    trainer.loop        fit; trainer.evaluation (evaluate), trainer.history and trainer.callbacks, what it
                        reports and calls; trainer.progress and trainer.metrics, what rank 0 shows and writes
    trainer.cli         `python -m trainer`; trainer.sample and trainer.plot: `python -m trainer.sample | plot`

What it is not: no autograd, no devices; the collectives live in collectives/.
"""

__all__ = ["nn", "optim", "data", "text", "precision", "sharding", "parallel", "checkpoint", "runid", "loop",
           "evaluation", "history", "callbacks", "progress", "metrics", "cli", "sample", "plot"]
# Machinery, imported only from inside trainer/ (tests/tree/test_surfaces.py): malloc's tuning for a
# step's temporaries, the preemption handling the loop installs, the checkpoint directory's reading
# and moving that the loop and trainer.sample do for runid's decisions, the checkpoints' file
# system and metadata schema (trainer.checkpoint is their surface), and the optional packages' import.
_INTERNAL = ("allocator", "preempt", "rundir", "ckptfs", "ckptschema", "extras")
