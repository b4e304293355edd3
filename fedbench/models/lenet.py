"""FedFisher / FedBEns LeNet for Fashion-MNIST (notes/fedfisher.md §3.3, fedbens.md §3.4).

conv1 1->6 k5 -> ReLU -> maxpool2 -> conv2 6->16 k5 -> ReLU -> maxpool2 -> flatten 256 -> fc 120
-> ReLU -> fc 84 -> ReLU -> fc n_c. Bias-free everywhere (the released code builds every layer with
``bias=False`` for OTFusion compatibility), no BN, no dropout: 44,190 parameters for 10 classes.
``bias=true`` gives the biased variant (which is NIID-Bench's SimpleCNN-MNIST).
"""
from __future__ import annotations

from typing import Sequence

from fedbench.models import MODELS
from fedbench.models.base import ConvPoolNet, check_classes, check_image_shape, check_widths


class LeNet(ConvPoolNet):
    def __init__(self, input_shape, num_classes: int, *, channels=(6, 16), hidden=(120, 84), bias: bool = False):
        super().__init__(input_shape, num_classes, channels=channels, hidden=hidden, bias=bias)


@MODELS.register("lenet")
def lenet(*, input_shape, num_classes, channels: Sequence[int] = (6, 16), hidden: Sequence[int] = (120, 84),
          bias: bool = False) -> LeNet:
    shape = check_image_shape("lenet", input_shape, [(1, 28, 28)])
    return LeNet(shape, check_classes("lenet", num_classes),
                 channels=check_widths("lenet", "channels", channels, length=2),
                 hidden=check_widths("lenet", "hidden", hidden), bias=bool(bias))
