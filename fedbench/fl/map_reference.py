"""The centralised MAP a federated run is measured against (FedLap App. D.2, fedlap.md §2 "App. D.2").

``eval.map_reference: δ`` solves, once before training, the MAP of the pooled training data (the union of the
clients' data):  w* = argmin_w Σ_i ℓ_i(w) + (δ/2)||w||²  (sum scale, δ = FedLap's prior precision; δ = 0 is
FedDyn's target without weight decay). Full-batch L-BFGS in float64 from the run's initialisation: the exact
optimum for convex models (logistic regression), a local one otherwise.

Every evaluated round then records the global model's training NLL (mean over the pooled data), its relative
distance to the MAP's, ``train_nll_gap = |nll(w_g) − nll(w*)| / nll(w*)``, and the MAP's own train / test NLL
and accuracy; the run's summary records the first round within 1 % (``first_round_train_nll_within_1pct``).
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fedbench.eval.metrics import evaluate
from fedbench.train.engine import data_loss

Params = Dict[str, Tensor]
WITHIN = 0.01   # "within 1 % of its ideal train loss" (App. D.2)


def sample_loss(out: Tensor, y: Tensor, task: str) -> Tensor:
    """The engine's per-sample loss (``data_loss``) in the dtype of ``out``: its BCE casts targets to float32,
    which would cap the float64 solve at float32 precision."""
    if task != "regression" and out.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(out.squeeze(-1), y.to(out.dtype), reduction="none")
    return data_loss(out, y, task)


def map_objective(model: nn.Module, params: Params, x: Tensor, y: Tensor, delta: float, task: str) -> Tensor:
    """(Σ_i ℓ_i(w) + (δ/2)||w||²) / N: the MAP objective on the mean scale (same minimiser, better scaled)."""
    out = torch.func.functional_call(model, params, (x,))
    reg = sum((p * p).sum() for p in params.values())
    return sample_loss(out, y, task).mean() + 0.5 * delta * reg / len(y)


def solve_map(model: nn.Module, init: Params, x: Tensor, y: Tensor, delta: float, task: str = "classification",
              max_iters: int = 2000) -> Params:
    """argmin of ``map_objective`` by full-batch L-BFGS (strong Wolfe) in float64, started at ``init``."""
    m64 = copy.deepcopy(model).double().eval()
    w = {n: t.detach().double().clone().requires_grad_(True) for n, t in init.items()}
    x64 = x.double()
    y64 = y.double() if task == "regression" else y
    opt = torch.optim.LBFGS(list(w.values()), lr=1.0, max_iter=max_iters, history_size=50,
                            tolerance_grad=1e-12, tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = map_objective(m64, w, x64, y64, delta, task)
        loss.backward()
        return loss

    opt.step(closure)
    return {n: t.detach().to(init[n].dtype) for n, t in w.items()}


def train_nll(model: nn.Module, params: Params, x: Tensor, y: Tensor, task: str = "classification") -> float:
    """Mean NLL of ``params`` on (x, y), computed as the test NLL is (fedbench.eval.metrics)."""
    return float(evaluate(model, params, lambda idx: x[idx.to(x.device)], y, task=task)["nll"])


def map_round_metrics(model: nn.Module, init: Params, x: Tensor, y: Tensor, delta: float, task: str,
                      test: Callable[[Params], Dict[str, float]]) -> Callable[[Params], Dict[str, float]]:
    """Solve the MAP once; return the per-round metrics of a global model against it."""
    w_map = solve_map(model, init, x, y, delta, task)
    ref = train_nll(model, w_map, x, y, task)
    test_map = test(w_map)
    fixed = {"map_train_nll": ref, "map_test_nll": test_map["nll"]}
    if "accuracy" in test_map:
        fixed["map_accuracy"] = test_map["accuracy"]

    def metrics(params: Params) -> Dict[str, float]:
        nll = train_nll(model, params, x, y, task)
        return {"train_nll": nll, "train_nll_gap": abs(nll - ref) / ref, **fixed}

    return metrics


def first_round_within(history: Sequence[Dict], tol: float = WITHIN, key: str = "train_nll_gap") -> Optional[int]:
    """The first round whose ``train_nll_gap`` is at most ``tol`` (None: never)."""
    for row in history:
        v = row.get(key)
        if v is not None and v == v and float(v) <= tol:
            return int(row["round"])
    return None
