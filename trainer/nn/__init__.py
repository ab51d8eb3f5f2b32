"""trainer.nn: layers with hand-written backward, flat-buffer units, the model and its loss.

What it is: the re-exports of `context`, `layers`, `loss`, `unit` and `model`;
read `unit.py` for the flat-buffer contract the sharding strategies build on and
`model.py` for the hooks. What it is not: no implementation lives here.
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
