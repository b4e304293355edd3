"""FedDyn (Acar et al. 2021), as its official code runs it (fedlap.md §1.7), or as bayes-admm runs it.

``variant: acar`` (default; the FedLap paper's description, alpha_k proportional to alpha / N_k):
  client k: mean loss + alpha_k <theta, h_k - theta_g> + (alpha_k + wd)/2 ||theta||^2 with
  alpha_k = alpha / c_k, c_k = N_k K / N; afterwards h_k += theta_k - theta_g.
  Server: theta_g = mean_k theta_k + mean_k h_k (full participation).
``variant: bayes_admm`` (the FedLap group's follow-up code, team-approx-bayes/bayes-admm ``train.py`` and
``local_client_worker.py``; reference-code.md §5; the hypothesis of gaps.md#fedlap-table3-feddyn):
  client k: mean loss + alpha_k/2 ||theta - theta_g|| (the norm, not its square) + alpha_k <theta, h_k>
  + wd/2 ||theta||^2 with alpha_k = alpha N_k / N, i.e. its dual y_k = alpha_k h_k.
  Server: no history in round 1; afterwards history += sum_k alpha_k/K (theta_k - theta_g), and
  theta_g = mean_k theta_k + history / alpha. On equal clients that adds 1/K of the mean drift, where
  acar adds all of it.
  Left out, both of size alpha_k (1e-6 on MNIST): the released round 1 pulls towards w_g = 0 rather than the
  initial model, and its shared settings dict gives every client the last client's alpha_k.
The official code reports the plain client average but broadcasts theta_g: ``evaluate: cloud |
client_average`` (default cloud, the model FedDyn actually sends). Gradient clipping at 10 is a
local-training setting (local.clip_grad_norm) that FedDyn presets set.
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


def feddyn_bayes_admm_term(params, ctx):
    a = ctx["alpha_k"]
    # the norm of the per-tensor norms: its gradient at theta = theta_g (each round's first step) is 0, not NaN
    dist = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p - ctx["theta_g"][n])
                                                 for n, p in params.items()]))
    lin = sum((p * ctx["h"][n]).sum() for n, p in params.items())
    sq = sum((p * p).sum() for p in params.values())
    return 0.5 * a * dist + a * lin + 0.5 * ctx["wd"] * sq


@dataclass(frozen=True)
class FedDynOptions:
    alpha: float = option(positive=True)
    weight_decay: float = option()
    evaluate: str = option(choices=("cloud", "client_average"))
    variant: str = option(choices=("acar", "bayes_admm"))


@ALGORITHMS.register("feddyn")
class FedDyn(Algorithm):
    name = "feddyn"
    resumable = True   # all cross-round memory is in the state dict (tests/test_resume.py)
    Options = FedDynOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        opts = read_options(self.Options, cfg, self.name)
        self.alpha, self.wd, self.evaluate, self.variant = opts.alpha, opts.weight_decay, opts.evaluate, opts.variant
        self.alpha_k = [self._alpha_k(c) for c in range(len(setup.client_indices))]   # fixed by the split

    def init_state(self, params):
        k = self.setup.num_clients
        state = {"params": params, "avg": params,
                 "h": [{n: torch.zeros_like(t) for n, t in params.items()} for _ in range(k)]}
        if self.variant == "bayes_admm":
            state["history"] = {n: torch.zeros_like(t) for n, t in params.items()}
        return state

    def _alpha_k(self, c):
        sizes = [len(ix) for ix in self.setup.client_indices]
        total, k = float(sum(sizes)), len(sizes)
        if self.variant == "bayes_admm":
            return self.alpha * sizes[c] / total
        # A client without data (a Dirichlet split can leave one empty) takes no local step, so its
        # alpha_k (alpha / 0) is never used; 0 keeps it finite. It returns theta_g and its h stays 0.
        return self.alpha / (sizes[c] * k / total) if sizes[c] else 0.0

    def local_objective(self, state, client_ids, round_idx):
        dev = self.setup.device
        ctx = [{"alpha_k": torch.tensor(self.alpha_k[c], device=dev), "h": state["h"][c]} for c in client_ids]
        shared = {"theta_g": state["params"], "wd": torch.tensor(self.wd, device=dev)}
        term = feddyn_bayes_admm_term if self.variant == "bayes_admm" else feddyn_term
        return LocalObjective(terms=[term], shared_ctx=shared, client_ctx=ctx)

    def aggregate(self, messages, state, round_idx):
        h = list(state["h"])
        for m in messages:
            h[m.client_id] = {n: h[m.client_id][n] + m.payload["params"][n] - state["params"][n] for n in h[0]}
        k = len(messages)
        avg = {n: sum(m.payload["params"][n] for m in messages) / k for n in state["params"]}
        if self.variant == "bayes_admm":
            return self._aggregate_bayes_admm(messages, state, round_idx, h, avg)
        cloud = {n: avg[n] + sum(hk[n] for hk in h) / len(h) for n in avg}
        return {"params": cloud, "avg": avg, "h": h}

    def _aggregate_bayes_admm(self, messages, state, round_idx, h, avg):
        history = state["history"]
        if round_idx > 1:   # the released server adds nothing in its first round
            k = self.setup.num_clients
            history = {n: history[n] + sum(self.alpha_k[m.client_id] / k * (m.payload["params"][n] - state["params"][n])
                                           for m in messages) for n in history}
        theta_g = {n: avg[n] + history[n] / self.alpha for n in avg}
        return {"params": theta_g, "avg": avg, "h": h, "history": history}

    def predict_params(self, state):
        return state["params"] if self.evaluate == "cloud" else state["avg"]
