"""FedCurv (Shoham et al. 2019), as FOLA's code runs it and as originally proposed (fola.md §2).

``variant: fola_code`` (FOLA's ``cnn_curv.py``): after local training each client computes an offline
diagonal Fisher ω_n (one pass at its trained weights); the server averages μ_S = Σ π_n θ_n (FedAvg)
and ω_S = Σ π_n ω_n; the next round's local loss is  mean task loss + λ · (0.5/r) · Σ ω_S (θ − μ_S)²
(``round_factor: inverse_round``; ``none`` drops the 1/r). Round 1 has ω_S = 0, i.e. plain training.

``variant: original`` (Shoham et al.): client n penalises with every other client's previous-round
weights θ̂_j and Fisher F_j,  λ · Σ_{j≠n} Σ_i F_{j,i} (θ_i − θ̂_{j,i})²  (no ½, unweighted sum), written
as λ Σ (A_n θ² − 2 B_n θ + C_n) with A_n = Σ_{j≠n} F_j, B_n = Σ_{j≠n} F_j θ̂_j, C_n = Σ_{j≠n} F_j θ̂_j²
(the server keeps the sums and subtracts each client's own share, as the paper's implementation does).
Aggregation is FedAvg.

``prior_grad: live`` (default) lets the penalty's gradient flow; ``detached_as_released`` is the released
code, whose penalty reads a detached ``state_dict()`` and so trains like FedAvg (§2). Gradient clipping at
10 (the code) is a local-training setting (``local.clip_grad_norm``) that presets set. Fisher per step:
``fisher.grad: per_sample_sq`` (the diagonal empirical Fisher) or ``minibatch_sq`` (the code's
Σ_b (|b|/N) g_b² over minibatches of local.batch_size). Uplink: θ_n and its Fisher (2 × the model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, Message, weighted_average
from fedbench.algorithms.common import client_weights
from fedbench.algorithms.fola import FISHER_GRADS, offline_fisher_product
from fedbench.algorithms.options import option, read_options
from fedbench.train.engine import LocalObjective
from fedbench.train.terms import QuadraticPriorTerm

Params = Dict[str, Tensor]

VARIANTS = ("fola_code", "original")
ROUND_FACTORS = ("inverse_round", "none")
PRIOR_GRADS = ("live", "detached_as_released")


@dataclass(frozen=True)
class FedCurvFisherOptions:
    grad: str = option(choices=FISHER_GRADS)
    chunk_size: int = option(minimum=1)


@dataclass(frozen=True)
class FedCurvOptions:
    variant: str = option(choices=VARIANTS)
    lambda_prior: float = option(nonneg=True)
    prior_grad: str = option(choices=PRIOR_GRADS)
    round_factor: str = option(choices=ROUND_FACTORS)
    fisher: FedCurvFisherOptions = option()

class OriginalFedCurvTerm:
    """λ Σ (A θ² − 2 B θ) + λ C with ctx['curv_a'], ctx['curv_b'] params-shaped and ctx['curv_c'] a scalar."""

    def __init__(self, lam: float):
        self.lam = float(lam)

    def __call__(self, params: Params, ctx: dict) -> Tensor:
        a, b = ctx["curv_a"], ctx["curv_b"]
        quad = sum((a[n] * p * p - 2.0 * b[n] * p).sum() for n, p in params.items())
        return self.lam * (quad + ctx["curv_c"])


def original_context(sums: Dict[str, Any], own_fisher: Optional[Params], own_anchor: Optional[Params]) -> dict:
    """A_n, B_n, C_n for one client from the server's sums minus the client's own share."""
    if own_fisher is None:
        return {"curv_a": sums["a"], "curv_b": sums["b"], "curv_c": sums["c"]}
    a = {n: sums["a"][n] - own_fisher[n] for n in own_fisher}
    b = {n: sums["b"][n] - own_fisher[n] * own_anchor[n] for n in own_fisher}
    c = sums["c"] - sum((own_fisher[n] * own_anchor[n] ** 2).sum() for n in own_fisher)
    return {"curv_a": a, "curv_b": b, "curv_c": c}


@ALGORITHMS.register("fedcurv")
class FedCurv(Algorithm):
    name = "fedcurv"
    Options = FedCurvOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.variant, self.lam, self.prior_grad, self.round_factor = \
            o.variant, o.lambda_prior, o.prior_grad, o.round_factor
        self.fisher_grad, self.chunk = o.fisher.grad, o.fisher.chunk_size

    # server
    def init_state(self, params):
        zeros = {n: torch.zeros_like(t) for n, t in params.items()}
        if self.variant == "fola_code":
            return {"params": params, "precision": zeros}
        k = self.setup.num_clients
        return {"params": params, "fishers": [None] * k, "anchors": [None] * k,
                "sums": {"a": zeros, "b": dict(zeros), "c": torch.zeros((), dtype=next(iter(params.values())).dtype,
                                                                       device=next(iter(params.values())).device)}}

    def downlink(self, state):
        if self.variant == "fola_code":
            return {"params": state["params"], "precision": state["precision"]}
        return {"params": state["params"], "a": state["sums"]["a"], "b": state["sums"]["b"]}

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None   # no penalty in round 1: plain training (shares FedAvg's clients)

    # client
    def local_objective(self, state, client_ids, round_idx):
        if self.prior_grad != "live" or self.lam == 0 or round_idx <= 1:
            return LocalObjective()
        if self.variant == "fola_code":
            if not any(bool((t != 0).any()) for t in state["precision"].values()):
                return LocalObjective()
            scale = self.lam / round_idx if self.round_factor == "inverse_round" else self.lam
            return LocalObjective(terms=[QuadraticPriorTerm(scale)],
                                  shared_ctx={"prior_mean": state["params"], "prior_precision": state["precision"]})
        if all(f is None for f in state["fishers"]):
            return LocalObjective()
        ctx = [original_context(state["sums"], state["fishers"][k], state["anchors"][k]) for k in client_ids]
        return LocalObjective(terms=[OriginalFedCurvTerm(self.lam)], client_ctx=ctx)

    def client_products(self, client_id, params, state, round_idx):
        return [offline_fisher_product(self.setup, params, client_id, grad=self.fisher_grad, normalize="none",
                                       chunk_size=self.chunk)]

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        fisher = {n: products["fisher"]["fisher"][n].to(params[n].dtype) for n in params}
        n = len(self.setup.client_indices[client_id])
        return Message(client_id, n, {"params": params, "fisher": fisher},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def aggregate(self, messages, state, round_idx):
        w = client_weights([m.num_samples for m in messages])
        mu = weighted_average([m.payload["params"] for m in messages], w)
        if self.variant == "fola_code":
            omega = weighted_average([m.payload["fisher"] for m in messages], w)
            return {**state, "params": mu, "precision": omega}
        fishers, anchors = list(state["fishers"]), list(state["anchors"])
        for m in messages:
            fishers[m.client_id] = m.payload["fisher"]
            anchors[m.client_id] = m.payload["params"]
        ref = state["sums"]["a"]
        a = {n: torch.zeros_like(t) for n, t in ref.items()}
        b = {n: torch.zeros_like(t) for n, t in ref.items()}
        c = torch.zeros_like(state["sums"]["c"])
        for f, th in zip(fishers, anchors):
            if f is None:
                continue
            for n in a:
                a[n] = a[n] + f[n]
                b[n] = b[n] + f[n] * th[n]
                c = c + (f[n] * th[n] ** 2).sum()
        return {**state, "params": mu, "fishers": fishers, "anchors": anchors, "sums": {"a": a, "b": b, "c": c}}
