"""Extra local-loss terms that methods plug into local training.

A term is a function of one client's parameters and a context, returning a scalar that is
added to the client's mean data loss. It must be written with plain tensor ops so the
batched engine can ``vmap`` it over clients (contexts then carry a leading client axis).
Parameters are passed live (never ``state_dict()`` copies), so gradients flow through.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Protocol

from torch import Tensor

Params = Dict[str, Tensor]


class LossTerm(Protocol):
    def __call__(self, params: Params, ctx: dict) -> Tensor: ...


@dataclass
class ProximalTerm:
    """FedProx: (mu/2) * ||theta - anchor||^2 summed over all tensors; ctx['anchor'] is a params dict."""

    mu: float

    def __call__(self, params: Params, ctx: dict) -> Tensor:
        anchor = ctx["anchor"]
        # optional per-client multiplier, e.g. 1/N_k for FedProx on the sum-loss scale
        w = ctx.get("prox_weight", 1.0)
        return 0.5 * self.mu * w * sum(((p - anchor[n]) ** 2).sum() for n, p in params.items())


@dataclass
class QuadraticPriorTerm:
    """Diagonal Gaussian prior: (scale/2) * sum(precision * (theta - mean)^2).

    ctx['prior_mean'] and ctx['prior_precision'] are params-shaped dicts (FOLA, FedCurv, diag Laplace).
    """

    scale: float = 1.0

    def __call__(self, params: Params, ctx: dict) -> Tensor:
        mean, prec = ctx["prior_mean"], ctx["prior_precision"]
        return 0.5 * self.scale * sum((prec[n] * (p - mean[n]) ** 2).sum() for n, p in params.items())


@dataclass
class LinearTerm:
    """Linear (dual / control-variate) term: scale * <v, theta>; ctx['linear'] is a params-shaped dict."""

    scale: float = 1.0

    def __call__(self, params: Params, ctx: dict) -> Tensor:
        v = ctx["linear"]
        return self.scale * sum((v[n] * p).sum() for n, p in params.items())

