"""Damping (notes/fedlpa.md §1.1 Eq. 30–31, §1.3 step 3, §1.7 item 2).

* FedLPA's Kronecker damping: F + λI ≈ (A + π√λ I) ⊗ (G + (√λ/π) I), with π = 1 (released code)
  or the trace-norm rule π = √((tr A / dim A) / (tr G / dim G)) (the standard K-FAC choice; with
  the trace norm Eq. 31's √(‖A ⊗ I‖/‖I ⊗ G‖) is the same number).
* Isotropic: C + λI, kept symbolic on the curvature (``Curvature.damping``) and applied exactly in
  the Kronecker eigenbasis by :class:`~fedbench.curvature.posterior.KronGaussian`.
* None.
"""
from __future__ import annotations

import math
from typing import Tuple, Union

import torch
from torch import Tensor

from fedbench.curvature.structures import Curvature, KFACCurvature
from fedbench.errors import FedbenchError

DAMPING_MODES = ("none", "isotropic", "kron")
PI_RULES = ("one", "trace")


def kron_pi(A: Tensor, G: Tensor, pi: Union[str, float] = "one") -> float:
    """π for FedLPA's damping: "one" (code), "trace" (trace-norm rule), or a number."""
    if isinstance(pi, str):
        if pi == "one":
            return 1.0
        if pi == "trace":
            ta = float(A.diagonal().sum()) / A.shape[0]
            tg = float(G.diagonal().sum()) / G.shape[0]
            if ta <= 0 or tg <= 0:
                return 1.0          # a zero factor: any π gives the same (degenerate) product
            return math.sqrt(ta / tg)
        raise FedbenchError(f"unknown damping pi rule '{pi}'; choose one of: {', '.join(PI_RULES)} or a number")
    pi = float(pi)
    if not pi > 0:
        raise FedbenchError(f"damping pi must be positive, got {pi}")
    return pi


def damp_kfac(A: Tensor, G: Tensor, lam: float, pi: Union[str, float] = "one") -> Tuple[Tensor, Tensor]:
    """(A + π√λ I, G + (√λ/π) I) as new tensors (FedLPA, Eq. 30)."""
    lam = float(lam)
    if lam < 0:
        raise FedbenchError(f"damping lambda must be >= 0, got {lam}")
    p = kron_pi(A, G, pi)
    s = math.sqrt(lam)
    eye_a = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    eye_g = torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    return A + (p * s) * eye_a, G + (s / p) * eye_g


def damp(curv: Curvature, lam: float, mode: str = "isotropic", pi: Union[str, float] = "one") -> Curvature:
    """A damped copy of ``curv``: mode "kron" (K-FAC only, FedLPA), "isotropic" (+λI), or "none"."""
    if mode not in DAMPING_MODES:
        raise FedbenchError(f"unknown damping mode '{mode}'; choose one of: {', '.join(DAMPING_MODES)}")
    if float(lam) < 0:
        raise FedbenchError(f"damping lambda must be >= 0, got {lam}")
    if mode == "none":
        return curv.copy()
    if mode == "isotropic":
        return curv.with_damping(lam)
    if not isinstance(curv, KFACCurvature):
        raise FedbenchError(f"damping mode 'kron' needs a K-FAC curvature, got structure '{curv.structure}'")
    out = curv.copy()
    for b in out.blocks.values():
        b.A, b.G = damp_kfac(b.A, b.G, lam, pi)
    out.meta["kron_damping"] = {"lambda": float(lam), "pi": pi}
    return out
