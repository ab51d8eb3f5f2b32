"""trainer.nn: layers with hand-written backward, flat-buffer units, the models and their losses.

What it is: the re-exports of `context`, `layers`, `embedding`, `attention`, `loss`,
`unit`, `model`, `gpt` and `meter`. The API the sharding strategies build on, in one place:

    model = mlp(64, (256, 256), 10, dtype=np.float32)            # Model
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128))      # Model: a unit per block
    model.units                      # list[Unit], unit i has .index == i
    model.calls                      # list[Call(unit, entry, checkpoint)]: the order units run in
    model.loss                       # CrossEntropyLoss() | MSELoss() | any Loss
    unit.numel                       # unpadded; a strategy pads to its world size
    unit.param_specs                 # [ParamSpec(name, shape, offset, decay)], contiguous
    unit.views(flat)                 # {name: view}; flat has >= numel elements
    unit.forward(flat_params, x, ctx, entry) -> (out, cache)
    unit.backward(flat_params, cache, dout, flat_grad, *, entry, grads_zero) -> dx   # += into flat_grad
    model.init_params(seed) -> list[flat]      # same on every process, any padding
    model.forward_backward(params, grads, x, y, ctx, *, loss, loss_denominator, grad_scale, grads_zero,
        checkpoint, meter, before_unit_forward, after_unit_forward, before_unit_backward,
        after_unit_backward, grad_ready) -> loss
    Context(training, seed, step, batch_offset)

Layers take `ctx` in every forward and accumulate gradients into views; `grad_ready` says a
unit's gradient is complete; `Context.batch_offset` makes dropout masks independent of how the
global batch is split; layers declare their tensor-parallel split (`split`, trainer/nn/layers.py).

What it is not: no implementation lives here.
"""

from trainer.nn.attention import CausalSelfAttention, KVCache
from trainer.nn.context import EVAL, TRAIN, Context
from trainer.nn.embedding import Embedding, PositionalEmbedding
from trainer.nn.gpt import GPT, MLP, Block, GPTConfig, GPTEnds
from trainer.nn.layers import GELU, Container, Dropout, Layer, LayerNorm, Linear, ReLU, Sequential
from trainer.nn.loss import (
    CrossEntropyLoss,
    Loss,
    MSELoss,
    cross_entropy_backward,
    cross_entropy_forward,
    softmax_cross_entropy,
)
from trainer.nn.meter import ActivationMeter
from trainer.nn.model import Call, Model, Tape, mlp
from trainer.nn.unit import ParamSpec, Unit, round_up, shard_bounds

__all__ = [
    "Context", "TRAIN", "EVAL",
    "Layer", "Linear", "ReLU", "GELU", "LayerNorm", "Dropout", "Container", "Sequential",
    "Embedding", "PositionalEmbedding", "CausalSelfAttention", "KVCache",
    "MLP", "Block", "GPTEnds", "GPTConfig", "GPT",
    "Loss", "CrossEntropyLoss", "MSELoss",
    "cross_entropy_forward", "cross_entropy_backward", "softmax_cross_entropy",
    "ParamSpec", "Unit", "round_up", "shard_bounds", "Call", "Tape", "Model", "mlp", "ActivationMeter",
]
# Machinery, imported only from inside trainer/ (tests/tree/test_surfaces.py): the layers' fast kernels.
_INTERNAL = ("layer_kernels",)
