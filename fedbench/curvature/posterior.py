"""Gaussian posteriors N(μ, Λ⁻¹) over the flat parameter vector, built on curvatures.

Precision, as FedBEns / laplace-torch define it (notes/fedbens.md §1.3):

    Λ = (scale / T) · (C + damping·I) + prior_precision · I

with C the curvature (its own ``scale``: "sum" for a Laplace likelihood precision), ``scale`` an
extra multiplier (e.g. N for a dataset-mean curvature), T the temperature (T < 1 = cold) and a
zero-mean isotropic Gaussian prior. FedLPA's Kronecker-damped factors (``damping.damp``) are used
with ``prior_precision=0``.

Every class offers ``mean`` (flat [P]), ``precision_mv(v)``, ``solve(v)`` (Λ⁻¹ v), ``logdet()`` of Λ,
``quad(θ)`` = (θ−μ)ᵀ Λ (θ−μ), ``log_prob(θ)`` = −½ P log 2π + ½ log det Λ − ½ quad (normalised; θ is
[..., P] or a dict of parameter tensors and may require grad), ``sample(n, generator)`` and
``nbytes(symmetric=True)``: the bytes a client uploads (the mean plus the precision's stored
values: diagonal, upper triangles of symmetric factors / blocks; scalars such as T and the prior are
configuration, not counted).

* :class:`DiagGaussian`
* :class:`KronGaussian`: per layer Λ_l = c·(G ⊗ A) + δ I (on the row-major layer matrix M), with
  c = scale/T and δ = prior + c·damping, exact in the eigenbasis of A and G:
  eigenvalues c·λ_G,i·λ_A,j + δ; Λ_l vec(M) = c·G M A + δ M.
* :class:`DenseGaussian` (Cholesky).
* :class:`ProductGaussian`: independent parts over disjoint parameter groups (layer blocks,
  FedBEns Diag+Full).
* :func:`diag_gaussian_product`: the weighted product of diagonal Gaussians (FOLA's server, Eq. 12).
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from fedbench.curvature.layout import ParamLayout
from fedbench.curvature.structures import (Curvature, DenseCurvature, DiagCurvature, DiagLastLayerFullCurvature,
                                           KFACCurvature, KronBlock, LayerBlocksCurvature, kron_values, sym_count)
from fedbench.errors import FedbenchError

MeanLike = Union[Tensor, Mapping[str, Tensor], nn.Module]
LOG2PI = math.log(2 * math.pi)


def _as_flat(layout: ParamLayout, value: MeanLike) -> Tensor:
    if isinstance(value, nn.Module):
        return layout.vector_of(value)
    if isinstance(value, Mapping):
        return layout.flatten(value)
    if value.shape[-1] != layout.numel:
        raise FedbenchError(f"vector has {value.shape[-1]} entries, expected {layout.numel}")
    return value


class Gaussian:
    def __init__(self, layout: ParamLayout, mean: MeanLike):
        self.layout = layout
        self.mean = _as_flat(layout, mean).detach()

    @property
    def dim(self) -> int:
        return self.layout.numel

    # to implement
    def precision_mv(self, v: Tensor) -> Tensor:
        raise NotImplementedError

    def solve(self, v: Tensor) -> Tensor:
        raise NotImplementedError

    def logdet(self) -> Tensor:
        raise NotImplementedError

    def _noise(self, z: Tensor) -> Tensor:       # Λ^{-1/2}-type map of standard normal z [..., P]
        raise NotImplementedError

    def _precision_values(self, symmetric: bool) -> List[Tuple[int, Tensor]]:
        raise NotImplementedError

    # shared
    def mean_dict(self) -> Dict[str, Tensor]:
        return self.layout.unflatten(self.mean)

    def quad(self, theta: MeanLike) -> Tensor:
        d = _as_flat(self.layout, theta) - self.mean
        return (d * self.precision_mv(d)).sum(-1)

    def log_prob(self, theta: MeanLike) -> Tensor:
        return -0.5 * self.dim * LOG2PI + 0.5 * self.logdet() - 0.5 * self.quad(theta)

    def sample(self, n: int = 1, generator: Optional[torch.Generator] = None) -> Tensor:
        dev = generator.device if generator is not None else self.mean.device
        z = torch.randn((n, self.dim), generator=generator, device=dev, dtype=self.mean.dtype).to(self.mean.device)
        return self.mean + self._noise(z)

    def nbytes(self, symmetric: bool = True, include_mean: bool = True,
               bytes_per_value: Optional[int] = None) -> int:
        vals = self._precision_values(symmetric)
        if include_mean:
            vals = [(self.mean.numel(), self.mean)] + vals
        return sum(k * (bytes_per_value or t.element_size()) for k, t in vals)


class DiagGaussian(Gaussian):
    def __init__(self, layout: ParamLayout, mean: MeanLike, precision: Tensor):
        super().__init__(layout, mean)
        self.precision = precision

    @classmethod
    def from_curvature(cls, curv: DiagCurvature, mean: MeanLike, *, prior_precision: float = 0.0,
                       temperature: float = 1.0, scale: float = 1.0) -> "DiagGaussian":
        c = _coef(scale, temperature)
        return cls(curv.layout, mean, c * curv.diagonal() + float(prior_precision))

    def precision_mv(self, v):
        return self.precision * v

    def solve(self, v):
        return v / self.precision

    def logdet(self):
        return self.precision.log().sum()

    def _noise(self, z):
        return z / self.precision.sqrt()

    def _precision_values(self, symmetric):
        return [(self.precision.numel(), self.precision)]


class _KronEig:
    __slots__ = ("block", "lam_a", "q_a", "lam_g", "q_g")

    def __init__(self, block: KronBlock):
        self.block = block
        la, qa = torch.linalg.eigh(block.A)
        lg, qg = torch.linalg.eigh(block.G)
        self.lam_a, self.q_a = la.clamp_min(0), qa          # PSD factors: round-off negatives -> 0
        self.lam_g, self.q_g = lg.clamp_min(0), qg


class KronGaussian(Gaussian):
    """Per-layer Kronecker precision c·(G ⊗ A) + δ I (see the module docstring)."""

    def __init__(self, layout: ParamLayout, mean: MeanLike, blocks: Sequence[KronBlock], *, coef: float = 1.0,
                 delta: float = 0.0):
        super().__init__(layout, mean)
        self.blocks = list(blocks)
        self.coef = float(coef)
        self.delta = float(delta)
        self._eig = [_KronEig(b) for b in self.blocks]
        covered = {n for b in self.blocks for n in b.names}
        self.uncovered = [n for n in layout.names if n not in covered]   # prior-only parameters
        self._unc_idx = layout.index(self.uncovered, device=self.mean.device) if self.uncovered else None

    @classmethod
    def from_curvature(cls, curv: KFACCurvature, mean: MeanLike, *, prior_precision: float = 0.0,
                       temperature: float = 1.0, scale: float = 1.0) -> "KronGaussian":
        c = _coef(scale, temperature)
        return cls(curv.layout, mean, list(curv.blocks.values()), coef=c,
                   delta=float(prior_precision) + c * curv.damping)

    def eigenvalues(self) -> List[Tensor]:
        """Per block, the [d_out, d_in] grid of precision eigenvalues c·λ_G,i·λ_A,j + δ."""
        return [self.coef * torch.outer(e.lam_g, e.lam_a) + self.delta for e in self._eig]

    def _map(self, v: Tensor, fn) -> Tensor:
        parts = self.layout.unflatten(v)
        out: Dict[str, Tensor] = {}
        for b, e in zip(self.blocks, self._eig):
            out.update(b.from_matrix(fn(b, e, b.to_matrix(parts))))
        for n in self.uncovered:
            out[n] = fn(None, None, parts[n])
        return self.layout.flatten(out)

    def precision_mv(self, v):
        c, d = self.coef, self.delta

        def f(b, e, M):
            if b is None:
                return d * M
            return c * (b.G @ M @ b.A) + d * M
        return self._map(v, f)

    def _eig_apply(self, v, power):
        def f(b, e, M):
            if b is None:
                return M * self.delta ** power
            lam = self.coef * torch.outer(e.lam_g, e.lam_a) + self.delta
            R = e.q_g.t() @ M @ e.q_a
            return e.q_g @ (R * lam ** power) @ e.q_a.t()
        return self._map(v, f)

    def solve(self, v):
        return self._eig_apply(v, -1.0)

    def _noise(self, z):
        return self._eig_apply(z, -0.5)

    def logdet(self):
        tot = sum((lam.log().sum() for lam in self.eigenvalues()), self.mean.new_zeros(()))
        if self.uncovered:
            tot = tot + len(self._unc_idx) * math.log(self.delta) if self.delta > 0 else tot - math.inf
        return tot

    def _precision_values(self, symmetric):
        return kron_values(self.blocks, symmetric)


class DenseGaussian(Gaussian):
    def __init__(self, layout: ParamLayout, mean: MeanLike, precision: Tensor):
        super().__init__(layout, mean)
        self.precision = 0.5 * (precision + precision.t())
        self._chol = None

    @classmethod
    def from_curvature(cls, curv: Curvature, mean: MeanLike, *, prior_precision: float = 0.0,
                       temperature: float = 1.0, scale: float = 1.0) -> "DenseGaussian":
        c = _coef(scale, temperature)
        P = curv.to_dense()
        eye = torch.eye(P.shape[0], dtype=P.dtype, device=P.device)
        return cls(curv.layout, mean, c * P + float(prior_precision) * eye)

    @property
    def chol(self) -> Tensor:
        if self._chol is None:
            L, info = torch.linalg.cholesky_ex(self.precision)
            if int(info) != 0:
                raise FedbenchError("dense precision is not positive definite; add a prior precision or damping")
            self._chol = L
        return self._chol

    def precision_mv(self, v):
        return v @ self.precision

    def solve(self, v):
        return torch.cholesky_solve(v.reshape(-1, self.dim).t(), self.chol).t().reshape(v.shape)

    def logdet(self):
        return 2 * self.chol.diagonal().log().sum()

    def _noise(self, z):
        # Λ = L Lᵀ  =>  x = L⁻ᵀ z has covariance Λ⁻¹
        return torch.linalg.solve_triangular(self.chol.t(), z.t(), upper=True).t()

    def _precision_values(self, symmetric):
        return [(sym_count(self.dim, symmetric), self.precision)]


class ProductGaussian(Gaussian):
    """Independent Gaussians over disjoint groups of parameters (``parts`` cover the layout)."""

    def __init__(self, layout: ParamLayout, mean: MeanLike, parts: Sequence[Gaussian]):
        super().__init__(layout, mean)
        self.parts = list(parts)
        names = [n for p in self.parts for n in p.layout.names]
        if sorted(names) != sorted(layout.names):
            raise FedbenchError("ProductGaussian parts must cover every parameter exactly once")
        self._idx = [layout.index(p.layout.names, device=self.mean.device) for p in self.parts]
        for p, idx in zip(self.parts, self._idx):
            p.mean = self.mean[idx]

    def _per_part(self, v, method):
        out = torch.empty_like(v)
        for p, idx in zip(self.parts, self._idx):
            out[..., idx] = getattr(p, method)(v[..., idx])
        return out

    def precision_mv(self, v):
        return self._per_part(v, "precision_mv")

    def solve(self, v):
        return self._per_part(v, "solve")

    def _noise(self, z):
        return self._per_part(z, "_noise")

    def logdet(self):
        return sum((p.logdet() for p in self.parts), self.mean.new_zeros(()))

    def _precision_values(self, symmetric):
        return [v for p in self.parts for v in p._precision_values(symmetric)]


def _coef(scale: float, temperature: float) -> float:
    if not float(temperature) > 0:
        raise FedbenchError(f"posterior temperature must be > 0, got {temperature}")
    return float(scale) / float(temperature)


def gaussian_from_curvature(curv: Curvature, mean: MeanLike, *, prior_precision: float = 0.0,
                            temperature: float = 1.0, scale: float = 1.0) -> Gaussian:
    """The Gaussian whose precision is (scale/T)·curv + prior·I, with the structure's natural class."""
    kw = dict(prior_precision=prior_precision, temperature=temperature, scale=scale)
    if float(prior_precision) < 0:
        raise FedbenchError(f"prior precision must be >= 0, got {prior_precision}")
    if isinstance(curv, DiagCurvature):
        return DiagGaussian.from_curvature(curv, mean, **kw)
    if isinstance(curv, KFACCurvature):
        return KronGaussian.from_curvature(curv, mean, **kw)
    if isinstance(curv, DenseCurvature):
        return DenseGaussian.from_curvature(curv, mean, **kw)
    layout = curv.layout
    flat = _as_flat(layout, mean)
    c = _coef(scale, temperature)
    eye = lambda n, t: torch.eye(n, dtype=t.dtype, device=t.device)
    if isinstance(curv, LayerBlocksCurvature):
        parts = []
        for b in curv.blocks.values():
            sub = layout.sub(b.names)
            M = c * (b.matrix + curv.damping * eye(sub.numel, b.matrix)) + float(prior_precision) * eye(sub.numel,
                                                                                                          b.matrix)
            parts.append(DenseGaussian(sub, flat[layout.index(b.names, device=flat.device)], M))
        return ProductGaussian(layout, flat, parts)
    if isinstance(curv, DiagLastLayerFullCurvature):
        parts: List[Gaussian] = []
        dn = curv.diag_names
        if dn:
            sub = layout.sub(dn)
            d = sub.flatten({n: curv.diag[n] for n in dn})
            parts.append(DiagGaussian(sub, flat[layout.index(dn, device=flat.device)],
                                      c * (d + curv.damping) + float(prior_precision)))
        sub = layout.sub(curv.last.names)
        M = curv.last.matrix
        parts.append(DenseGaussian(sub, flat[layout.index(curv.last.names, device=flat.device)],
                                   c * (M + curv.damping * eye(sub.numel, M)) + float(prior_precision) * eye(sub.numel, M)))
        return ProductGaussian(layout, flat, parts)
    raise FedbenchError(f"no Gaussian posterior for curvature structure '{curv.structure}'")


# ---- products of Gaussians ---------------------------------------------------------------------------------
Params = Dict[str, Tensor]
EPS_MODES = ("denominator", "per_client")   # where the product's ε enters the mean (FOLA §1.3)


def diag_gaussian_product(means: Sequence[Params], precisions: Sequence[Params], weights: Sequence[float], *,
                          eps: float = 1e-5, eps_mode: str = "denominator") -> Tuple[Params, Params]:
    """Weighted product of diagonal Gaussians given as parameter dicts (FOLA Eq. 12): returns (μ_S, ω_S) with
    ω_S = Σ π_n ω_n and μ_S = Σ π_n ω_n μ_n / (ω_S + ε) ("denominator", FOLA code) or
    Σ π_n (ω_n + ε) μ_n / (ω_S + ε) ("per_client"). Weights are normalised to sum 1; computed in float64."""
    if eps_mode not in EPS_MODES:
        raise FedbenchError(f"agg_eps_mode must be one of {' | '.join(EPS_MODES)}, got {eps_mode!r}")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    w = (w / w.sum()).tolist()
    mean, prec = {}, {}
    for n in means[0]:
        dt = means[0][n].dtype
        num = torch.zeros_like(means[0][n], dtype=torch.float64)
        den = torch.zeros_like(num)
        mavg = torch.zeros_like(num)
        for wi, mu, om in zip(w, means, precisions):
            o = om[n].double()
            num.add_(o * mu[n].double(), alpha=wi)
            den.add_(o, alpha=wi)
            mavg.add_(mu[n].double(), alpha=wi)
        if eps_mode == "per_client":
            num.add_(mavg, alpha=eps)
        mean[n] = (num / (den + eps)).to(dt)
        prec[n] = den.to(precisions[0][n].dtype)
    return mean, prec
