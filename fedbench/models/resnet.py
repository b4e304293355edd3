"""BN-free ResNet-18 variants (notes/fedbens.md §3.4 and §1.8 row 14, fedfisher.md §3.4).

``resnet18_nobn`` (FedBEns, CIFAR-100 Table 9): CIFAR-style 3x3 stride-1 stem -> ReLU; four stages of
two BasicBlocks (64, 128, 256, 512 channels; strides 1, 2, 2, 2); avg_pool 4 -> linear 512 -> n_c.
No BatchNorm and no biases anywhere, including the final linear layer: that is what gives the
paper's 11,210,432 parameters for 100 classes (a biased head would give 11,210,532; biased convs
another 4,800 more).

``resnet18_mod`` (FedFisher Table 3, the Tiny-ImageNet-pretrained architecture): 7x7 stride-1 pad-1
stem (32 -> 28 pixels), the same BN-free stages, avg_pool 4, then fc 512->1000 -> linear 1000->200
-> final 200->n_c with no nonlinearity between them; bias-free, 11,880,912 parameters for 10
classes. Its pretrained weights come from ``model.pretrained`` (fedbench/models/pretrained.py).

``resnet18_tiny`` (the checkpoint's own architecture, "ResNet18_tiny", fedfisher.md §3.4): resnet18_mod without
``final``: fc 512->1000 -> linear 1000->n_c (n_c = 200 for Tiny-ImageNet); what
``scripts/pretrain_tiny_imagenet.py`` trains. All its tensors load into resnet18_mod by name.

BasicBlock: conv3x3 -> ReLU -> conv3x3, plus the shortcut (identity, or a 1x1 conv with the
block's stride when the shape changes), then ReLU. The residual addition is inside the block, so
each block is a parameter-free composition of Conv2d layers (as the batched engine requires).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn
from torch import Tensor

from fedbench.models import MODELS
from fedbench.models.base import check_classes, check_image_shape


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1, *, bias: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=bias)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=bias)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=bias))
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv2(self.relu1(self.conv1(x)))
        return self.relu2(out + self.shortcut(x))


class ResNet18NoBN(nn.Module):
    """Stem -> ReLU -> layer1..layer4 -> AvgPool2d(4) -> Flatten -> named Linear head layers.

    ``stem``: "cifar" (3x3, stride 1, pad 1) or "mod7" (7x7, stride 1, pad 1). ``head``: hidden widths
    of the linear head (no nonlinearities between them), ``head_names`` their attribute names. ``blocks`` and
    ``widths`` (blocks and channels per stage) are for tests' tiny residual nets; the registered models keep 2 x
    (64, 128, 256, 512).
    """

    def __init__(self, input_shape, num_classes: int, *, stem: str = "cifar", head: Sequence[int] = (),
                 head_names: Optional[Sequence[str]] = None, bias: bool = False, blocks: Sequence[int] = (2, 2, 2, 2),
                 widths: Sequence[int] = (64, 128, 256, 512)):
        super().__init__()
        c = input_shape[0]
        kernel = {"cifar": 3, "mod7": 7}[stem]  # mod7 = FedFisher's ResNet18_mod stem (32 -> 28 pixels)
        self.conv1 = nn.Conv2d(c, widths[0], kernel, stride=1, padding=1, bias=bias)
        self.relu = nn.ReLU()
        in_planes = widths[0]
        for i, (planes, stride) in enumerate(zip(widths, (1, 2, 2, 2))):
            layers = []
            for j in range(blocks[i]):
                layers.append(BasicBlock(in_planes, planes, stride if j == 0 else 1, bias=bias))
                in_planes = planes
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.pool = nn.AvgPool2d(4)
        self.flatten = nn.Flatten(start_dim=1)
        # head: named Linear layers 512 -> *head widths -> num_classes, applied in order
        names = list(head_names) if head_names is not None else ["linear"]
        head_widths = [widths[-1], *head, num_classes]
        if len(names) != len(head_widths) - 1:
            raise ValueError("head_names must name every head layer")
        for name, a, b in zip(names, head_widths[:-1], head_widths[1:]):
            setattr(self, name, nn.Linear(a, b, bias=bias))
        self.head_names = tuple(names)
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.conv1(x))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = self.flatten(self.pool(out))
        for name in self.head_names:  # FedFisher's head has no nonlinearity between the linear layers
            out = getattr(self, name)(out)
        return out


@MODELS.register("resnet18_nobn")
def resnet18_nobn(*, input_shape, num_classes, bias: bool = False) -> ResNet18NoBN:
    shape = check_image_shape("resnet18_nobn", input_shape, [(3, 32, 32)])
    return ResNet18NoBN(shape, check_classes("resnet18_nobn", num_classes), stem="cifar", bias=bool(bias))


@MODELS.register("resnet18_mod")
def resnet18_mod(*, input_shape, num_classes, bias: bool = False) -> ResNet18NoBN:
    shape = check_image_shape("resnet18_mod", input_shape, [(3, 32, 32)])
    return ResNet18NoBN(shape, check_classes("resnet18_mod", num_classes), stem="mod7", head=(1000, 200),
                        head_names=("fc", "linear", "final"), bias=bool(bias))


@MODELS.register("resnet18_tiny")
def resnet18_tiny(*, input_shape, num_classes, bias: bool = False) -> ResNet18NoBN:
    shape = check_image_shape("resnet18_tiny", input_shape, [(3, 32, 32)])
    return ResNet18NoBN(shape, check_classes("resnet18_tiny", num_classes), stem="mod7", head=(1000,),
                        head_names=("fc", "linear"), bias=bool(bias))
