"""FROMP's ``CifarNet`` (Pan et al. 2020 / Zenke et al. 2017), FedLap's CIFAR-10 model
(notes/fedlap.md §3.2), with a single n_c-way head instead of FROMP's multi-head output.

conv 3->32 k3 pad1 -> ReLU -> conv 32->32 k3 -> ReLU -> maxpool2 -> Dropout(0.25)
-> conv 32->64 k3 pad1 -> ReLU -> conv 64->64 k3 -> ReLU -> maxpool2 -> Dropout(0.25)
-> flatten 2304 -> fc 512 -> ReLU -> Dropout(0.5) -> fc n_c.   1,250,858 parameters for 10 classes.

``dropout`` (default true, as in FROMP) switches all three dropout layers; whether the FedLap
experiments kept dropout is not stated, and it interacts with GGN / Laplace curvature.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List, Tuple

import torch.nn as nn

from fedbench.errors import FedbenchError
from fedbench.models import MODELS
from fedbench.models.base import check_classes, check_image_shape, check_widths


class CifarNet(nn.Sequential):
    def __init__(self, input_shape, num_classes: int, *, dropout: bool = True, hidden: int = 512):
        c = input_shape[0]

        def drop(p: float, name: str) -> List[Tuple[str, nn.Module]]:
            return [(name, nn.Dropout(p))] if dropout else []

        super().__init__(OrderedDict([
            ("conv1", nn.Conv2d(c, 32, 3, padding=1)), ("relu1", nn.ReLU()),
            ("conv2", nn.Conv2d(32, 32, 3)), ("relu2", nn.ReLU()), ("pool1", nn.MaxPool2d(2, 2)),
            *drop(0.25, "drop1"),
            ("conv3", nn.Conv2d(32, 64, 3, padding=1)), ("relu3", nn.ReLU()),
            ("conv4", nn.Conv2d(64, 64, 3)), ("relu4", nn.ReLU()), ("pool2", nn.MaxPool2d(2, 2)),
            *drop(0.25, "drop2"),
            ("flatten", nn.Flatten(start_dim=1)),
            ("fc1", nn.Linear(64 * 6 * 6, hidden)), ("relu_fc1", nn.ReLU()),
            *drop(0.5, "drop_fc1"),
            ("fc2", nn.Linear(hidden, num_classes)),
        ]))
        self.input_shape = tuple(input_shape)
        self.dropout = bool(dropout)
        self.num_classes = num_classes


@MODELS.register("cifarnet")
def cifarnet(*, input_shape, num_classes, dropout: bool = True, hidden: int = 512) -> CifarNet:
    shape = check_image_shape("cifarnet", input_shape, [(3, 32, 32)])
    if not isinstance(dropout, bool):
        raise FedbenchError(f"model 'cifarnet': dropout must be true or false, got {dropout!r}")
    (h,) = check_widths("cifarnet", "hidden", hidden, length=1)
    return CifarNet(shape, check_classes("cifarnet", num_classes), dropout=dropout, hidden=h)
