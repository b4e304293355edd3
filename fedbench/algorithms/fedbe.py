"""FedBE (Chen & Chao, ICLR 2021): Bayesian model ensemble of sampled global models, distilled into one model.

Notes: ../shared/reference/notes/fola.md §2 (FedBE row, "Suggested implementations": a Gaussian over the client
models, M = 10 samples + the mean + the clients as the ensemble, distillation on unlabelled server data held out from
the training set; FOLA gives no FedBE configuration), §4 Table II (FedBE, E = 20), §6 row R5.

Server, after plain local training (round 1: the shared cached client stage; uplink = the client models):
  1. fit a distribution over global models to the client weights w_i (π_i = n_i / n):
       gaussian: μ = Σ π_i w_i (= FedAvg), σ² = Σ π_i (w_i − μ)² (diagonal); sample w = μ + s·σ⊙ε, ε ~ N(0, I)
       dirichlet: w = Σ γ_i w_i, γ ~ Dir(α·N·π)   (E[γ] = π: the distribution's mean is FedAvg's)
  2. ensemble = {μ} ∪ {M samples} ∪ {w_i} (``ensemble``); pseudo-label of each unlabelled x = the average of the
     members' softmax (optionally sharpened, p ∝ p̄^(1/T));
  3. distil: the student starts at μ and is trained with SGD on KL(pseudo-label ‖ student) over the unlabelled
     set; with ``swa`` the returned model is the stochastic weight average of snapshots taken every ``swa_freq``
     steps after ``swa_start`` steps (Izmailov et al. 2018); it is the next round's start.
  The record keeps, beside the distilled model, the FedAvg mean (``fedavg_*``), the ensemble (``ensemble_*``,
  softmax-averaged) and, with SWA, the last SGD iterate (``fedbe_last_*``).

What the sources say (the FedBE paper's full text could not be retrieved here: the search corpora hold its abstract
and introduction only; the method summary above follows the paper as fola.md §2 and the paper's abstract describe
it; [code] = the authors' release github.com/hongyouc/FedBE, read for facts only):
* Gaussian fit. Paper: mean = data-size weighted average, diagonal variance of the client weights around it.
  [code] ``swag.py``: a different fit — per tensor, the client updates d_i = w_i − w_start are normalised to unit
  norm, their *unweighted* mean and variance (clamped at 1e-5) are taken, a sample is
  w_start + mean‖d‖·(mean_u + 0.1·σ_u⊙ε) (``var_scale`` 0.1, ``swag_stepsize`` 1) — ``gaussian_fit``, ``std_scale``.
* Dirichlet: the concentration is not given; [code]'s ``dir`` mode reads an ``args.alpha`` the option parser never
  defines. Here α_i = ``dirichlet_alpha``·N·π_i (chosen: mean = FedAvg, α_i = 1 for equal clients).
* Ensemble: paper/fola.md §2: samples + mean + clients, M = 10. [code] defaults: mean + 10 samples
  (``use_client`` off) — ``ensemble``.
* Pseudo-labels: paper: the ensemble's averaged softmax. [code]: averaged softmax sharpened with temperature 0.5
  (``temp_sharpen``: p^(1/0.5), renormalised) — ``temperature``.
* Distillation [code] (the paper does not settle these as far as could be checked): student initialised at the
  FedAvg mean; pseudo-labels computed once per round on the un-augmented server set; KL loss taken as the *mean*
  over batch × classes (= batch KL / C) — ``kl_reduction``; SGD lr 1e-3 (hard-coded; its ``server_lr`` 0.01
  option is unused), momentum 0.9, weight decay 1e-5, batch 128, 20 epochs; SWA (torchcontrib) from step 500,
  every 25 steps, constant learning rate; the SWA weights are sent back when SWA is on.
* Server data: CIFAR-10, 10,000 of the 50,000 training images held out, 40,000 to the clients ([code]
  ``num_data`` 40000, server = the rest) — fedbench's ``server_unlabeled.mode=holdout``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, weighted_average
from fedbench.algorithms.common import distill_epoch, method_generator, method_seed
from fedbench.algorithms.options import option, read_options
from fedbench.errors import FedbenchError

Params = Dict[str, Tensor]
DISTRIBUTIONS = ("gaussian", "dirichlet")
GAUSSIAN_FITS = ("weights", "normalized_updates_as_released")
MEMBERS = ("mean", "samples", "clients")
KL_REDUCTIONS = ("mean_as_released", "batchmean")
RELEASED_VAR_CLAMP = 1e-5   # [code] swag.py clamps the direction variance at 1e-5 (then 1e-6: no effect)


# ------------------------------------------------------------------------------------------------
# the distribution over global models (module level so tests can check them by hand)
# ------------------------------------------------------------------------------------------------
def fit_gaussian(members: Sequence[Params], sizes: Sequence[float]) -> Tuple[Params, Params]:
    """(μ, σ²): data-size weighted mean and diagonal variance Σ π_i (w_i − μ)² of the client weights."""
    w = torch.tensor([float(s) for s in sizes], dtype=torch.float64)
    w = w / w.sum()
    mean, var = {}, {}
    for name in members[0]:
        stack = torch.stack([p[name].double() for p in members])            # [N, ...]
        ww = w.to(stack.device).view(-1, *([1] * (stack.dim() - 1)))
        mu = (ww * stack).sum(0)
        var[name] = (ww * (stack - mu) ** 2).sum(0).to(members[0][name].dtype)
        mean[name] = mu.to(members[0][name].dtype)
    return mean, var


def fit_gaussian_released(members: Sequence[Params], start: Params) -> Tuple[Params, Params, Dict[str, float]]:
    """[code] swag.py: per tensor, unit-normalised client updates u_i = (w_i − w_start)/‖w_i − w_start‖, their
    unweighted mean and variance (clamped at 1e-5), and the mean update norm. A client that did not move
    contributes u_i = 0 (the code would divide by zero)."""
    mean_u, var_u, norm = {}, {}, {}
    for name in members[0]:
        d = torch.stack([p[name].double() - start[name].double().to(p[name].device) for p in members])
        n = d.flatten(1).norm(dim=1)
        u = d / torch.where(n > 0, n, torch.ones_like(n)).view(-1, *([1] * (d.dim() - 1)))
        m = u.mean(0)
        dt = members[0][name].dtype
        mean_u[name] = m.to(dt)
        var_u[name] = ((u ** 2).mean(0) - m ** 2).clamp_min(RELEASED_VAR_CLAMP).to(dt)
        norm[name] = float(n.mean())
    return mean_u, var_u, norm


def _normal_like(t: Tensor, gen: torch.Generator) -> Tensor:
    """ε ~ N(0, I) drawn on the CPU from ``gen`` (the same samples on every device), moved to ``t``'s device."""
    return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device=t.device, dtype=t.dtype)


def sample_gaussian(mean: Params, var: Params, num: int, gen: torch.Generator, std_scale: float = 1.0) -> List[Params]:
    """``num`` draws w = μ + std_scale·σ⊙ε."""
    return [{n: mean[n] + std_scale * var[n].sqrt() * _normal_like(mean[n], gen) for n in mean} for _ in range(num)]


def sample_gaussian_released(start: Params, mean_u: Params, var_u: Params, norm: Dict[str, float], num: int,
                             gen: torch.Generator, std_scale: float = 0.1) -> List[Params]:
    """[code] w = w_start + mean‖d‖·(mean_u + std_scale·σ_u⊙ε), per tensor."""
    return [{n: start[n].to(mean_u[n].device) + norm[n] * (mean_u[n] + std_scale * var_u[n].sqrt()
                                                           * _normal_like(mean_u[n], gen)) for n in mean_u}
            for _ in range(num)]


def dirichlet_concentration(sizes: Sequence[float], alpha: float) -> np.ndarray:
    """α_i = alpha·N·π_i: the mean of Dir is π (FedAvg's weights); equal clients give α_i = alpha."""
    s = np.asarray([float(x) for x in sizes], dtype=np.float64)
    pi = s / s.sum() if s.sum() > 0 else np.full(len(s), 1.0 / len(s))
    return np.maximum(alpha * len(s) * pi, 1e-12)   # a client without data gets a vanishing share


def sample_dirichlet(members: Sequence[Params], conc: np.ndarray, num: int, rng: np.random.Generator
                     ) -> Tuple[List[Params], np.ndarray]:
    """``num`` convex combinations Σ γ_i w_i with γ ~ Dir(conc); returns (samples, γ [num, N])."""
    gammas = rng.dirichlet(conc, size=num)
    return [weighted_average(members, g.tolist()) for g in gammas], gammas


# ------------------------------------------------------------------------------------------------
# ensemble, pseudo-labels, distillation
# ------------------------------------------------------------------------------------------------
def build_ensemble(which: Sequence[str], mean: Params, samples: Sequence[Params], clients: Sequence[Params]
                   ) -> List[Params]:
    parts = {"mean": [mean], "samples": list(samples), "clients": list(clients)}
    return [p for key in which for p in parts[key]]


@torch.no_grad()
def pseudo_labels(model: nn.Module, members: Sequence[Params], x: Tensor, batch_size: int = 2048,
                  temperature: float = 1.0) -> Tensor:
    """Average of the members' softmax on ``x`` [n, C]; temperature T ≠ 1 sharpens (T < 1) as p ∝ p̄^(1/T)."""
    was = model.training
    model.eval()
    out = []
    try:
        for start in range(0, x.shape[0], batch_size):
            xb = x[start:start + batch_size]
            acc = None
            for p in members:
                pr = F.softmax(torch.func.functional_call(model, p, (xb,)).double(), dim=-1)
                acc = pr if acc is None else acc + pr
            out.append(acc / len(members))
    finally:
        model.train(was)
    probs = torch.cat(out)
    if temperature != 1.0:
        probs = probs.clamp_min(1e-8) ** (1.0 / temperature)   # [code] temp_sharpen floors at 1e-8
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.float()


def kl_to_targets(student_logits: Tensor, targets: Tensor, reduction: str = "batchmean") -> Tensor:
    """KL(targets ‖ softmax(student)): per-sample sum over classes averaged over the batch (``batchmean``), or
    the mean over batch × classes (``mean_as_released``, [code]'s (P·(log P − log Q)).mean(), = batchmean / C)."""
    kl = F.kl_div(F.log_softmax(student_logits, dim=-1), targets, reduction="sum")
    return kl / (targets.shape[0] if reduction == "batchmean" else targets.numel())


class WeightAverage:
    """Running mean of weight snapshots (SWA's running average: avg += (w − avg)/(n + 1))."""

    def __init__(self):
        self.avg: Optional[Params] = None
        self.n = 0

    @torch.no_grad()
    def update(self, params: Params) -> None:
        if self.avg is None:
            self.avg = {k: v.detach().clone() for k, v in params.items()}
        else:
            for k, v in params.items():
                self.avg[k].add_((v.detach() - self.avg[k]) / (self.n + 1))
        self.n += 1


# ------------------------------------------------------------------------------------------------
def _ensemble(key: str, ens: Any) -> List[str]:
    if isinstance(ens, str) or not isinstance(ens, Sequence) or not ens or \
            any(e not in MEMBERS for e in ens) or len(set(ens)) != len(ens):
        raise FedbenchError(f"algorithm.ensemble must be a non-empty list of distinct members from "
                            f"{', '.join(MEMBERS)}, got {ens!r}")
    return list(ens)


@dataclass(frozen=True)
class FedBEOptions:
    distribution: str = option(choices=DISTRIBUTIONS)
    gaussian_fit: str = option(choices=GAUSSIAN_FITS)
    std_scale: float = option(nonneg=True)
    dirichlet_alpha: float = option(positive=True)
    num_samples: int = option(minimum=0)
    ensemble: Any = option(check=_ensemble)
    temperature: float = option(positive=True)
    kl_reduction: str = option(choices=KL_REDUCTIONS)
    epochs: int = option(minimum=0)
    batch_size: int = option(minimum=1)
    lr: float = option(positive=True)
    momentum: float = option(nonneg=True)
    weight_decay: float = option(nonneg=True)
    swa: bool = option()
    swa_start: int = option(minimum=0)
    swa_freq: int = option(minimum=1)
    swa_lr: Optional[float] = option(positive=True)


@ALGORITHMS.register("fedbe")
class FedBE(Algorithm):
    name = "fedbe"
    Options = FedBEOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.distribution, self.gaussian_fit, self.std_scale = o.distribution, o.gaussian_fit, o.std_scale
        self.dirichlet_alpha, self.num_samples, self.ensemble = o.dirichlet_alpha, o.num_samples, o.ensemble
        if "samples" in self.ensemble and self.num_samples == 0:
            raise FedbenchError("algorithm.ensemble lists samples but algorithm.num_samples is 0")
        self.temperature, self.kl_reduction = o.temperature, o.kl_reduction
        self.epochs, self.batch_size, self.lr, self.momentum = o.epochs, o.batch_size, o.lr, o.momentum
        self.weight_decay, self.swa, self.swa_start = o.weight_decay, o.swa, o.swa_start
        self.swa_freq, self.swa_lr = o.swa_freq, o.swa_lr
        if setup.task != "classification":
            raise FedbenchError(f"fedbe needs a classification task, got {setup.task!r}")
        setup.require_server_unlabeled(self.name)
        with torch.no_grad():
            out = setup.model(setup.server_unlabeled[:1])
        if out.shape[-1] < 2:
            raise FedbenchError("fedbe needs a model with >= 2 output logits (softmax pseudo-labels)")

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None   # round 1: plain local training, the shared cached clients

    # --- server -------------------------------------------------------------------------
    def sample_models(self, clients: List[Params], sizes: List[int], start: Params, mean: Params,
                      round_idx: int) -> List[Params]:
        if self.num_samples == 0:
            return []
        seed = method_seed("fedbe", self.setup.seed, round_idx, tag=1)
        if self.distribution == "dirichlet":
            conc = dirichlet_concentration(sizes, self.dirichlet_alpha)
            return sample_dirichlet(clients, conc, self.num_samples, np.random.default_rng(seed))[0]
        gen = torch.Generator().manual_seed(seed)
        if self.gaussian_fit == "weights":
            _, var = fit_gaussian(clients, sizes)
            return sample_gaussian(mean, var, self.num_samples, gen, self.std_scale)
        mean_u, var_u, norm = fit_gaussian_released(clients, start)
        return sample_gaussian_released(start, mean_u, var_u, norm, self.num_samples, gen, self.std_scale)

    def aggregate(self, messages, state, round_idx):
        dev = self.setup.device
        messages = sorted(messages, key=lambda m: m.client_id)
        clients = [{n: t.detach().to(dev) for n, t in m.payload["params"].items()} for m in messages]
        sizes = [m.num_samples for m in messages]
        start = {n: t.detach().to(dev) for n, t in state["params"].items()}
        mean = weighted_average(clients, sizes)   # μ (= FedAvg): the Gaussian's mean and the student's start
        samples = self.sample_models(clients, sizes, start, mean, round_idx)
        members = build_ensemble(self.ensemble, mean, samples, clients)
        x = self.setup.server_unlabeled
        targets = pseudo_labels(self.setup.model, members, x, self.setup.eval_batch_size, self.temperature)
        final, last, trace = self.distill(mean, x, targets, round_idx)
        extra = {"fedavg": mean, "ensemble": members}
        if self.swa:
            extra["fedbe_last"] = last
        return {**state, "params": final, "extra_eval": extra, "trace": trace}

    def distill(self, start: Params, x: Tensor, targets: Tensor, round_idx: int
                ) -> Tuple[Params, Params, List[Dict[str, float]]]:
        """SGD on KL(targets ‖ student) over ``x`` from ``start``; returns (SWA or last weights, last, trace)."""
        model = self.setup.model
        student = {n: t.detach().clone().requires_grad_(True) for n, t in start.items()}
        opt = torch.optim.SGD(list(student.values()), lr=self.lr, momentum=self.momentum,
                              weight_decay=self.weight_decay)
        gen = method_generator("fedbe", self.setup.seed, round_idx, tag=2)
        swa = WeightAverage()
        steps, trace = [0], []

        def batch_loss(idx: Tensor) -> Tensor:
            if self.swa and self.swa_lr is not None and steps[0] >= self.swa_start:
                for g in opt.param_groups:   # torchcontrib's swa_lr: a constant lr from swa_start on
                    g["lr"] = self.swa_lr
            return kl_to_targets(torch.func.functional_call(model, student, (x[idx],)), targets[idx], self.kl_reduction)

        def after_step() -> None:
            steps[0] += 1
            if self.swa and steps[0] > self.swa_start and steps[0] % self.swa_freq == 0:
                swa.update(student)   # torchcontrib's automatic mode (1-based step counter)

        was = model.training
        model.train()   # [code] net.train() while distilling (dropout active where a model has it)
        try:
            for ep in range(self.epochs):
                t0 = time.perf_counter()
                loss = distill_epoch(x.shape[0], self.batch_size, gen, x.device, batch_loss, opt, after_step)
                trace.append({"round": round_idx, "epoch": ep + 1, "kd_loss": loss, "steps": steps[0],
                              "swa_snapshots": swa.n, "seconds": time.perf_counter() - t0})
        finally:
            model.train(was)
        last = {n: t.detach().clone() for n, t in student.items()}
        # no snapshot yet (fewer steps than swa_start): the last iterate, as torchcontrib's swap skips empty buffers
        final = swa.avg if (self.swa and swa.n > 0) else last
        return {n: t.to(start[n].dtype) for n, t in final.items()}, last, trace
