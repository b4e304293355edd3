"""FedDyn (Acar et al. 2021) as its official code runs it (fedlap.md §1.7).

Client k: mean loss + alpha_k <theta, h_k - theta_g> + (alpha_k + wd)/2 ||theta||^2 with
alpha_k = alpha / c_k, c_k = N_k K / N; afterwards h_k += theta_k - theta_g.
Server: theta_g = mean_k theta_k + mean_k h_k (full participation). The official code reports the
plain client average but broadcasts theta_g: ``evaluate: cloud | client_average`` (default cloud,
the model FedDyn actually sends). Gradient clipping at 10 is a local-training setting
(local.clip_grad_norm) that FedDyn presets set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedbench.algorithms.base import ALGORITHMS, Algorithm
from fedbench.algorithms.options import option, read_options
from fedbench.train.engine import LocalObjective


def feddyn_term(params, ctx):
    a = ctx["alpha_k"]
    lin = sum((p * (ctx["h"][n] - ctx["theta_g"][n])).sum() for n, p in params.items())
    sq = sum((p * p).sum() for p in params.values())
    return a * lin + 0.5 * (a + ctx["wd"]) * sq


@dataclass(frozen=True)
class FedDynOptions:
    alpha: float = option(positive=True)
    weight_decay: float = option()
    evaluate: str = option(choices=("cloud", "client_average"))


@ALGORITHMS.register("feddyn")
class FedDyn(Algorithm):
    name = "feddyn"
    Options = FedDynOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        opts = read_options(self.Options, cfg, self.name)
        self.alpha, self.wd, self.evaluate = opts.alpha, opts.weight_decay, opts.evaluate

    def init_state(self, params):
        k = self.setup.num_clients
        return {"params": params, "avg": params,
                "h": [{n: torch.zeros_like(t) for n, t in params.items()} for _ in range(k)]}

    def local_objective(self, state, client_ids, round_idx):
        sizes = [len(ix) for ix in self.setup.client_indices]
        total, k = float(sum(sizes)), len(sizes)
        dev = self.setup.device
        # A client without data (a Dirichlet split can leave one empty) takes no local step, so its
        # alpha_k (alpha / 0) is never used; 0 keeps it finite. It returns theta_g and its h stays 0.
        ctx = [{"alpha_k": torch.tensor(self.alpha / (sizes[c] * k / total) if sizes[c] else 0.0, device=dev),
                "h": state["h"][c]} for c in client_ids]
        shared = {"theta_g": state["params"], "wd": torch.tensor(self.wd, device=dev)}
        return LocalObjective(terms=[feddyn_term], shared_ctx=shared, client_ctx=ctx)

    def aggregate(self, messages, state, round_idx):
        h = list(state["h"])
        for m in messages:
            h[m.client_id] = {n: h[m.client_id][n] + m.payload["params"][n] - state["params"][n] for n in h[0]}
        k = len(messages)
        avg = {n: sum(m.payload["params"][n] for m in messages) / k for n in state["params"]}
        cloud = {n: avg[n] + sum(hk[n] for hk in h) / len(h) for n in avg}
        return {"params": cloud, "avg": avg, "h": h}

    def predict_params(self, state):
        return state["params"] if self.evaluate == "cloud" else state["avg"]
