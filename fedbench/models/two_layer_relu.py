"""FedFisher's synthetic two-layer ReLU network (notes/fedfisher.md §1.8, Sec. 3 + App. D.1).

f(x) = sum_r a_r ReLU(w_r . x), r = 1..m. Only the first layer W (``fc1``, an ``nn.Linear(p, m,
bias=False)``) is trained. The output weights a_r = +-1/sqrt(m) (each sign with probability 1/2)
are fixed and stored as the buffer ``a``; the 1/sqrt(m) is applied once (in a_r), not twice
(the note's reading of the Eq. 8 / App. D.1 ambiguity). Initialisation w_r ~ N(0, I/2) (kappa = 1/2).

Randomness: with ``a_seed: null`` (default) both a and W come from the global torch RNG, so the
model is fixed by ``torch.manual_seed`` before construction; an integer ``a_seed`` draws a from its
own generator instead (the same signs for every run seed). The output is a single real value,
shape [B, 1], for regression with the loss 1/2 (y - f)^2.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from fedbench.errors import FedbenchError
from fedbench.models import MODELS
from fedbench.models.base import check_widths
from fedbench.models.mlp import check_in_features


class TwoLayerReLU(nn.Module):
    def __init__(self, in_features: int, width: int = 512, *, a_seed: Optional[int] = None, init_std: float = 0.5 ** 0.5):
        super().__init__()
        self.flatten = nn.Flatten(start_dim=1)
        self.fc1 = nn.Linear(in_features, width, bias=False)
        self.relu = nn.ReLU()
        with torch.no_grad():
            self.fc1.weight.normal_(0.0, init_std)
        gen = torch.Generator().manual_seed(int(a_seed)) if a_seed is not None else None
        signs = torch.randint(0, 2, (width,), generator=gen).to(torch.get_default_dtype()) * 2 - 1
        self.register_buffer("a", signs / math.sqrt(width))
        self.in_features = in_features
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        h = self.relu(self.fc1(self.flatten(x)))  # [B, m]
        return (h @ self.a).unsqueeze(-1)  # [B, 1]; a is a fixed buffer, not a parameter


@MODELS.register("two_layer_relu")
def two_layer_relu(*, input_shape, num_classes=None, width: int = 512, a_seed: Optional[int] = None,
                   in_features: Optional[int] = None) -> TwoLayerReLU:
    if num_classes not in (None, 0, 1):
        raise FedbenchError(
            f"model 'two_layer_relu' has one real output (regression), got num_classes={num_classes!r}; "
            "use it with a regression data set")
    (m,) = check_widths("two_layer_relu", "width", width, length=1)
    if a_seed is not None and (isinstance(a_seed, bool) or not isinstance(a_seed, int)):
        raise FedbenchError(f"model 'two_layer_relu': a_seed must be an integer or null, got {a_seed!r}")
    return TwoLayerReLU(check_in_features("two_layer_relu", input_shape, in_features), m, a_seed=a_seed)
