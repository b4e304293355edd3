"""The FedMA "simple CNN" (Wang et al. 2020) as used by FedFisher and FedBEns on SVHN / CIFAR-10 /
CINIC-10 (notes/fedfisher.md §3.3, fedbens.md §3.4).

conv1 3->32 k5 -> ReLU -> maxpool2 -> conv2 32->64 k5 -> ReLU -> maxpool2 -> flatten 1600 -> fc 512
-> ReLU -> fc 128 -> ReLU -> fc n_c. Bias-free, no BN, no dropout: 939,616 parameters for 10 classes.
"""
from __future__ import annotations

from typing import Sequence

from fedbench.models import MODELS
from fedbench.models.base import ConvPoolNet, check_classes, check_image_shape, check_widths


class FedMACNN(ConvPoolNet):
    def __init__(self, input_shape, num_classes: int, *, channels=(32, 64), hidden=(512, 128), bias: bool = False):
        super().__init__(input_shape, num_classes, channels=channels, hidden=hidden, bias=bias)


@MODELS.register("fedma_cnn")
def fedma_cnn(*, input_shape, num_classes, channels: Sequence[int] = (32, 64), hidden: Sequence[int] = (512, 128),
              bias: bool = False) -> FedMACNN:
    shape = check_image_shape("fedma_cnn", input_shape, [(3, 32, 32)])
    return FedMACNN(shape, check_classes("fedma_cnn", num_classes),
                    channels=check_widths("fedma_cnn", "channels", channels, length=2),
                    hidden=check_widths("fedma_cnn", "hidden", hidden), bias=bool(bias))
