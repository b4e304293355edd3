"""Flat-vector layout of a model's trainable parameters.

The flat order is ``named_parameters()`` order restricted to ``requires_grad`` parameters, each
flattened row-major; for the fedbench models (all parameters trainable) this is exactly
``torch.nn.utils.parameters_to_vector(model.parameters())``.
"""
from __future__ import annotations

from math import prod
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from fedbench.errors import FedbenchError


class ParamLayout:
    """Ordered (name, shape) pairs with offsets into the flat parameter vector."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]):
        self.names: Tuple[str, ...] = tuple(names)
        self.shapes: Tuple[torch.Size, ...] = tuple(torch.Size(s) for s in shapes)
        if len(self.names) != len(self.shapes) or len(set(self.names)) != len(self.names):
            raise ValueError("ParamLayout needs unique names, one shape each")
        self.numels: Tuple[int, ...] = tuple(int(prod(s)) for s in self.shapes)
        offs, o = [], 0
        for n in self.numels:
            offs.append(o)
            o += n
        self.offsets: Tuple[int, ...] = tuple(offs)
        self.numel: int = o
        self._pos = {n: i for i, n in enumerate(self.names)}

    @classmethod
    def from_module(cls, model: nn.Module) -> "ParamLayout":
        named = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise FedbenchError("the model has no trainable parameters to compute a curvature for")
        return cls([n for n, _ in named], [s for _, s in named])

    def __contains__(self, name: str) -> bool:
        return name in self._pos

    def __len__(self) -> int:
        return len(self.names)

    def __eq__(self, other) -> bool:
        return isinstance(other, ParamLayout) and self.names == other.names and self.shapes == other.shapes

    def __repr__(self) -> str:
        return f"ParamLayout({len(self.names)} tensors, {self.numel} values)"

    def slice(self, name: str) -> slice:
        i = self._pos[name]
        return slice(self.offsets[i], self.offsets[i] + self.numels[i])

    def shape(self, name: str) -> torch.Size:
        return self.shapes[self._pos[name]]

    def sub(self, names: Iterable[str]) -> "ParamLayout":
        names = list(names)
        return ParamLayout(names, [self.shape(n) for n in names])

    def index(self, names: Iterable[str], device=None) -> Tensor:
        """Positions of ``names``' entries in this layout's flat vector (in the order given)."""
        idx = [torch.arange(self.slice(n).start, self.slice(n).stop) for n in names]
        out = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
        return out.to(device) if device is not None else out

    def flatten(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """Concatenate ``tensors[name]`` (shape ``[*batch, *shape]``) into ``[*batch, numel]``."""
        parts: List[Tensor] = []
        for n, s in zip(self.names, self.shapes):
            t = tensors[n]
            batch = t.shape[: t.dim() - len(s)]
            if tuple(t.shape[t.dim() - len(s):]) != tuple(s):
                raise FedbenchError(f"parameter '{n}' has shape {list(t.shape)}, expected [..., {list(s)}]")
            parts.append(t.reshape(*batch, -1))
        return torch.cat(parts, dim=-1)

    def unflatten(self, vec: Tensor) -> Dict[str, Tensor]:
        """Inverse of :meth:`flatten` (views into ``vec``); leading batch dims are kept."""
        if vec.shape[-1] != self.numel:
            raise FedbenchError(f"flat vector has {vec.shape[-1]} entries, the layout has {self.numel}")
        batch = vec.shape[:-1]
        return {n: vec[..., o:o + k].reshape(*batch, *s)
                for n, s, o, k in zip(self.names, self.shapes, self.offsets, self.numels)}

    def params_of(self, model: nn.Module) -> Dict[str, Tensor]:
        named = dict(model.named_parameters())
        return {n: named[n] for n in self.names}

    def vector_of(self, model: nn.Module) -> Tensor:
        return self.flatten({n: t.detach() for n, t in self.params_of(model).items()})
