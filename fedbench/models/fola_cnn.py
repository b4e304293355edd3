"""FOLA's CIFAR10-CNN, ``BasicCNN`` in the released code (notes/fola.md §3.2).

conv1 3->32 k5 -> ReLU -> maxpool2 -> conv2 32->64 k5 -> ReLU -> maxpool2 -> flatten 1600 -> fc 512
-> ReLU -> fc n_c, with biases; no BN, no dropout. Initialisation as the paper's code: xavier_uniform
on every weight, zeros on every bias. 878,538 parameters for 10 classes.
"""
from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from fedbench.models import MODELS
from fedbench.models.base import ConvPoolNet, check_classes, check_image_shape, check_widths


class BasicCNN(ConvPoolNet):
    def __init__(self, input_shape, num_classes: int, *, channels=(32, 64), hidden=(512,)):
        super().__init__(input_shape, num_classes, channels=channels, hidden=hidden, bias=True)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)


@MODELS.register("fola_cnn")
def fola_cnn(*, input_shape, num_classes, channels: Sequence[int] = (32, 64), hidden: Sequence[int] = (512,)) -> BasicCNN:
    shape = check_image_shape("fola_cnn", input_shape, [(3, 32, 32)])
    return BasicCNN(shape, check_classes("fola_cnn", num_classes),
                    channels=check_widths("fola_cnn", "channels", channels, length=2),
                    hidden=check_widths("fola_cnn", "hidden", hidden))
