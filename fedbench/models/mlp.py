"""Fully connected ReLU networks, flattened input (notes/fola.md §3.2, fedlap.md §3.2).

- ``mlp``: configurable ``hidden`` list (default [500, 300]); input width inferred from the data.
- ``mlp_500_300``: FOLA's MNIST-MLP 784-500-300-10, 545,810 parameters.
- ``mlp_200_100``: FedLap's MNIST/FMNIST MLP 784-200-100-10 (the "two-hidden-layer MLP" of Acar et
  al.; the activation is not stated, ReLU assumed), 178,110 parameters.
- ``softmax_regression``: no hidden layer, FOLA's "780-10" read as 784-10, 7,850 parameters.

The paper-named models check that the data has ``in_features`` = 784 inputs (1x28x28 or 784);
set ``in_features: null`` to let them take any input width. ``hidden`` can be overridden for
every name (a matching method such as PFNM builds a wider global model this way).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch.nn as nn

from fedbench.errors import FedbenchError
from fedbench.models import MODELS
from fedbench.models.base import check_classes, check_widths, fmt_shape, in_features_of, mlp_layers


class MLP(nn.Sequential):
    """Flatten(start_dim=1) -> fc1 -> ReLU -> ... -> fc{L+1} (no activation on the output)."""

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int, *, bias: bool = True):
        super().__init__(OrderedDict([("flatten", nn.Flatten(start_dim=1)),
                                      *mlp_layers(in_features, hidden, num_classes, bias=bias)]))
        self.in_features = in_features
        self.hidden = tuple(hidden)
        self.num_classes = num_classes


def check_in_features(model: str, input_shape, in_features: Optional[int]) -> int:
    got = in_features_of(input_shape)
    if got < 1:
        raise FedbenchError(f"model '{model}' needs a non-empty input shape, got {fmt_shape(input_shape) or '()'}")
    if in_features is not None and int(in_features) != got:
        raise FedbenchError(
            f"model '{model}' expects {in_features} input features (e.g. 1x28x28 or {in_features}), got "
            f"{fmt_shape(input_shape)} = {got}; pick a model that fits the data set or set model.in_features=null")
    return got


def _build(model: str, input_shape, num_classes, hidden, in_features, bias) -> MLP:
    d = check_in_features(model, input_shape, in_features)
    hidden = check_widths(model, "hidden", hidden)
    return MLP(d, hidden, check_classes(model, num_classes), bias=bool(bias))


@MODELS.register("mlp")
def mlp(*, input_shape, num_classes, hidden: Sequence[int] = (500, 300), in_features: Optional[int] = None,
        bias: bool = True) -> MLP:
    return _build("mlp", input_shape, num_classes, hidden, in_features, bias)


@MODELS.register("mlp_500_300")
def mlp_500_300(*, input_shape, num_classes, hidden: Sequence[int] = (500, 300), in_features: Optional[int] = 784,
                bias: bool = True) -> MLP:
    return _build("mlp_500_300", input_shape, num_classes, hidden, in_features, bias)


@MODELS.register("mlp_200_100")
def mlp_200_100(*, input_shape, num_classes, hidden: Sequence[int] = (200, 100), in_features: Optional[int] = 784,
                bias: bool = True) -> MLP:
    return _build("mlp_200_100", input_shape, num_classes, hidden, in_features, bias)


@MODELS.register("softmax_regression")
def softmax_regression(*, input_shape, num_classes, in_features: Optional[int] = 784, bias: bool = True) -> MLP:
    return _build("softmax_regression", input_shape, num_classes, (), in_features, bias)
