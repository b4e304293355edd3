"""Shared building blocks and input checks for the model zoo.

Every model obeys one contract, which the batched training engine (``fedbench.train.stacked``)
relies on: all trainable parameters live in ``nn.Linear`` or ``nn.Conv2d`` layers; every other
module is parameter-free and acts per sample (ReLU, pooling, Flatten(start_dim=1), Dropout,
residual additions inside block modules); fixed tensors are buffers. No normalisation layers.

Most models here are ``nn.Sequential`` subclasses with named layers (``conv1``, ``fc1``, ...), so
layer-wise methods (K-FAC, PFNM, OTFusion) can walk them in order and parameter names read well.
"""
from __future__ import annotations

from collections import OrderedDict
from math import prod
from typing import Iterable, List, Optional, Sequence, Tuple

import torch.nn as nn

from fedbench.errors import FedbenchError

Shape = Tuple[int, ...]


def fmt_shape(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


def check_image_shape(model: str, input_shape: Shape, allowed: Iterable[Shape]) -> Shape:
    """Return ``input_shape`` if it is one of ``allowed`` (C, H, W) shapes, else a one-line error."""
    allowed = [tuple(a) for a in allowed]
    if tuple(input_shape) not in allowed:
        want = " or ".join(fmt_shape(a) for a in allowed)
        raise FedbenchError(
            f"model '{model}' expects input of shape {want} (C x H x W), got {fmt_shape(input_shape) or '()'}; "
            "pick a model that fits the data set")
    return tuple(input_shape)


def check_classes(model: str, num_classes, *, minimum: int = 2) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < minimum:
        raise FedbenchError(
            f"model '{model}' needs num_classes >= {minimum} (a classification data set), got {num_classes!r}")
    return num_classes


def check_widths(model: str, key: str, values, *, length: Optional[int] = None) -> Tuple[int, ...]:
    """Validate a width option (an int or a list of positive ints); returns a tuple."""
    if isinstance(values, int) and not isinstance(values, bool):
        values = (values,)
    try:
        out = tuple(values)
    except TypeError:
        out = None
    if out is None or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in out):
        raise FedbenchError(f"model '{model}': {key} must be a list of positive integers, got {values!r}")
    if length is not None and len(out) != length:
        raise FedbenchError(f"model '{model}': {key} must have {length} entries, got {list(out)}")
    return out


def mlp_layers(in_features: int, hidden: Sequence[int], out_features: int, *, bias: bool = True,
               first_index: int = 1, dropout: float = 0.0) -> List[Tuple[str, nn.Module]]:
    """Named ``fc{i}`` / ``relu{i}`` layers of a ReLU MLP head (no activation after the last layer)."""
    layers: List[Tuple[str, nn.Module]] = []
    widths = [in_features, *hidden, out_features]
    for i in range(len(widths) - 1):
        idx = first_index + i
        layers.append((f"fc{idx}", nn.Linear(widths[i], widths[i + 1], bias=bias)))
        if i < len(widths) - 2:
            layers.append((f"relu_fc{idx}", nn.ReLU()))
            if dropout > 0:
                layers.append((f"drop_fc{idx}", nn.Dropout(dropout)))
    return layers


class ConvPoolNet(nn.Sequential):
    """Two (conv k5 -> ReLU -> maxpool 2) stages, flatten, then a ReLU MLP head.

    The LeNet-5 topology shared by NIID-Bench's SimpleCNN (FedLPA), FedFisher/FedBEns's LeNet and
    FedMA CNN, and FOLA's BasicCNN; they differ only in widths, biases and initialisation.
    ``channels`` (2 ints) and ``hidden`` (any number of ints) are the widths a matching method
    (PFNM) may enlarge; the output layer always has ``num_classes`` units.
    """

    def __init__(self, input_shape: Shape, num_classes: int, *, channels: Sequence[int], hidden: Sequence[int],
                 bias: bool = True, kernel_size: int = 5):
        c, h, w = input_shape
        c1, c2 = channels
        oh = ((h - kernel_size + 1) // 2 - kernel_size + 1) // 2
        ow = ((w - kernel_size + 1) // 2 - kernel_size + 1) // 2
        layers: List[Tuple[str, nn.Module]] = [
            ("conv1", nn.Conv2d(c, c1, kernel_size, bias=bias)),
            ("relu1", nn.ReLU()),
            ("pool1", nn.MaxPool2d(2, 2)),
            ("conv2", nn.Conv2d(c1, c2, kernel_size, bias=bias)),
            ("relu2", nn.ReLU()),
            ("pool2", nn.MaxPool2d(2, 2)),
            ("flatten", nn.Flatten(start_dim=1)),
            *mlp_layers(c2 * oh * ow, hidden, num_classes, bias=bias),
        ]
        super().__init__(OrderedDict(layers))
        self.input_shape = tuple(input_shape)
        self.channels = tuple(channels)
        self.hidden = tuple(hidden)
        self.num_classes = num_classes


def in_features_of(input_shape: Shape) -> int:
    return int(prod(input_shape)) if len(input_shape) else 0
