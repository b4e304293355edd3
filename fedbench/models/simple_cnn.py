"""NIID-Bench's "simple CNN with 5 layers" (FedLPA and its baselines; notes/fedlpa.md §3 "Model").

conv(k5, 6) -> ReLU -> maxpool2 -> conv(k5, 16) -> ReLU -> maxpool2 -> flatten -> fc 120 -> ReLU
-> fc 84 -> ReLU -> fc n_c, with biases, no BN, no dropout, PyTorch default initialisation.
The variant follows the input: 1x28x28 (MNIST / FMNIST, flatten 256, 44,426 parameters) or
3x32x32 (CIFAR-10 / SVHN, flatten 400, 62,006 parameters).
"""
from __future__ import annotations

from typing import Sequence

from fedbench.models import MODELS
from fedbench.models.base import ConvPoolNet, check_classes, check_image_shape, check_widths

VARIANTS = {(1, 28, 28): "mnist", (3, 32, 32): "cifar"}


class SimpleCNN(ConvPoolNet):
    """NIID-Bench SimpleCNN / SimpleCNNMNIST; ``variant`` is 'mnist' or 'cifar'."""

    def __init__(self, input_shape, num_classes: int, *, channels=(6, 16), hidden=(120, 84), bias: bool = True):
        super().__init__(input_shape, num_classes, channels=channels, hidden=hidden, bias=bias)
        self.variant = VARIANTS.get(tuple(input_shape), "custom")


@MODELS.register("simple_cnn")
def simple_cnn(*, input_shape, num_classes, channels: Sequence[int] = (6, 16), hidden: Sequence[int] = (120, 84),
               bias: bool = True) -> SimpleCNN:
    shape = check_image_shape("simple_cnn", input_shape, VARIANTS)
    return SimpleCNN(shape, check_classes("simple_cnn", num_classes),
                     channels=check_widths("simple_cnn", "channels", channels, length=2),
                     hidden=check_widths("simple_cnn", "hidden", hidden), bias=bool(bias))
