"""Two clients' posteriors in 2-D and their server aggregates: the papers' toy illustrations.

FedLPA Fig. 6 (fedlpa.md §4 "Fig. 6": FedLPA vs the Fisher diagonal of Liu et al. 2021 vs FedAvg), FOLA Fig. 2
(fola.md §4 "Fig. 2": the mixture's ridge, where the Gaussian product lands, and FedAvg in the valley) and FedBEns
Fig. 1 (fedbens.md §4 "Fig. 1": a bimodal client whose broad secondary minimum decides the global optimum). The
papers give no numbers for any of them; the Gaussians below are ours, chosen to make each paper's point.

Aggregates of client Gaussians N(μ_k, Λ_k⁻¹) (every one a function below, tested):

* ``product``: the exact product ∏_k N(μ_k, Λ_k⁻¹) (renormalised): Λ = Σ w_k Λ_k, μ = Λ⁻¹ Σ w_k Λ_k μ_k
  (w_k = 1 is the posterior of the pooled data under a flat prior; uniform w_k move no mean).
* ``diag_product``: each Λ_k replaced by its diagonal (the diagonal Fisher), then the product: correlations ignored.
* K-FAC-style (``kfac_fisher``): in 2-D both weights belong to ONE linear unit with two inputs, w ∈ R², output
  s = wᵀa. Its empirical Fisher is F = E[e² a aᵀ] (e = ∂ℓ/∂s per sample), a full 2×2 block; K-FAC writes the block
  as a Kronecker product G ⊗ A with G = E[e²] (1×1, the output side) and A = E[a aᵀ] (2×2, the input side), i.e.
  it replaces E[e² a aᵀ] by E[e²] E[a aᵀ] (exact when e² and a aᵀ are uncorrelated). So in 2-D a block-diagonal
  K-FAC keeps the correlation between the two weights and errs only through that expectation split; the clients'
  per-sample (a, e) are drawn so that the split is visibly inexact. FedLPA's aggregate is the product of the
  clients' K-FAC Gaussians.
* ``fedavg_collapse``: FedAvg's point Σ w_k μ_k, drawn with the Gaussian that moment-matches the mixture
  Σ w_k N_k (FOLA's reading: FedAvg collapses the mixture of local posteriors into one Gaussian).
* ``mixture_product``: FedBEns: each client's posterior is a mixture of M Laplace components (one per local
  training run, equal weights 1/M); the product of mixtures is the mixture over component pairs (i, j) with
  component N_i·N_j renormalised and weight ∝ w_i w_j ∫N_i N_j = w_i w_j N(μ_i; μ_j, Σ_i + Σ_j).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import List, Optional, Sequence, Tuple

import numpy as np

LOG_2PI = float(np.log(2 * np.pi))


# ------------------------------------------------------------------------------------------------
# Gaussians and mixtures in 2-D
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gaussian2D:
    mean: np.ndarray        # (2,)
    precision: np.ndarray   # (2, 2), symmetric positive definite

    @classmethod
    def from_cov(cls, mean, cov) -> "Gaussian2D":
        return cls(np.asarray(mean, float), np.linalg.inv(np.asarray(cov, float)))

    @property
    def cov(self) -> np.ndarray:
        return np.linalg.inv(self.precision)

    def logpdf(self, pts) -> np.ndarray:
        d = np.asarray(pts, float) - self.mean
        quad = np.einsum("...i,ij,...j->...", d, self.precision, d)
        return 0.5 * np.linalg.slogdet(self.precision)[1] - LOG_2PI - 0.5 * quad

    def pdf(self, pts) -> np.ndarray:
        return np.exp(self.logpdf(pts))


@dataclass(frozen=True)
class Mixture2D:
    weights: np.ndarray                    # (M,), sums to 1
    components: Tuple[Gaussian2D, ...]

    def logpdf(self, pts) -> np.ndarray:
        logs = np.stack([np.log(w) + c.logpdf(pts) for w, c in zip(self.weights, self.components)])
        return _logsumexp(logs, axis=0)

    def pdf(self, pts) -> np.ndarray:
        return np.exp(self.logpdf(pts))

    def grad_hess_logpdf(self, x) -> Tuple[np.ndarray, np.ndarray]:
        """Gradient and Hessian of log p at one point x (2,)."""
        x = np.asarray(x, float)
        r = np.array([np.log(w) + c.logpdf(x) for w, c in zip(self.weights, self.components)])
        r = np.exp(r - _logsumexp(r, axis=0))            # responsibilities
        gs = [-c.precision @ (x - c.mean) for c in self.components]
        g = sum(ri * gi for ri, gi in zip(r, gs))
        h = sum(ri * (np.outer(gi, gi) - c.precision) for ri, gi, c in zip(r, gs, self.components))
        return g, h - np.outer(g, g)


def equal_mixture(components: Sequence[Gaussian2D]) -> Mixture2D:
    return Mixture2D(np.full(len(components), 1.0 / len(components)), tuple(components))


def _logsumexp(a, axis=0):
    m = np.max(a, axis=axis, keepdims=True)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(a - m), axis=axis))


# ------------------------------------------------------------------------------------------------
# aggregates
# ------------------------------------------------------------------------------------------------
def _weights(gs, weights) -> np.ndarray:
    return np.ones(len(gs)) if weights is None else np.asarray(weights, float)


def product(gs: Sequence[Gaussian2D], weights: Optional[Sequence[float]] = None) -> Gaussian2D:
    """∏_k N(μ_k, Λ_k⁻¹)^{w_k}, renormalised: precision Σ w_k Λ_k, mean (Σ w_k Λ_k)⁻¹ Σ w_k Λ_k μ_k."""
    w = _weights(gs, weights)
    lam = sum(wk * g.precision for wk, g in zip(w, gs))
    eta = sum(wk * g.precision @ g.mean for wk, g in zip(w, gs))
    return Gaussian2D(np.linalg.solve(lam, eta), lam)


def diagonal(g: Gaussian2D) -> Gaussian2D:
    """The diagonal-Fisher approximation: the precision's diagonal, correlations dropped."""
    return Gaussian2D(g.mean, np.diag(np.diag(g.precision)))


def diag_product(gs: Sequence[Gaussian2D], weights: Optional[Sequence[float]] = None) -> Gaussian2D:
    return product([diagonal(g) for g in gs], weights)


def fedavg_collapse(gs: Sequence[Gaussian2D], weights: Optional[Sequence[float]] = None) -> Gaussian2D:
    """FedAvg's point Σ p_k μ_k (p = normalised weights) with the moment-matched covariance of Σ p_k N_k."""
    p = _weights(gs, weights)
    p = p / p.sum()
    mean = sum(pk * g.mean for pk, g in zip(p, gs))
    cov = sum(pk * (g.cov + np.outer(g.mean - mean, g.mean - mean)) for pk, g in zip(p, gs))
    return Gaussian2D.from_cov(mean, cov)


def log_overlap(a: Gaussian2D, b: Gaussian2D) -> float:
    """log ∫ N_a N_b dθ = log N(μ_a; μ_b, Σ_a + Σ_b)."""
    return float(Gaussian2D.from_cov(b.mean, a.cov + b.cov).logpdf(a.mean))


def mixture_product(mixtures: Sequence[Mixture2D]) -> Mixture2D:
    """∏_c (Σ_i w_ci N_ci), renormalised: the mixture over component tuples (FedBEns' global posterior)."""
    def pair(a: Mixture2D, b: Mixture2D) -> Mixture2D:
        comps, logw = [], []
        for wa, ca in zip(a.weights, a.components):
            for wb, cb in zip(b.weights, b.components):
                comps.append(product([ca, cb]))
                logw.append(np.log(wa) + np.log(wb) + log_overlap(ca, cb))
        logw = np.array(logw)
        return Mixture2D(np.exp(logw - _logsumexp(logw)), tuple(comps))
    return reduce(pair, mixtures)


def ridge_line(g1: Gaussian2D, g2: Gaussian2D, num: int = 101) -> np.ndarray:
    """[num, 2]: θ(π) = (πΛ₁ + (1−π)Λ₂)⁻¹(πΛ₁μ₁ + (1−π)Λ₂μ₂), π ∈ [0, 1] (Ray & Lindsay's ridgeline, FOLA Eq. 11)."""
    return np.stack([product([g1, g2], [p, 1 - p]).mean for p in np.linspace(0, 1, num)])


def kfac_fisher(a: np.ndarray, e: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(full, kfac) Fisher of one linear unit s = wᵀa from per-sample inputs a [n, 2] and output gradients e [n]:
    full = mean_n e_n² a_n a_nᵀ, kfac = mean_n e_n² · mean_n a_n a_nᵀ (G ⊗ A with a 1×1 G)."""
    a, e2 = np.asarray(a, float), np.asarray(e, float) ** 2
    full = np.einsum("n,ni,nj->ij", e2, a, a) / len(a)
    return full, e2.mean() * (a.T @ a) / len(a)


# ------------------------------------------------------------------------------------------------
# modes, Laplace approximations, noisy gradient descent (FedBEns Fig. 1)
# ------------------------------------------------------------------------------------------------
def find_mode(mix: Mixture2D, start, steps: int = 100) -> np.ndarray:
    """A local maximum of log p from ``start``: damped Newton steps (gradient steps where not concave)."""
    x = np.asarray(start, float).copy()
    for _ in range(steps):
        g, h = mix.grad_hess_logpdf(x)
        if np.all(np.linalg.eigvalsh(h) < 0):
            step = -np.linalg.solve(h, g)
        else:
            step = 0.1 * g
        x = x + step
        if np.linalg.norm(step) < 1e-12:
            break
    return x


def laplace(mix: Mixture2D, at) -> Gaussian2D:
    """The Laplace approximation of p at the point ``at``: N(at, (−∇² log p(at))⁻¹); where −∇² log p is not
    positive definite (``at`` far from a mode), at the local mode found from ``at`` instead."""
    _, h = mix.grad_hess_logpdf(at)
    if np.any(np.linalg.eigvalsh(-h) <= 0):
        at = find_mode(mix, at)
        _, h = mix.grad_hess_logpdf(at)
    return Gaussian2D(np.asarray(at, float), -h)


def noisy_descent(mix: Mixture2D, start, rng: np.random.Generator, steps: int = 300, lr: float = 0.02,
                  noise: float = 0.15) -> np.ndarray:
    """[steps + 1, 2]: gradient descent on −log p with Gaussian gradient noise that decays to 0 (an SGD stand-in)."""
    path = [np.asarray(start, float)]
    for t in range(steps):
        g, _ = mix.grad_hess_logpdf(path[-1])
        scale = noise * (1 - t / steps)
        path.append(path[-1] + lr * g + np.sqrt(lr) * scale * rng.standard_normal(2))
    return np.stack(path)


def grid(xlim, ylim, n: int = 200) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    xs, ys = np.linspace(*xlim, n), np.linspace(*ylim, n)
    X, Y = np.meshgrid(xs, ys)
    return X, Y, np.stack([X, Y], -1)


# ------------------------------------------------------------------------------------------------
# the scenarios (our choices; the papers give no numbers)
# ------------------------------------------------------------------------------------------------
def _rotation(deg: float) -> np.ndarray:
    t = np.deg2rad(deg)
    return np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])


def _cov(deg: float, major: float, minor: float) -> np.ndarray:
    r = _rotation(deg)
    return r @ np.diag([major ** 2, minor ** 2]) @ r.T


@dataclass(frozen=True)
class FisherClient:
    """One client of FedLPA Fig. 6: its mode and its Laplace posteriors from the full / K-FAC / diagonal Fisher."""
    full: Gaussian2D
    kfac: Gaussian2D

    @property
    def diag(self) -> Gaussian2D:
        return diagonal(self.full)


def fisher_clients(seed: int = 0, n: int = 4000, scale: float = 6.0) -> List[FisherClient]:
    """Two heterogeneous clients: inputs a ~ N(0, C_k) with C_k correlated along different directions and output
    gradients e = 0.3 + u_kᵀa, so e² grows along u_k and E[e² a aᵀ] ≠ E[e²]E[a aᵀ]; precision = scale × Fisher."""
    rng = np.random.default_rng(seed)
    specs = [((-1.6, 0.0), 35.0, (np.cos(np.deg2rad(80)), np.sin(np.deg2rad(80)))),
             ((1.6, 0.4), -40.0, (np.cos(np.deg2rad(-100)), np.sin(np.deg2rad(-100))))]
    out = []
    for mean, deg, u in specs:
        a = rng.multivariate_normal(np.zeros(2), _cov(deg, 0.35, 1.0), size=n)
        e = 0.3 + a @ np.asarray(u)
        full, kfac = kfac_fisher(a, e)
        out.append(FisherClient(Gaussian2D(np.asarray(mean, float), scale * full),
                                Gaussian2D(np.asarray(mean, float), scale * kfac)))
    return out


def fola_clients() -> List[Gaussian2D]:
    """Two elongated Gaussians reaching towards a common region above the line between their modes."""
    return [Gaussian2D.from_cov((-2.0, 0.0), _cov(50.0, 1.6, 0.35)),
            Gaussian2D.from_cov((2.0, 0.5), _cov(115.0, 1.6, 0.3))]


def fedbens_clients() -> Tuple[Mixture2D, Mixture2D]:
    """Client 1: bimodal, a sharp deep minimum A and a broad shallow one B; client 2: unimodal, near B."""
    c1 = Mixture2D(np.array([0.6, 0.4]),
                   (Gaussian2D.from_cov((-1.8, 1.6), _cov(20.0, 0.35, 0.25)),
                    Gaussian2D.from_cov((0.6, -0.6), _cov(35.0, 1.2, 0.6))))
    c2 = Mixture2D(np.array([1.0]), (Gaussian2D.from_cov((1.9, 0.5), _cov(-30.0, 0.8, 0.45)),))
    return c1, c2
