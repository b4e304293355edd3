"""FedNova (Wang et al. 2020b): normalised averaging of local updates by the number of local steps.

As in NIID-Bench (fedlpa.md §2): tau_k local SGD steps with momentum rho give
a_k = [tau_k - rho (1 - rho^tau_k) / (1 - rho)] / (1 - rho) (a_k = tau_k without momentum),
d_k = (theta_0 - theta_k) / a_k, and theta = theta_0 - (sum_k p_k a_k) * sum_k p_k d_k.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedbench.algorithms.base import ALGORITHMS, Algorithm
from fedbench.algorithms.common import client_weights
from fedbench.algorithms.options import option, read_options


@dataclass(frozen=True)
class FedNovaOptions:
    rho: float = option()   # YAML default ${local.momentum}


def effective_steps(tau: int, rho: float) -> float:
    if tau == 0:
        return 0.0
    if rho == 0:
        return float(tau)
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)


@ALGORITHMS.register("fednova")
class FedNova(Algorithm):
    name = "fednova"
    resumable = True   # all cross-round memory is in the state dict (tests/test_resume.py)
    Options = FedNovaOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        self.rho = read_options(self.Options, cfg, self.name,
                                context={"local": {"momentum": setup.local.momentum}}).rho

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None

    def aggregate(self, messages, state, round_idx):
        rho = self.rho
        theta0 = state["params"]
        p = client_weights([m.num_samples for m in messages])
        a = [effective_steps(int(m.info["steps"]), rho) for m in messages]
        tau_eff = sum(pk * ak for pk, ak in zip(p, a))
        new = {}
        for n, t0 in theta0.items():
            d = sum(pk * (t0 - m.payload["params"][n]) / ak for pk, ak, m in zip(p, a, messages) if ak > 0)
            new[n] = t0 - tau_eff * d if tau_eff > 0 else t0.clone()
        return {**state, "params": new}
