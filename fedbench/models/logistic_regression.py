"""Logistic regression for binary tasks (FedLap's UCI Credit and FLamby-Heart; notes/fedlap.md §3.2).

Flatten -> Linear(in_features, 1): one output logit, ``in_features + 1`` parameters (47 for the
46 UCI Credit features). The trainer uses BCE-with-logits whenever the output width is 1, so the
labels are {0, 1}. For more than two classes use ``softmax_regression``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch.nn as nn

from fedbench.errors import FedbenchError
from fedbench.models import MODELS
from fedbench.models.mlp import check_in_features


class LogisticRegression(nn.Sequential):
    def __init__(self, in_features: int, *, bias: bool = True):
        super().__init__(OrderedDict([("flatten", nn.Flatten(start_dim=1)),
                                      ("linear", nn.Linear(in_features, 1, bias=bias))]))
        self.in_features = in_features
        self.num_classes = 2


@MODELS.register("logistic_regression")
def logistic_regression(*, input_shape, num_classes, in_features: Optional[int] = None,
                        bias: bool = True, init: str = "default") -> LogisticRegression:
    """``init``: ``default`` (PyTorch's Linear initialisation) or ``zeros`` (w = 0, PVI's prior mean, where
    FedLap's q_g starts; set with ``+model.init=zeros``)."""
    if num_classes not in (1, 2) or isinstance(num_classes, bool):
        raise FedbenchError(
            f"model 'logistic_regression' is binary (one logit) and needs num_classes 2, got {num_classes!r}; "
            "use model=softmax_regression for more classes")
    if init not in ("default", "zeros"):
        raise FedbenchError(f"model 'logistic_regression': init must be default or zeros, got {init!r}")
    model = LogisticRegression(check_in_features("logistic_regression", input_shape, in_features), bias=bool(bias))
    if init == "zeros":
        for param in model.parameters():
            nn.init.zeros_(param)
    return model
