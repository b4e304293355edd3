"""Run K copies of one architecture, each with its own weights, as one computation.

The batched engine keeps every client's parameters stacked along a leading client axis
([K, *shape]) and feeds the K clients' batches concatenated along the sample axis
([K*B, ...]). Parameter-free layers (ReLU, pooling, flatten, dropout, residual adds) act
per sample, so only ``nn.Linear`` and ``nn.Conv2d`` need a client-aware kernel. This is the
same computation ``vmap(functional_call)`` performs, but with the kernel for each layer
chosen explicitly: under vmap a convolution always becomes a grouped convolution, and on
CPU that is several times slower than separate convolutions for some shapes (LeNet conv1,
see DESIGN.md), so each convolution picks grouped / im2col+matmul / per-client loop by
measurement on the device it runs on.
"""
from __future__ import annotations

import copy
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fedbench.errors import FedbenchError

CONV_STRATEGIES = ("grouped", "unfold", "loop")


class StackedLinear(nn.Module):
    def __init__(self, layer: nn.Linear, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.has_bias = layer.bias is not None
        self.params: Dict[str, Tensor] = {}

    def forward(self, x: Tensor) -> Tensor:
        w = self.params[self.prefix + "weight"]  # [K, out, in]
        k = w.shape[0]
        lead = x.shape[:-1]
        xk = x.reshape(k, -1, x.shape[-1])
        if self.has_bias:
            out = torch.baddbmm(self.params[self.prefix + "bias"].unsqueeze(1), xk, w.transpose(1, 2))
        else:
            out = torch.bmm(xk, w.transpose(1, 2))
        return out.reshape(*lead, w.shape[1])


class StackedConv2d(nn.Module):
    def __init__(self, layer: nn.Conv2d, prefix: str, strategy: str = "grouped"):
        super().__init__()
        if layer.groups != 1 or layer.padding_mode != "zeros" or isinstance(layer.padding, str):
            raise FedbenchError(
                f"batched backend supports plain Conv2d (groups=1, zero numeric padding); layer '{prefix[:-1]}' is not: "
                "use hardware.backend=serial")
        self.prefix = prefix
        self.has_bias = layer.bias is not None
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation
        self.kernel_size = layer.kernel_size
        self.strategy = strategy
        self.params: Dict[str, Tensor] = {}

    def forward(self, x: Tensor) -> Tensor:
        w = self.params[self.prefix + "weight"]  # [K, O, C, kh, kw]
        b = self.params.get(self.prefix + "bias") if self.has_bias else None
        return stacked_conv2d(x, w, b, self.stride, self.padding, self.dilation, self.strategy)


def stacked_conv2d(x: Tensor, w: Tensor, b: Optional[Tensor], stride, padding, dilation, strategy: str) -> Tensor:
    k, o, c, kh, kw = w.shape
    n = x.shape[0]
    bsz = n // k
    if strategy == "loop":
        xs = x.reshape(k, bsz, *x.shape[1:])
        outs = [F.conv2d(xs[i], w[i], None if b is None else b[i], stride, padding, dilation) for i in range(k)]
        return torch.cat(outs, 0)
    if strategy == "grouped":
        h, wd = x.shape[-2:]
        xg = x.reshape(k, bsz, c, h, wd).transpose(0, 1).reshape(bsz, k * c, h, wd)
        out = F.conv2d(xg, w.reshape(k * o, c, kh, kw), None if b is None else b.reshape(k * o),
                       stride, padding, dilation, groups=k)
        ho, wo = out.shape[-2:]
        return out.reshape(bsz, k, o, ho, wo).transpose(0, 1).reshape(n, o, ho, wo)
    if strategy == "unfold":
        h, wd = x.shape[-2:]
        cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # [N, C*kh*kw, L]
        ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        wo = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        out = torch.matmul(w.reshape(k, 1, o, c * kh * kw), cols.reshape(k, bsz, c * kh * kw, -1))
        if b is not None:
            out = out + b.reshape(k, 1, o, 1)
        return out.reshape(n, o, ho, wo)
    raise FedbenchError(f"unknown conv strategy '{strategy}'; choose one of {CONV_STRATEGIES} or auto")


class StackedModel(nn.Module):
    """A copy of ``template`` whose Linear/Conv2d layers read stacked per-client weights.

    ``forward(params, x)``: params maps the template's parameter names to [K, *shape] tensors,
    x holds the K clients' samples concatenated ([K*B, ...]).
    """

    def __init__(self, template: nn.Module, conv_strategy="grouped"):
        super().__init__()
        self.body = copy.deepcopy(template)
        self.layers: List[nn.Module] = []
        names = {n for n, _ in template.named_parameters()}
        covered = set()
        for mod_name, mod in list(self.body.named_modules()):
            prefix = mod_name + "." if mod_name else ""
            if isinstance(mod, nn.Linear):
                new = StackedLinear(mod, prefix)
            elif isinstance(mod, nn.Conv2d):
                strat = conv_strategy.get(mod_name, "grouped") if isinstance(conv_strategy, dict) else conv_strategy
                new = StackedConv2d(mod, prefix, strat)
            else:
                if any(True for _ in mod.parameters(recurse=False)):
                    raise FedbenchError(
                        f"batched backend cannot stack layer '{mod_name}' ({type(mod).__name__}); "
                        "use hardware.backend=serial")
                continue
            covered.update(prefix + n for n, _ in mod.named_parameters(recurse=False))
            _set_submodule(self.body, mod_name, new)
            self.layers.append(new)
        missing = names - covered
        if missing:
            raise FedbenchError(f"batched backend: parameters {sorted(missing)} are not in Linear/Conv2d layers")
        for p in self.body.parameters():
            p.requires_grad_(False)

    def forward(self, params: Dict[str, Tensor], x: Tensor) -> Tensor:
        for layer in self.layers:
            layer.params = params
        try:
            return self.body(x)
        finally:
            for layer in self.layers:
                layer.params = {}


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    if not name:
        raise FedbenchError("the model itself is a single Linear/Conv2d; wrap it in a container module")
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def conv_input_shapes(template: nn.Module, sample_shape: Sequence[int], device) -> Dict[str, Tuple[int, ...]]:
    """Per-sample input shape of every Conv2d, found with one forward pass on a dummy input."""
    shapes: Dict[str, Tuple[int, ...]] = {}
    hooks = []
    for name, mod in template.named_modules():
        if isinstance(mod, nn.Conv2d):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, inp, name=name: shapes.__setitem__(name, tuple(inp[0].shape[1:]))))
    try:
        with torch.no_grad():
            template(torch.zeros(1, *sample_shape, device=device))
    finally:
        for h in hooks:
            h.remove()
    return shapes


_STRATEGY_CACHE: Dict[tuple, str] = {}


def choose_conv_strategies(template: nn.Module, sample_shape, num_clients: int, batch_size: int,
                           device, repeats: int = 3) -> Dict[str, str]:
    """Time forward+backward of each convolution under every strategy; keep the fastest."""
    device = torch.device(device)
    choice: Dict[str, str] = {}
    convs = dict((n, m) for n, m in template.named_modules() if isinstance(m, nn.Conv2d))
    for name, in_shape in conv_input_shapes(template, sample_shape, device).items():
        conv = convs[name]
        key = (str(device), in_shape, tuple(conv.weight.shape), conv.stride, conv.padding, conv.dilation,
               conv.bias is not None, num_clients, batch_size)
        if key not in _STRATEGY_CACHE:
            x = torch.randn(num_clients * batch_size, *in_shape, device=device)
            w = torch.randn(num_clients, *conv.weight.shape, device=device, requires_grad=True)
            b = torch.randn(num_clients, conv.weight.shape[0], device=device, requires_grad=True) \
                if conv.bias is not None else None
            best, best_t = "loop", float("inf")
            for strat in CONV_STRATEGIES:
                times = []
                for _ in range(repeats + 1):
                    _sync(device)
                    t0 = time.perf_counter()
                    out = stacked_conv2d(x, w, b, conv.stride, conv.padding, conv.dilation, strat)
                    out.sum().backward()
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                t = min(times[1:])
                if t < best_t:
                    best, best_t = strat, t
            _STRATEGY_CACHE[key] = best
        choice[name] = _STRATEGY_CACHE[key]
    return choice


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
