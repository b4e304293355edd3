"""FedProx (Li et al. 2020): local loss + (mu/2)||theta - theta_global||^2, FedAvg aggregation.

``scale: mean`` adds the term to the mean minibatch loss (NIID-Bench / FedLPA, FOLA code);
``scale: sum`` puts it on the sum-loss scale, i.e. mean loss + mu/(2 N_k)||.||^2, which is how
the FedLap paper's alpha grid reads (fedlap.md §1.8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedbench.algorithms.base import ALGORITHMS
from fedbench.algorithms.fedavg import FedAvg, FedAvgOptions
from fedbench.algorithms.options import option
from fedbench.train.engine import LocalObjective
from fedbench.train.terms import ProximalTerm


@dataclass(frozen=True)
class FedProxOptions(FedAvgOptions):
    mu: float = option(nonneg=True)
    scale: str = option(choices=("mean", "sum"))


@ALGORITHMS.register("fedprox")
class FedProx(FedAvg):
    name = "fedprox"
    Options = FedProxOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        self.mu, self.scale = self.opts.mu, self.opts.scale

    def client_stage_key(self, round_idx):
        if round_idx != 1:
            return None
        return {} if self.mu == 0 else {"proximal_mu": self.mu, "proximal_scale": self.scale}

    def local_objective(self, state, client_ids, round_idx):
        client_ctx = None
        if self.scale == "sum":
            dev = self.setup.device
            client_ctx = [{"prox_weight": torch.tensor(1.0 / max(len(self.setup.client_indices[c]), 1), device=dev)}
                          for c in client_ids]
        return LocalObjective(terms=[ProximalTerm(self.mu)], shared_ctx={"anchor": state["params"]},
                              client_ctx=client_ctx)
