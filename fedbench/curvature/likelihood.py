"""Likelihoods in the model's output space and the output-space factors of each Fisher type.

Every curvature in this package is a sum over samples n of outer products of *backpropagated
output-space vectors*: with f_n = f(x_n; θ) ∈ R^C and J_n = ∂f_n/∂θ,

    F = s · Σ_n Σ_k (J_nᵀ v_nk)(J_nᵀ v_nk)ᵀ,      s = 1/N ("mean") or 1 ("sum"),

and the Fisher type only decides the vectors V_n = [v_n1 … v_nK] ∈ R^{C×K}:

| fisher      | CE (softmax, C ≥ 2)              | BCE (one logit)                    | MSE (½‖y−f‖², unit noise) |
|-------------|----------------------------------|------------------------------------|---------------------------|
| empirical   | ∇_f ℓ(f, y) = p − e_y  (K=1)     | σ − y  (K=1)                       | f − y  (K=1)              |
| true        | √p_c ∇_f log p_c = √p_c (e_c − p), c = 1..C (nngeometry ``classif_logits``) | √σ (1−σ), −√(1−σ) σ (K=2, both classes) | e_c (K=C): E[(y−f)(y−f)ᵀ] = I |
| ggn         | S with S Sᵀ = ∇²_f ℓ = diag(p) − p pᵀ, S = diag(√p) − p √pᵀ (K=C) | √(σ(1−σ)) (K=1) | I (K=C) |
| mc          | ∇_f ℓ(f, ŷ_m)/√M, ŷ_m ~ p(·|f)   | σ − ŷ_m, ŷ_m ~ Bernoulli(σ)        | −ε_m, ε_m ~ N(0, I)       |

"true" (the exact expectation over the predictive classes) and "ggn" (the loss Hessian in the
output space) give the same matrix for these three likelihoods; they are kept apart because the
papers name them apart (FedFisher: true Fisher via nngeometry; FedBEns / FedLap: GGN), and the
``torch.func`` engine computes them along different routes (class-wise log-likelihood gradients
vs. per-sample Jacobians contracted with the output Hessian), which the tests cross-check.

The MSE likelihood is Gaussian with unit variance, ℓ = ½‖y − f‖² (fedbench's regression loss);
PyTorch's ``MSELoss`` (no ½) is 2× that, which the curvlinops adapter corrects for.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedbench.errors import FedbenchError

LOSSES = ("auto", "ce", "bce", "mse")
FISHERS = ("empirical", "true", "mc", "ggn")


def resolve_loss(loss: str, out: Tensor, y: Tensor) -> str:
    """Pick the likelihood. ``auto``: integer/bool labels -> CE (BCE for one output); float targets
    -> MSE, except a single output with targets all in {0, 1} -> BCE."""
    if loss not in LOSSES:
        raise FedbenchError(f"unknown curvature loss '{loss}'; choose one of: {', '.join(LOSSES)}")
    width = out.shape[-1] if out.dim() > 1 else 1
    if out.dim() != 2:
        raise FedbenchError(f"curvature needs model outputs of shape [N, C], got {list(out.shape)}")
    if loss != "auto":
        if loss == "ce" and width < 2:
            raise FedbenchError("loss 'ce' needs at least 2 outputs; a single output is a binary logistic model "
                                "(loss 'bce')")
        if loss == "bce" and width != 1:
            raise FedbenchError(f"loss 'bce' needs a single output (logit), got {width} outputs")
        return loss
    if not torch.is_floating_point(y):
        return "bce" if width == 1 else "ce"
    if width == 1 and bool(((y == 0) | (y == 1)).all()):
        return "bce"
    return "mse"


def prepare_targets(kind: str, out: Tensor, y: Tensor) -> Tensor:
    """Targets in the shape the per-sample NLL below expects."""
    n = out.shape[0]
    if y.shape[0] != n:
        raise FedbenchError(f"curvature got {n} inputs but {y.shape[0]} targets")
    if kind == "ce":
        return y.reshape(n).long()
    if kind == "bce":
        return y.reshape(n, 1).to(out.dtype)
    if y.numel() != out.numel():
        raise FedbenchError(f"loss 'mse' needs targets with the outputs' shape {list(out.shape)}, "
                            f"got {list(y.shape)}")
    return y.reshape(out.shape).to(out.dtype)


def nll(kind: str, f: Tensor, y: Tensor) -> Tensor:
    """Per-sample negative log-likelihood ℓ(f, y) (MSE without the Gaussian constant); shape [N]."""
    if kind == "ce":
        return F.cross_entropy(f, y, reduction="none")
    if kind == "bce":
        return F.binary_cross_entropy_with_logits(f, y, reduction="none").sum(-1)
    return 0.5 * ((f - y) ** 2).sum(-1)


def hessian_sqrt(kind: str, f: Tensor) -> Tensor:
    """S with S Sᵀ = ∇²_f ℓ, [N, C, K] (CE: diag(√p) − p √pᵀ; BCE: √(σ(1−σ)); MSE: I)."""
    if kind == "ce":
        p = f.softmax(-1)
        sp = p.sqrt()
        return torch.diag_embed(sp) - p.unsqueeze(-1) * sp.unsqueeze(-2)
    if kind == "bce":
        s = torch.sigmoid(f)
        return (s * (1 - s)).sqrt().unsqueeze(-1)            # [N, 1, 1]
    return torch.eye(f.shape[-1], dtype=f.dtype, device=f.device).expand(f.shape[0], -1, -1)


def class_log_probs(kind: str, f: Tensor) -> Tensor:
    """log p(c | f) for every class c, [N, K] (CE: log-softmax; BCE: classes (1, 0))."""
    if kind == "ce":
        return f.log_softmax(-1)
    if kind == "bce":
        return torch.cat([F.logsigmoid(f), F.logsigmoid(-f)], dim=-1)
    raise FedbenchError("class log-probabilities exist only for classification losses (ce, bce)")


def true_fisher_vectors(kind: str, f: Tensor) -> Tensor:
    """√p_c ∇_f log p(c|f) for every class c, [N, C, K] (nngeometry's ``classif_logits``)."""
    if kind == "ce":
        p = f.softmax(-1)
        sp = p.sqrt()
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        return (eye.unsqueeze(0) - p.unsqueeze(-1)) * sp.unsqueeze(-2)     # column c: √p_c (e_c − p)
    if kind == "bce":
        s = torch.sigmoid(f)                                                # [N, 1]
        v1 = s.sqrt() * (1 - s)                                             # class 1: ∇ log σ = 1 − σ
        v0 = -(1 - s).sqrt() * s                                            # class 0: ∇ log(1−σ) = −σ
        return torch.stack([v1, v0], dim=-1)                                # [N, 1, 2]
    # Gaussian N(f, I): the exact expectation E[(y − f)(y − f)ᵀ] = I.
    return torch.eye(f.shape[-1], dtype=f.dtype, device=f.device).expand(f.shape[0], -1, -1)


def loss_gradient(kind: str, f: Tensor, y: Tensor) -> Tensor:
    """∇_f ℓ(f, y), [N, C]."""
    if kind == "ce":
        return f.softmax(-1) - F.one_hot(y, f.shape[-1]).to(f.dtype)
    if kind == "bce":
        return torch.sigmoid(f) - y
    return f - y


def sample_targets(kind: str, f: Tensor, mc_samples: int, generator: Optional[torch.Generator]) -> Tensor:
    """Draw ``mc_samples`` targets per sample from p(y | f), [M, N, ...] (targets' shape)."""
    dev = generator.device if generator is not None else f.device
    if kind == "ce":
        p = f.detach().softmax(-1).to(dev)
        y = torch.multinomial(p, mc_samples, replacement=True, generator=generator)   # [N, M]
        return y.t().to(f.device)
    if kind == "bce":
        p = torch.sigmoid(f.detach()).to(dev).unsqueeze(0).expand(mc_samples, *f.shape)
        return torch.bernoulli(p, generator=generator).to(f.device, f.dtype)
    eps = torch.randn((mc_samples, *f.shape), generator=generator, device=dev, dtype=f.dtype)
    return f.detach().unsqueeze(0) + eps.to(f.device)


def output_vectors(kind: str, fisher: str, f: Tensor, y: Tensor, *, mc_samples: int = 1,
                   generator: Optional[torch.Generator] = None) -> Tensor:
    """The output-space vectors V_n of the table above, [N, C, K] (``f`` detached, ``y`` prepared)."""
    f = f.detach()
    if fisher == "empirical":
        return loss_gradient(kind, f, y).unsqueeze(-1)
    if fisher == "true":
        return true_fisher_vectors(kind, f)
    if fisher == "ggn":
        return hessian_sqrt(kind, f)
    if fisher == "mc":
        ys = sample_targets(kind, f, mc_samples, generator)
        v = torch.stack([loss_gradient(kind, f, ys[m]) for m in range(mc_samples)], dim=-1)
        return v / math.sqrt(mc_samples)
    raise FedbenchError(f"unknown fisher type '{fisher}'; choose one of: {', '.join(FISHERS)}")
