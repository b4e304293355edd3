"""FOLA §IV-E (Figs. 10-12): Laplace approximations of softmax regression with two clients.

Notes: ``../shared/reference/notes/fola.md`` §1.3, §1.7, §1.8-11, §3.2-3.4, §4 (Figs. 10-12), §6 row R7.

Model: softmax regression 784-10 (7,850 parameters), written here as Θ ∈ R^{C×(D+1)} = [W | b] acting on
x̃ = [x; 1]; a flat parameter vector is Θ.reshape(-1) (class-major, bias last in each class row).
``model_order`` maps it to ``nn.Linear``'s (weight, bias) order, which the heat map of Fig. 10(a) uses.

Curvatures of the mean task loss (1/N Σ CE):

* ``full``: the exact Hessian H = (1/N) Σ_i (diag p_i − p_i p_iᵀ) ⊗ x̃_i x̃_iᵀ (note §5), dense P×P;
* ``efull``: the *sorted eigenvalues* of that Hessian on the diagonal, in ``eigh`` order and not
  matched to parameters (the note's reading of "e-full", §1.8-11; ``efull_reading: sorted_diagonal``), or
  their mean times the identity (``efull_reading: isotropic``, tr(H)/P · I: an alternative reading tested in
  results/gaps.md#fola-figures10-11);
* ``diag``: the diagonal empirical Fisher (1/N) Σ_i (p_i − e_{y_i})² ⊗ x̃_i² (per-sample squares);
* ``identity``: FedAvg (the product of identity-covariance Gaussians is the weighted mean).

Styles: ``online`` = the mean over the local SGD steps of the minibatch curvature at the current weights
(Eq. 22, "presumably" for the full Hessian, §1.7); ``offline`` = one pass at the trained weights.
Client precision Λ_n = F_n / r + (r − 1)/r · Λ_S (Eq. 24); server Λ_S = Σ π_n Λ_n,
μ_S = (Λ_S + εI)⁻¹ Σ π_n Λ_n μ_n (Eq. 12 with the code's ε, §1.3). Local training: SGD from μ_S on the
mean CE + λ · ½ (θ − μ_S)ᵀ Λ_S (θ − μ_S) (λ is not stated for §IV-E; FedAvg uses λ = 0).
The next round's model is aggregated at the data weights (π₁ = m₁/m ≈ 0.51 on MNIST {0-4}/{5-9}, §3.4)
unless ``pi1`` is given; at ``sweep_rounds`` the π₁ ∈ [0, 1] curves of Fig. 10(b)(c) are evaluated:
θ_S(π₁) = (π₁Λ₁ + (1−π₁)Λ₂ + εI)⁻¹ (π₁Λ₁μ₁ + (1−π₁)Λ₂μ₂) (the ridge line) and π₁μ₁ + (1−π₁)μ₂ (FedAvg).

Fig. 12 (``run_correlation``; §3.5, §4 "Fig. 12", §6 R8): the full-Laplace run's model after ``rounds`` (15)
rounds is the optimum θ* with precision Λ*, D(θ, θ*) = ½ (θ − θ*)ᵀ Λ* (θ − θ*). AE = D(μ_S, θ*) of each
method's aggregated model (read at round 3 in the figure, every round recorded) against its GA; LF =
Σ π_n D(θ_n, θ*) of the client models of round ``rounds`` + 1, trained from θ* for E ∈ ``lf_epochs`` epochs
with each method's local loss (its prior centred at θ* with the method's own final global precision, none for
FedAvg — the note leaves this open), against LA = Σ π_n acc(θ_n).

``run_from_config`` runs either study from a fedbench config (an experiment preset with ``table.study:
fola_laplace``; fedbench.report.studies) and writes its CSVs next to a run record.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from omegaconf import OmegaConf
import numpy as np

from fedbench.errors import FedbenchError
from fedbench.numerics import current
from fedbench.train.engine import client_generator, epoch_batches
from fedbench.data import load_dataset
from fedbench.partition import make_partition
from fedbench.models import build_model
from fedbench.run.setup import normalization, resolve_device, set_threads

#: method name -> (curvature, style); Fig. 10/11's seven curves
METHODS: Dict[str, Tuple[str, str]] = {
    "full_online": ("full", "online"), "full_offline": ("full", "offline"),
    "efull_online": ("efull", "online"), "efull_offline": ("efull", "offline"),
    "diag_online": ("diag", "online"), "diag_offline": ("diag", "offline"),
    "fedavg": ("identity", "identity"),
}

#: how "e-full" turns the full Hessian into a diagonal precision (§1.8-11 reads the first)
EFULL_READINGS = ("sorted_diagonal", "isotropic")


@dataclass
class StudyConfig:
    rounds: int = 10                  # §3.4: 10 rounds
    epochs: int = 1                   # E = 1
    lr: float = 0.01                  # lr = 0.01
    batch_size: int = 200             # B = 200
    lambda_prior: float = 1.0         # λ of the prior loss (not stated for §IV-E); FedAvg always 0
    prior_precision: float = 0.0      # γ: round-1 prior precision Λ_S = γI (§1.8-2)
    eps: float = 1e-5                 # ε added to Λ_S in the product (code, §1.3)
    pi1: Optional[float] = None       # aggregation weight of client 1 between rounds; None = data sizes
    sweep_points: int = 101           # π₁ grid on [0, 1]
    sweep_rounds: Sequence[int] = (1, 10)   # Fig. 10(b) round 1, (c) round 10
    methods: Sequence[str] = tuple(METHODS)
    seed: int = 0
    efull_reading: str = "sorted_diagonal"   # sorted_diagonal (note §1.8-11) | isotropic (mean eigenvalue · I)
    chunk_size: int = 256             # samples per Hessian chunk (memory only)
    heatmap_size: int = 1000          # Fig. 10(a): first 1000 parameters

    def validate(self) -> None:
        for key in ("rounds", "epochs", "batch_size", "sweep_points", "chunk_size", "heatmap_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if key == "sweep_points" else 1):
                raise FedbenchError(f"study {key} must be an integer >= {2 if key == 'sweep_points' else 1}, got {v!r}")
        for key in ("lr",):
            if not float(getattr(self, key)) > 0:
                raise FedbenchError(f"study {key} must be > 0, got {getattr(self, key)!r}")
        for key in ("lambda_prior", "prior_precision", "eps"):
            if not float(getattr(self, key)) >= 0:
                raise FedbenchError(f"study {key} must be >= 0, got {getattr(self, key)!r}")
        if self.pi1 is not None and not 0 <= float(self.pi1) <= 1:
            raise FedbenchError(f"study pi1 must be in [0, 1] or None, got {self.pi1!r}")
        if self.efull_reading not in EFULL_READINGS:
            raise FedbenchError(f"study efull_reading must be one of {', '.join(EFULL_READINGS)}, "
                                f"got {self.efull_reading!r}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise FedbenchError(f"unknown study method(s) {bad}; choose from {', '.join(METHODS)}")


@dataclass
class StudyResult:
    rounds: List[dict] = field(default_factory=list)      # per method and round: GA, NLL, LA, cosine
    sweep: List[dict] = field(default_factory=list)       # per method, sweep round and π₁: GA, NLL
    heatmaps: Dict[str, Tensor] = field(default_factory=dict)   # method -> normalised Λ₁ block (round 1)
    states: Dict[str, dict] = field(default_factory=dict)  # method -> final (μ_S, Λ_S)
    means: Dict[str, List[Tensor]] = field(default_factory=dict)   # method -> μ_S after each round
    correlation: List[dict] = field(default_factory=list)  # Fig. 12: AE rows (per method, round), LF rows (per E)


# ---- softmax regression -----------------------------------------------------------------------------------
def augment(x: Tensor) -> Tensor:
    """x̃ = [x; 1], flattened inputs."""
    x = x.reshape(x.shape[0], -1)
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1)


def logits(theta: Tensor, xt: Tensor) -> Tensor:
    """theta: [C, D+1] (or flat), xt: [N, D+1]."""
    return xt @ theta.reshape(-1, xt.shape[1]).T


def mean_loss(theta: Tensor, xt: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits(theta, xt), y)


def mean_grad(theta: Tensor, xt: Tensor, y: Tensor) -> Tensor:
    """∇ of the mean CE, [C, D+1]: (1/N) Σ_i (p_i − e_{y_i}) x̃_iᵀ."""
    r = torch.softmax(logits(theta, xt), 1)
    r[torch.arange(len(y), device=y.device), y] -= 1
    return r.T @ xt / xt.shape[0]


def diag_fisher_sum(theta: Tensor, xt: Tensor, y: Tensor) -> Tensor:
    """Σ_i of the per-sample squared gradients, flat [C(D+1)]: ((p − e)²)ᵀ x̃²."""
    r = torch.softmax(logits(theta, xt), 1)
    r[torch.arange(len(y), device=y.device), y] -= 1
    return ((r * r).T @ (xt * xt)).reshape(-1)


class HessianAccumulator:
    """Σ_i w (diag p_i − p_i p_iᵀ) ⊗ x̃_i x̃_iᵀ, accumulated in block layout with one GEMM per chunk
    (block (c, d) = X̃ᵀ diag(A_{:,c,d}) X̃). A is symmetric in (c, d), so block (d, c) equals block (c, d): only the
    C(C+1)/2 blocks with c ≤ d are accumulated (0.55 of the GEMM for C = 10) and ``dense`` mirrors them."""

    def __init__(self, num_classes: int, d1: int, dtype, device, chunk_size: int = 256):
        self.C, self.D1, self.chunk = num_classes, d1, int(chunk_size)
        self.rows, self.cols = torch.triu_indices(num_classes, num_classes, device=device)
        self.blocks = torch.zeros(self.rows.numel() * d1, d1, dtype=dtype, device=device)

    def add(self, theta: Tensor, xt: Tensor, weight: float = 1.0) -> None:
        for s in range(0, xt.shape[0], self.chunk):
            xc = xt[s: s + self.chunk]
            p = torch.softmax(logits(theta, xc), 1)
            a = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]          # [n, C, C]
            a_upper = a[:, self.rows, self.cols]                              # [n, C(C+1)/2]
            yk = (a_upper[:, :, None] * xc[:, None, :]).reshape(xc.shape[0], -1)
            self.blocks.addmm_(yk.T, xc, alpha=weight)

    def dense(self) -> Tensor:
        C, D1 = self.C, self.D1
        upper = self.blocks.view(-1, D1, D1)
        full = upper.new_empty(C, C, D1, D1)
        full[self.rows, self.cols] = upper
        full[self.cols, self.rows] = upper
        return full.permute(0, 2, 1, 3).reshape(C * D1, C * D1)


def hessian(theta: Tensor, xt: Tensor, chunk_size: int = 256) -> Tensor:
    """Exact Hessian of the mean CE of softmax regression, [P, P] in the flat Θ order."""
    C = theta.reshape(-1, xt.shape[1]).shape[0]
    acc = HessianAccumulator(C, xt.shape[1], xt.dtype, xt.device, chunk_size)
    acc.add(theta, xt, 1.0 / xt.shape[0])
    return acc.dense()


def efull_precision(h: Tensor, reading: str = "sorted_diagonal") -> Tensor:
    """"e-full" as a diagonal: the Hessian's eigenvalues (ascending, clamped at 0; §1.8-11), or with
    ``reading="isotropic"`` their mean on every entry (tr(H)/P: the Hessian of the CE is PSD, so no eigh)."""
    if reading == "isotropic":
        return torch.full((h.shape[0],), float(torch.diagonal(h).sum().clamp_min(0)) / h.shape[0],
                          dtype=h.dtype, device=h.device)
    return torch.linalg.eigvalsh(h).clamp_min(0)


def model_order(num_classes: int, in_features: int, device=None) -> Tensor:
    """Flat-Θ indices in ``nn.Linear`` order: weight (row-major), then bias."""
    d1 = in_features + 1
    c = torch.arange(num_classes, device=device)
    w = (c[:, None] * d1 + torch.arange(in_features, device=device)[None, :]).reshape(-1)
    return torch.cat([w, c * d1 + in_features])


def to_linear(theta: Tensor, in_features: int) -> Dict[str, Tensor]:
    t = theta.reshape(-1, in_features + 1)
    return {"weight": t[:, :in_features].clone(), "bias": t[:, in_features].clone()}


def from_linear(weight: Tensor, bias: Tensor) -> Tensor:
    return torch.cat([weight, bias[:, None]], 1).reshape(-1)


# ---- precisions: ("dense", [P, P]) | ("diag", [P]) | ("identity", None) -----------------------------------
Precision = Tuple[str, Optional[Tensor]]


def _comb(terms: Sequence[Tuple[float, Precision]]) -> Precision:
    kind = terms[0][1][0]
    if kind == "identity":
        return ("identity", None)
    out = None
    for w, (_, t) in terms:
        out = t * w if out is None else out + t * w
    return (kind, out)


def matvec(prec: Precision, v: Tensor) -> Tensor:
    kind, t = prec
    if kind == "dense":
        return t @ v
    if kind == "diag":
        return t * v
    return v


def gaussian_product(precs: Sequence[Precision], means: Sequence[Tensor], weights: Sequence[float],
                     eps: float) -> Tuple[Tensor, Precision]:
    """Eq. 12: Λ_S = Σ π_n Λ_n, μ_S = (Λ_S + εI)⁻¹ Σ π_n Λ_n μ_n; identity precisions give the weighted mean."""
    w = [float(x) / sum(weights) for x in weights]
    kind = precs[0][0]
    if kind == "identity":
        return sum(wi * m for wi, m in zip(w, means)), ("identity", None)
    lam = _comb(list(zip(w, precs)))
    rhs = sum(wi * matvec(p, m) for wi, p, m in zip(w, precs, means))
    if kind == "diag":
        return rhs / (lam[1] + eps), lam
    a = lam[1] + eps * torch.eye(lam[1].shape[0], dtype=lam[1].dtype, device=lam[1].device)
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(rhs[:, None], chol)[:, 0], lam
    return torch.linalg.lstsq(a, rhs[:, None]).solution[:, 0], lam


def ridge_curve(prec1: Precision, mu1: Tensor, prec2: Precision, mu2: Tensor, pis: Tensor, eps: float) -> Tensor:
    """θ_S(π₁) for every π₁ in ``pis`` ([K, P]): the Gaussian-product ridge line (§3.4), or the FedAvg
    segment for identity precisions. Dense: one simultaneous diagonalisation, Λ₂ + εI = LLᵀ,
    L⁻¹(Λ₁ − Λ₂)L⁻ᵀ = QDQᵀ, so (π₁Λ₁ + (1−π₁)Λ₂ + εI)⁻¹ = W (I + π₁D)⁻¹ Wᵀ with W = L⁻ᵀQ."""
    pis = pis.to(mu1.dtype).to(mu1.device)
    kind = prec1[0]
    if kind == "identity":
        return pis[:, None] * mu1[None] + (1 - pis[:, None]) * mu2[None]
    b1, b2 = matvec(prec1, mu1), matvec(prec2, mu2)
    if kind == "diag":
        num = pis[:, None] * b1[None] + (1 - pis[:, None]) * b2[None]
        den = pis[:, None] * prec1[1][None] + (1 - pis[:, None]) * prec2[1][None] + eps
        return num / den
    l1, l2 = prec1[1], prec2[1]
    eye = torch.eye(l1.shape[0], dtype=l1.dtype, device=l1.device)
    chol, info = torch.linalg.cholesky_ex(l2 + eps * eye)
    if int(info) != 0:   # Λ₂ + εI not positive definite (ε = 0 with a singular Λ₂): one solve per π₁
        out = []
        for p in pis.tolist():
            prec, rhs = p * l1 + (1 - p) * l2 + eps * eye, p * b1 + (1 - p) * b2
            out.append(torch.linalg.lstsq(prec, rhs[:, None]).solution[:, 0])
        return torch.stack(out)
    x = torch.linalg.solve_triangular(chol, l1 - l2, upper=False)           # L⁻¹ (Λ₁ − Λ₂)
    m = torch.linalg.solve_triangular(chol, x.T, upper=False)               # L⁻¹ (Λ₁ − Λ₂) L⁻ᵀ
    del x
    d, q = torch.linalg.eigh((m + m.T) / 2)
    del m
    wmat = torch.linalg.solve_triangular(chol.T, q, upper=True)             # W = L⁻ᵀ Q
    z1, z2 = wmat.T @ b1, wmat.T @ b2
    z = (pis[:, None] * z1[None] + (1 - pis[:, None]) * z2[None]) / (1 + pis[:, None] * d[None])
    return z @ wmat.T


def normalized_cosine(p1: Precision, p2: Precision) -> float:
    """Fig. 11(a): cosine similarity of the vectorised min-max-normalised precision matrices."""
    if p1[0] == "identity":
        return 1.0
    if p1[0] == "dense":
        a, b = [(t - t.min()) / (t - t.min()).max().clamp_min(1e-300) for t in (p1[1], p2[1])]
        return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300))
    P = p1[1].numel()
    parts = []
    for t in (p1[1], p2[1]):               # a diagonal matrix: P diagonal values, P² − P zeros
        lo = min(float(t.min()), 0.0)
        hi = max(float(t.max()), 0.0)
        s = max(hi - lo, 1e-300)
        parts.append(((t - lo) / s, (0.0 - lo) / s))
    (da, oa), (db, ob) = parts
    off = P * P - P
    dot = float((da * db).sum()) + off * oa * ob
    na = (float((da * da).sum()) + off * oa * oa) ** 0.5
    nb = (float((db * db).sum()) + off * ob * ob) ** 0.5
    return dot / max(na * nb, 1e-300)


def normalized_block(prec: Precision, order: Tensor, k: int) -> Tensor:
    """Fig. 10(a): the normalised precision (subtract the min, divide by the max) on the first k params."""
    kind, t = prec
    if kind != "dense":
        raise FedbenchError("the Fig. 10(a) heat map needs a dense (full) precision")
    t = (t - t.min())
    t = t / t.max().clamp_min(1e-300)
    ix = order[:k]
    return t[ix][:, ix].clone()


def posterior_distance(theta: Tensor, mu_star: Tensor, prec_star: Precision) -> float:
    """D(θ, θ*) = ½ (θ − μ*)ᵀ Λ* (θ − μ*) (AE / LF of Fig. 12, §3.5)."""
    d = theta - mu_star
    return float(0.5 * d @ matvec(prec_star, d))


def evaluate(theta: Tensor, xt: Tensor, y: Tensor) -> Dict[str, float]:
    z = logits(theta, xt)
    return {"accuracy": float((z.argmax(1) == y).double().mean()), "nll": float(F.cross_entropy(z, y))}


# ---- one client's round --------------------------------------------------------------------------------------
def _curvature(kind: str, theta: Tensor, xt: Tensor, y: Tensor, C: int, chunk: int) -> Tensor:
    if kind == "diag":
        return diag_fisher_sum(theta, xt, y) / xt.shape[0]
    return hessian(theta, xt, chunk)


def client_round(theta0: Tensor, xt: Tensor, y: Tensor, *, curvature: str, style: str, prior_mean: Tensor,
                 prior_prec: Precision, lam: float, round_idx: int, cfg: StudyConfig, client_id: int,
                 num_classes: int) -> Tuple[Tensor, Precision]:
    """Local SGD from θ₀ (prior loss λ·½(θ−μ_S)ᵀΛ_S(θ−μ_S)), then Λ_n = F_n/r + (r−1)/r Λ_S (Eq. 24)."""
    theta = theta0.clone()
    gen = client_generator(cfg.seed, round_idx, client_id)
    n = xt.shape[0]
    online = style == "online" and curvature != "identity"
    hacc = (HessianAccumulator(num_classes, xt.shape[1], xt.dtype, xt.device, cfg.chunk_size)
            if online and curvature in ("full", "efull") else None)
    dacc = torch.zeros_like(theta) if online and curvature == "diag" else None
    steps = 0
    for _ in range(cfg.epochs):
        for b in epoch_batches(n, cfg.batch_size, gen, False):
            b = b.to(xt.device)
            xb, yb = xt[b], y[b]
            if hacc is not None:
                hacc.add(theta, xb, 1.0 / len(b))
            if dacc is not None:
                dacc += diag_fisher_sum(theta, xb, yb) / len(b)
            steps += 1
            g = mean_grad(theta, xb, yb).reshape(-1)
            if lam > 0:
                g = g + lam * matvec(prior_prec, theta - prior_mean)
            theta = theta - cfg.lr * g
    if curvature == "identity":
        return theta, ("identity", None)
    if online:
        f = hacc.dense() / max(steps, 1) if hacc is not None else dacc / max(steps, 1)
    else:
        f = _curvature(curvature, theta, xt, y, num_classes, cfg.chunk_size)
    if curvature == "efull":
        f = efull_precision(f, cfg.efull_reading)
    kind = "dense" if curvature == "full" else "diag"
    r = int(round_idx)
    prec = _comb([(1.0 / r, (kind, f)), ((r - 1) / r, prior_prec)])
    return theta, prec


# ---- the study ---------------------------------------------------------------------------------------------
def run_method(method: str, clients: Sequence[Tuple[Tensor, Tensor]], test: Tuple[Tensor, Tensor],
               cfg: StudyConfig, init: Tensor, num_classes: int, result: StudyResult, log=None) -> None:
    curvature, style = METHODS[method]
    xts = [augment(x) for x, _ in clients]
    ys = [y for _, y in clients]
    xtest, ytest = augment(test[0]), test[1]
    P = init.numel()
    d_in = xts[0].shape[1] - 1
    sizes = [float(x.shape[0]) for x in xts]
    if cfg.pi1 is None:
        weights = [s / sum(sizes) for s in sizes]
    else:
        weights = [float(cfg.pi1), 1.0 - float(cfg.pi1)]
    if curvature == "identity":
        prior: Precision = ("identity", None)
    elif curvature == "full":
        prior = ("dense", cfg.prior_precision * torch.eye(P, dtype=init.dtype, device=init.device))
    else:
        prior = ("diag", torch.full((P,), float(cfg.prior_precision), dtype=init.dtype, device=init.device))
    lam = 0.0 if curvature == "identity" else float(cfg.lambda_prior)
    mu = init.clone()
    order = model_order(num_classes, d_in, init.device)
    pis = torch.linspace(0, 1, cfg.sweep_points, dtype=torch.float64)
    for r in range(1, cfg.rounds + 1):
        thetas, precs = [], []
        for k, (xt, y) in enumerate(zip(xts, ys)):
            th, pr = client_round(mu, xt, y, curvature=curvature, style=style, prior_mean=mu, prior_prec=prior,
                                  lam=lam, round_idx=r, cfg=cfg, client_id=k, num_classes=num_classes)
            thetas.append(th)
            precs.append(pr)
        la = sum(w * evaluate(th, xtest, ytest)["accuracy"] for w, th in zip(weights, thetas))
        cos = normalized_cosine(precs[0], precs[1]) if len(precs) == 2 else float("nan")
        if r == 1 and curvature == "full":
            result.heatmaps[method] = normalized_block(precs[0], order, min(cfg.heatmap_size, P)).cpu()
        if r in cfg.sweep_rounds and len(thetas) == 2:
            curve = ridge_curve(precs[0], thetas[0], precs[1], thetas[1], pis, cfg.eps)
            for p, th in zip(pis.tolist(), curve):
                ev = evaluate(th, xtest, ytest)
                result.sweep.append({"method": method, "curvature": curvature, "style": style, "round": r,
                                     "pi1": p, "global_accuracy": ev["accuracy"], "global_nll": ev["nll"]})
        mu, prior = gaussian_product(precs, thetas, weights, cfg.eps)
        ev = evaluate(mu, xtest, ytest)
        row = {"method": method, "curvature": curvature, "style": style, "round": r,
               "global_accuracy": ev["accuracy"], "global_nll": ev["nll"], "local_accuracy": la,
               "precision_cosine": cos, "pi1": weights[0]}
        result.rounds.append(row)
        result.means.setdefault(method, []).append(mu)
        if log is not None:
            log(row)
    result.states[method] = {"mean": mu, "precision": prior}


def run_study(clients: Sequence[Tuple[Tensor, Tensor]], test: Tuple[Tensor, Tensor], cfg: StudyConfig, *,
              init: Optional[Tensor] = None, num_classes: Optional[int] = None, log=None,
              store: Optional["MethodStore"] = None) -> StudyResult:
    """Run every method of ``cfg.methods`` on the clients' (x, y) (inputs flattened floats, already
    normalised) and evaluate on ``test``. ``init``: flat Θ₀ (default zeros); computations use its dtype.
    ``store``: methods finished by an earlier, stopped run are restored from it, each new one is saved to it."""
    cfg.validate()
    if len(clients) != 2:
        raise FedbenchError(f"the §IV-E study has two clients, got {len(clients)}")
    if num_classes is None:
        num_classes = int(max(int(y.max()) for _, y in clients) + 1)
        num_classes = max(num_classes, int(test[1].max()) + 1)
    d1 = clients[0][0].reshape(clients[0][0].shape[0], -1).shape[1] + 1
    if init is None:
        init = torch.zeros(num_classes * d1, dtype=torch.float64, device=clients[0][0].device)
    if init.numel() != num_classes * d1:
        raise FedbenchError(f"study init has {init.numel()} values, expected {num_classes * d1}")
    dt = init.dtype
    clients = [(x.to(dt), y) for x, y in clients]
    test = (test[0].to(dt), test[1])
    result = StudyResult()
    for m in cfg.methods:
        if store is not None and store.restore(m, result):
            continue
        run_method(m, clients, test, cfg, init.reshape(-1), num_classes, result, log)
        if store is not None:
            store.save(m, result)
    return result


class MethodStore:
    """A study's finished methods, one file each under ``folder``, so that a study stopped part-way resumes at its
    next method (Figs. 10-11's paper run is about 1.5 CPU h, longer than a busy session's core keeps it). A method's
    results depend only on the config, the data and its own (seed, round, client) generators, never on the methods
    run before it, so a restored method equals a recomputed one. ``stamp`` (numerics version, client sizes) must
    match, else the file is recomputed over. A full-Hessian method's file holds its dense final precision (about
    0.5 GB at 7,850 parameters in float64) until the study's files are written."""

    def __init__(self, folder: Path, stamp: Mapping[str, Any], log=None, device: Any = "cpu"):
        self.folder, self.stamp, self.log, self.device = Path(folder), dict(stamp), log, device

    def _path(self, method: str) -> Path:
        return self.folder / f"{method}.pt"

    def save(self, method: str, result: StudyResult) -> None:
        part = {"stamp": self.stamp,
                "rounds": [r for r in result.rounds if r["method"] == method],
                "sweep": [r for r in result.sweep if r["method"] == method],
                "heatmap": result.heatmaps.get(method), "means": result.means.get(method, []),
                "state": result.states[method]}
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self._path(method).with_suffix(".tmp")
        torch.save(part, tmp)
        tmp.replace(self._path(method))   # atomic: a kill mid-write leaves the method to recompute, never half a file

    def restore(self, method: str, result: StudyResult) -> bool:
        path = self._path(method)
        if not path.is_file():
            return False
        try:
            part = torch.load(path, map_location=self.device, weights_only=True)
        except Exception:   # unreadable: recompute the method
            return False
        if part.get("stamp") != self.stamp:
            return False
        result.rounds.extend(part["rounds"])
        result.sweep.extend(part["sweep"])
        if part["heatmap"] is not None:
            result.heatmaps[method] = part["heatmap"]
        result.means[method] = list(part["means"])
        result.states[method] = part["state"]
        if self.log is not None:
            last = part["rounds"][-1]
            self.log(f"fola study: {method} restored from {path} (finished before: {len(part['rounds'])} rounds, "
                     f"GA {100 * last['global_accuracy']:.2f})")
        return True

    def clear(self) -> None:
        for f in self.folder.glob("*.pt"):
            f.unlink()
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()


# ---- Fig. 12: AE / LF against a full-Laplace optimum -------------------------------------------------------
def _weights(cfg: StudyConfig, sizes: Sequence[float]) -> List[float]:
    return [s / sum(sizes) for s in sizes] if cfg.pi1 is None else [float(cfg.pi1), 1.0 - float(cfg.pi1)]


def run_correlation(clients: Sequence[Tuple[Tensor, Tensor]], test: Tuple[Tensor, Tensor], cfg: StudyConfig, *,
                    reference: str = "full_online", lf_epochs: Sequence[int] = (1, 2, 5, 10, 20),
                    init: Optional[Tensor] = None, num_classes: Optional[int] = None, log=None,
                    store: Optional[MethodStore] = None) -> StudyResult:
    """Fig. 12: every method of ``cfg.methods`` (which must include ``reference``, a full-Hessian method) for
    ``cfg.rounds`` rounds, then AE rows (method, round: D(μ_S, θ*), GA) and LF rows (method, E: Σπ D(θ_n, θ*),
    LA) in ``result.correlation``."""
    if reference not in cfg.methods or METHODS[reference][0] != "full":
        raise FedbenchError(f"the Fig. 12 reference must be a full-Laplace method among the study's methods "
                            f"({', '.join(m for m in METHODS if METHODS[m][0] == 'full')}), got {reference!r}")
    bad = [e for e in lf_epochs if isinstance(e, bool) or not isinstance(e, int) or e < 1]
    if bad or not lf_epochs:
        raise FedbenchError(f"study lf_epochs must be integers >= 1, got {list(lf_epochs)!r}")
    result = run_study(clients, test, cfg, init=init, num_classes=num_classes, log=log, store=store)
    theta_star = result.states[reference]["mean"]
    prec_star = result.states[reference]["precision"]
    xts = [augment(x.to(theta_star.dtype)) for x, _ in clients]
    ys = [y for _, y in clients]
    xtest, ytest = augment(test[0].to(theta_star.dtype)), test[1]
    ncls = int(theta_star.numel() // xts[0].shape[1])
    weights = _weights(cfg, [float(x.shape[0]) for x in xts])
    for m in cfg.methods:
        for r, mu in enumerate(result.means[m], 1):
            result.correlation.append({"kind": "ae", "method": m, "round": r, "epochs": cfg.epochs,
                                       "distance": posterior_distance(mu, theta_star, prec_star),
                                       "accuracy": evaluate(mu, xtest, ytest)["accuracy"]})
    for m in cfg.methods:
        curvature, _ = METHODS[m]
        lam = 0.0 if curvature == "identity" else float(cfg.lambda_prior)
        prior = result.states[m]["precision"]
        for e in lf_epochs:
            sub = dataclasses.replace(cfg, epochs=int(e))
            thetas = [client_round(theta_star, xt, y, curvature="identity", style="identity", prior_mean=theta_star,
                                   prior_prec=prior, lam=lam, round_idx=cfg.rounds + 1, cfg=sub, client_id=k,
                                   num_classes=ncls)[0] for k, (xt, y) in enumerate(zip(xts, ys))]
            result.correlation.append({
                "kind": "lf", "method": m, "round": cfg.rounds + 1, "epochs": int(e),
                "distance": sum(w * posterior_distance(t, theta_star, prec_star) for w, t in zip(weights, thetas)),
                "accuracy": sum(w * evaluate(t, xtest, ytest)["accuracy"] for w, t in zip(weights, thetas))})
    return result


# ---- driven by a fedbench config (experiment preset with table.study: fola_laplace) -------------------------
STUDY_KINDS = ("laplace", "correlation")
#: keys of the config's ``study`` block (with defaults); rounds, E, lr, B and the seed come from the run config
STUDY_KEYS: Dict[str, Any] = {
    "kind": "laplace", "methods": list(METHODS), "lambda_prior": 1.0, "prior_precision": 0.0, "eps": 1e-5,
    "pi1": None, "sweep_points": 101, "sweep_rounds": [1, 10], "chunk_size": 256, "heatmap_size": 1000,
    "max_per_client": 0, "input_pool": 1, "dtype": "float64", "reference": "full_online",
    "lf_epochs": [1, 2, 5, 10, 20], "efull_reading": "sorted_diagonal",
}


def study_settings(cfg) -> Tuple[Dict[str, Any], StudyConfig]:
    """(the ``study`` block with defaults, the StudyConfig) from a composed config; one-line FedbenchError on
    bad input, before any data are loaded."""

    block = OmegaConf.to_container(cfg.get("study") or {}, resolve=True)
    unknown = sorted(set(block) - set(STUDY_KEYS))
    if unknown:
        raise FedbenchError(f"study has no key(s) {', '.join(unknown)}; known: {', '.join(STUDY_KEYS)}")
    st = {**STUDY_KEYS, **block}
    if st["kind"] not in STUDY_KINDS:
        raise FedbenchError(f"study.kind must be one of {', '.join(STUDY_KINDS)}, got {st['kind']!r}")
    for key in ("max_per_client",):
        if isinstance(st[key], bool) or not isinstance(st[key], int) or st[key] < 0:
            raise FedbenchError(f"study.{key} must be an integer >= 0, got {st[key]!r}")
    if isinstance(st["input_pool"], bool) or not isinstance(st["input_pool"], int) or st["input_pool"] < 1:
        raise FedbenchError(f"study.input_pool must be an integer >= 1, got {st['input_pool']!r}")
    if st["dtype"] not in ("float64", "float32"):
        raise FedbenchError(f"study.dtype must be float64 or float32, got {st['dtype']!r}")
    if int(cfg.num_clients) != 2:
        raise FedbenchError(f"the FOLA §IV-E study has two clients, got num_clients={cfg.num_clients}")
    local = cfg.local
    if str(local.optimizer) != "sgd" or float(local.momentum or 0) or float(local.weight_decay or 0):
        raise FedbenchError("the FOLA §IV-E study trains with plain SGD: set local.optimizer=sgd, momentum=0, "
                            "weight_decay=0")
    study = StudyConfig(rounds=int(cfg.rounds), epochs=int(local.epochs), lr=float(local.lr),
                        batch_size=int(local.batch_size), lambda_prior=float(st["lambda_prior"]),
                        prior_precision=float(st["prior_precision"]), eps=float(st["eps"]),
                        pi1=None if st["pi1"] is None else float(st["pi1"]), sweep_points=st["sweep_points"],
                        sweep_rounds=tuple(st["sweep_rounds"] or ()), methods=tuple(st["methods"]),
                        seed=int(cfg.seed), chunk_size=st["chunk_size"], heatmap_size=st["heatmap_size"],
                        efull_reading=str(st["efull_reading"]))
    study.validate()
    if st["kind"] == "correlation" and st["reference"] not in study.methods:
        raise FedbenchError(f"study.reference {st['reference']!r} must be one of study.methods")
    return st, study


def _client_data(cfg, st: Mapping[str, Any], launch_dir: Optional[str], device, dtype):
    dcfg = OmegaConf.to_container(cfg.dataset, resolve=True)
    pcfg = OmegaConf.to_container(cfg.partition, resolve=True)
    root = Path(str(cfg.paths.data_root)).expanduser()
    root = root if root.is_absolute() or launch_dir is None else Path(launch_dir) / root
    data = load_dataset(dcfg["name"], root, **(dcfg.get("kwargs") or {}))
    if data.task != "classification":
        raise FedbenchError(f"the FOLA §IV-E study needs a classification data set, got {dcfg['name']}")
    seed = int(cfg.seed)
    labels = np.asarray(data.train_y.cpu())
    parts = make_partition(pcfg["name"], labels, 2, seed, num_classes=data.num_classes or None,
                           **{k: v for k, v in pcfg.items() if k != "name"})
    if st["max_per_client"]:
        rng = np.random.default_rng(seed)
        parts = [np.sort(rng.choice(p, size=min(st["max_per_client"], len(p)), replace=False)) for p in parts]
    mean, std = normalization(dcfg.get("normalize", True), (data.mean, data.std))

    def flat(x: Tensor) -> Tensor:
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        if x.dim() == 4 and st["input_pool"] > 1:   # quick profiles: k×k average pooling shrinks the Hessian k⁴-fold
            x = F.avg_pool2d(x, st["input_pool"])
        if mean is not None:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            x = (x - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)
        return x.reshape(x.shape[0], -1)

    clients = [(flat(data.train_x[torch.as_tensor(p, dtype=torch.long)]).to(device, dtype),
                data.train_y[torch.as_tensor(p, dtype=torch.long)].long().to(device)) for p in parts]
    test = (flat(data.test_x).to(device, dtype), data.test_y.long().to(device))
    return clients, test, int(data.num_classes), [int(len(p)) for p in parts]


def initial_theta(seed: int, in_features: int, num_classes: int) -> Tensor:
    """fedbench's softmax_regression initialisation under ``seed`` (as run.py: manual_seed, then build)."""

    torch.manual_seed(seed)
    model = build_model("softmax_regression", input_shape=(in_features,), num_classes=num_classes,
                        in_features=in_features)
    named = dict(model.named_parameters())
    w = next(v for k, v in named.items() if k.endswith("weight"))
    b = next(v for k, v in named.items() if k.endswith("bias"))
    return from_linear(w.detach(), b.detach())


def run_from_config(cfg, out_dir: Path, *, launch_dir: Optional[str] = None, log=None) -> Dict[str, Any]:
    """Run the study a composed config describes (``study.kind``: laplace = Figs. 10-11, correlation =
    Fig. 12) and write ``rounds.csv``, ``sweep.csv``, ``correlation.csv`` and ``heatmap_<method>.pt`` into
    ``out_dir``; returns what the run record adds (files, client sizes, summary)."""
    import pandas as pd

    st, study = study_settings(cfg)
    if str(cfg.model.name) != "softmax_regression":
        raise FedbenchError(f"the FOLA §IV-E study is defined for model=softmax_regression, got {cfg.model.name}")
    device = resolve_device(str(cfg.hardware.device))
    dtype = getattr(torch, st["dtype"])
    clients, test, ncls, sizes = _client_data(cfg, st, launch_dir, device, dtype)
    t0 = time.perf_counter()
    say = log
    if log is not None:   # one line per method and round: the paper-scale study takes about an hour
        def say(row):
            log(f"fola study: {row['method']} round {row['round']}: GA {100 * row['global_accuracy']:.2f} "
                f"({time.perf_counter() - t0:.0f} s)")
    init = initial_theta(int(cfg.seed), clients[0][0].shape[1], ncls).to(device, dtype)
    # as run.py: hardware.num_threads (auto = 1 thread for < 10k parameters); on a busy 2-core machine two
    # threads made a 500x500 eigh 50x slower
    set_threads(cfg.hardware.get("num_threads"), device, int(init.numel()))
    out = Path(out_dir)
    # the finished methods of a stopped run of this config (the run directory is its run id)
    store = MethodStore(out / "study_resume", {"numerics": current("study:fola_laplace"), "client_sizes": sizes},
                        log=log, device=device)
    if st["kind"] == "laplace":
        res = run_study(clients, test, study, init=init, num_classes=ncls, log=say, store=store)
    else:
        res = run_correlation(clients, test, study, reference=st["reference"], lf_epochs=tuple(st["lf_epochs"]),
                              init=init, num_classes=ncls, log=say, store=store)
    out.mkdir(parents=True, exist_ok=True)
    files = {"rounds": "rounds.csv", "sweep": "sweep.csv", "correlation": "correlation.csv"}
    pd.DataFrame(res.rounds).to_csv(out / files["rounds"], index=False)
    pd.DataFrame(res.sweep, columns=["method", "curvature", "style", "round", "pi1", "global_accuracy",
                                     "global_nll"]).to_csv(out / files["sweep"], index=False)
    pd.DataFrame(res.correlation, columns=["kind", "method", "round", "epochs", "distance",
                                           "accuracy"]).to_csv(out / files["correlation"], index=False)
    for name, h in res.heatmaps.items():
        files[f"heatmap_{name}"] = f"heatmap_{name}.pt"
        torch.save(h, out / files[f"heatmap_{name}"])
    last = {}
    for row in res.rounds:
        last[row["method"]] = row
    summary = {m: {"global_accuracy": r["global_accuracy"], "local_accuracy": r["local_accuracy"]}
               for m, r in last.items()}
    store.clear()   # the study's files are written: the partial results are no longer needed
    return {"files": files, "client_sizes": sizes, "num_parameters": int(init.numel()), "summary": summary}
