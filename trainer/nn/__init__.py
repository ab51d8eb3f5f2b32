"""trainer.nn: layers with hand-written backward, flat-buffer units, the model and its loss.

What it is: the re-exports of `context`, `layers`, `loss`, `unit` and `model`.
The API the sharding strategies build on, in one place:

    model = mlp(64, (256, 256), 10, pad_to=world_size, dtype=np.float32)   # Model
    model.units                      # list[Unit], unit i has .index == i
    unit.numel, unit.padded_numel    # unpadded / padded to a multiple of pad_to
    unit.param_specs                 # [ParamSpec(name, shape, offset)], contiguous
    unit.views(flat)                 # {name: view}; unit.shard_slice(rank, world)
    unit.forward(flat_params, x, ctx) -> (out, cache)
    unit.backward(flat_params, cache, dout, flat_grad, *, grads_zero) -> dx   # += into flat_grad
    model.init_params(seed) -> list[flat]      # same on every process, any pad_to
    model.zeros() -> list[flat]                # gradient buffers
    model.forward_backward(params, grads, x, y, ctx, *, loss_denominator, grad_scale, grads_zero,
        before_unit_forward, after_unit_forward, before_unit_backward, after_unit_backward) -> loss
    Context(training, seed, step, batch_offset)

Beyond the original brief: layers take `ctx` in every forward (so containers
need not know which children are random) and accumulate gradients into views
instead of returning them; the model also offers `after_unit_forward` and
`before_unit_backward` hooks (FSDP frees after forward and re-gathers before
backward); `Context.batch_offset` makes dropout masks independent of how the
global batch is split; `grad_scale` carries the loss scale.

What it is not: no implementation lives here.
"""

from trainer.nn.context import EVAL, TRAIN, Context
from trainer.nn.layers import GELU, Dropout, Layer, LayerNorm, Linear, ReLU, Sequential
from trainer.nn.loss import cross_entropy_backward, cross_entropy_forward, softmax_cross_entropy
from trainer.nn.model import Model, mlp
from trainer.nn.unit import ParamSpec, Unit, round_up

__all__ = [
    "Context", "TRAIN", "EVAL",
    "Layer", "Linear", "ReLU", "GELU", "LayerNorm", "Dropout", "Sequential",
    "cross_entropy_forward", "cross_entropy_backward", "softmax_cross_entropy",
    "ParamSpec", "Unit", "round_up", "Model", "mlp",
]
