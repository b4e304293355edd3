"""Model zoo of the five papers, registered by name (``conf/model/<name>.yaml`` picks one).

``build_model(name, input_shape=..., num_classes=..., **kwargs)`` checks that the model fits the
data (one-line ``FedbenchError`` otherwise) and builds it with the global torch RNG, so
``torch.manual_seed`` before the call fixes the initial weights.

``model.pretrained=<path>`` (any model; a key of resnet18_mod/resnet18_nobn's YAML, ``+model.pretrained=`` for
the others) loads a checkpoint over the seeded initialisation: fedbench/models/pretrained.py.

Contract for every model (the batched engine depends on it): all trainable parameters live in
``nn.Linear`` / ``nn.Conv2d`` layers; everything else is parameter-free and per sample; fixed
tensors are buffers; no BatchNorm / LayerNorm. Inputs: float [B, C, H, W] images or [B, D] rows.

| name | paper / note | input | params (10 classes unless noted) |
|---|---|---|---|
| simple_cnn | FedLPA (NIID-Bench SimpleCNN) | 1x28x28 / 3x32x32 | 44,426 / 62,006 |
| lenet | FedFisher, FedBEns (bias-free) | 1x28x28 | 44,190 |
| fedma_cnn | FedFisher, FedBEns (bias-free) | 3x32x32 | 939,616 |
| mlp, mlp_500_300, mlp_200_100 | FOLA, FedLap | any (784 for the named ones) | 545,810 / 178,110 |
| softmax_regression | FOLA "780-10" | 784 | 7,850 |
| logistic_regression | FedLap (binary, one logit) | D | D + 1 |
| fola_cnn | FOLA BasicCNN (xavier, zero bias) | 3x32x32 | 878,538 |
| cifarnet | FedLap (FROMP CifarNet) | 3x32x32 | 1,250,858 |
| resnet18_nobn | FedBEns CIFAR-100 (bias-free) | 3x32x32 | 11,210,432 (100 classes) |
| resnet18_mod | FedFisher Table 3 (bias-free) | 3x32x32 | 11,880,912 |
| resnet18_tiny | FedFisher's Tiny-ImageNet pretraining architecture | 3x32x32 | 11,878,912 (200 classes) |
| two_layer_relu | FedFisher synthetic | p | m * p |
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch.nn as nn

from fedbench.errors import FedbenchError
from fedbench.registry import Registry

MODELS: Registry[Callable[..., nn.Module]] = Registry("model")


def _as_shape(name: str, input_shape) -> tuple:
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        shape = None
    if shape is None or any(s < 1 for s in shape):
        raise FedbenchError(f"model '{name}': input_shape must be a tuple of positive integers, got {input_shape!r}")
    return shape


def build_model(name: str, *, input_shape: tuple, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build model ``name`` for per-sample inputs of ``input_shape`` and ``num_classes`` outputs.

    ``kwargs`` are the model's options (the keys of ``conf/model/<name>.yaml`` other than ``name``);
    unknown options and data that does not fit the model raise a one-line ``FedbenchError``.
    """
    factory = MODELS.get(name)
    shape = _as_shape(name, input_shape)
    options = [p for p in inspect.signature(factory).parameters if p not in ("input_shape", "num_classes")]
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        raise FedbenchError(
            f"model '{name}' has no option(s) {', '.join(unknown)}; its options are: {', '.join(options) or 'none'}")
    return factory(input_shape=shape, num_classes=num_classes, **kwargs)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalar parameters (buffers such as two_layer_relu's fixed ``a`` are not counted)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# Importing the families registers them.
from fedbench.models import (  # noqa: E402,F401
    cifarnet,
    fedma_cnn,
    fola_cnn,
    lenet,
    logistic_regression,
    mlp,
    resnet,
    simple_cnn,
    two_layer_relu,
)

__all__ = ["MODELS", "build_model", "count_parameters"]
