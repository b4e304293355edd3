"""The only place that touches ``curvlinops-for-pytorch`` (pinned 3.0.1; notes/ecosystem.md §B.1).

Conventions mapped onto fedbench's:

* K-FAC: ``KFACLinearOperator`` with ``loss_func.reduction="sum"`` gives A = (1/N) Σ (expand: over
  samples and locations, divided by the number of locations S) and G = Σ g gᵀ (sum over samples),
  i.e. A ⊗ G ≈ the *sum* curvature; fedbench's "mean" divides G by N. ``kfac_approx`` expand /
  reduce are fedbench's conventions of the same names. ``separate_weight_and_bias = not
  bias_augment``; a separate bias block gets A = [[1]] (curvlinops multiplies the bias by G only).
  Factors are read from ``state_dict()["input_covariances" / "gradient_covariances"]`` (keyed by
  module name). Fisher types: empirical -> EMPIRICAL, mc -> MC (curvlinops' own generator, seeded
  from ``generator`` when given), ggn and true -> TYPE2 (the exact output-space Hessian; equal to
  the exact-expectation Fisher for these likelihoods).
* MSE: curvlinops' ``MSELoss`` is Σ (y − f)², twice fedbench's ½‖y − f‖²: its type-2 and MC
  Fishers are 2× ours and its empirical Fisher 4× (its MC draws y with variance ½); G is rescaled.
* BCE: ``BCEWithLogitsLoss`` on [N, 1] logits with float targets.
* Dense references for tests: ``GGNLinearOperator`` (type-2) and ``EFLinearOperator`` (empirical).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from fedbench.curvature.layout import ParamLayout
from fedbench.curvature.structures import KFACCurvature, KronBlock
from fedbench.errors import FedbenchError

_DEFAULT_SEED = 2147483647


def _loss_func(kind: str):
    from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
    return {"ce": CrossEntropyLoss, "bce": BCEWithLogitsLoss, "mse": MSELoss}[kind](reduction="sum")


def _targets(kind: str, y: Tensor, out_width: int, dtype) -> Tensor:
    if kind == "ce":
        return y.reshape(-1).long()
    if kind == "bce":
        return y.reshape(-1, 1).to(dtype)
    return y.reshape(y.shape[0], out_width).to(dtype)


def _mse_factor(fisher: str) -> float:
    return {"empirical": 0.25, "mc": 0.5, "ggn": 0.5, "true": 0.5}[fisher]


def _batches(x: Tensor, y: Tensor, batch_size: int) -> List[Tuple[Tensor, Tensor]]:
    return [(x[s:s + batch_size], y[s:s + batch_size]) for s in range(0, x.shape[0], batch_size)]


def kfac_curvlinops(model: nn.Module, x: Tensor, y: Tensor, *, kind: str, fisher: str, scale: str,
                    conv_convention: str, bias_augment: bool, batch_size: int, mc_samples: int,
                    generator: Optional[torch.Generator]) -> KFACCurvature:
    from curvlinops import FisherType, KFACLinearOperator, KFACType

    if conv_convention not in ("expand", "reduce"):
        raise FedbenchError(f"curvlinops implements the K-FAC conventions 'expand' and 'reduce', not "
                            f"'{conv_convention}'; use backend 'hooks'")
    ftype = {"empirical": FisherType.EMPIRICAL, "mc": FisherType.MC, "ggn": FisherType.TYPE2,
             "true": FisherType.TYPE2}.get(fisher)
    if ftype is None:
        raise FedbenchError(f"curvlinops K-FAC has no fisher type '{fisher}'")
    layout = ParamLayout.from_module(model)
    named = dict(model.named_parameters())
    params = [named[n] for n in layout.names]
    with torch.no_grad():
        width = model(x[:1]).shape[-1]
    yt = _targets(kind, y, width, params[0].dtype)
    seed = _DEFAULT_SEED if generator is None else int(torch.randint(0, 2 ** 31 - 1, (1,), generator=generator))
    op = KFACLinearOperator(model, _loss_func(kind), params, _batches(x, yt, batch_size),
                            check_deterministic=False, seed=seed, fisher_type=ftype,
                            mc_samples=mc_samples if fisher == "mc" else 1,
                            kfac_approx=KFACType.EXPAND if conv_convention == "expand" else KFACType.REDUCE,
                            num_per_example_loss_terms=1, separate_weight_and_bias=not bias_augment,
                            num_data=int(x.shape[0]))
    op.compute_kronecker_factors()
    state = op.state_dict()
    A_all: Dict[str, Tensor] = state["input_covariances"]
    G_all: Dict[str, Tensor] = state["gradient_covariances"]
    N = int(x.shape[0])
    gscale = (1.0 / N if scale == "mean" else 1.0) * (_mse_factor(fisher) if kind == "mse" else 1.0)
    blocks: Dict[str, KronBlock] = {}
    for mname, mod in model.named_modules():
        if mname not in G_all:
            continue
        pre = f"{mname}." if mname else ""
        w = pre + "weight" if pre + "weight" in layout else None
        b = pre + "bias" if getattr(mod, "bias", None) is not None and pre + "bias" in layout else None
        G = G_all[mname].detach() * gscale
        if w is not None:
            names = (w, b) if (b is not None and bias_augment) else (w,)
            blocks[mname] = KronBlock(mname, names, tuple(layout.shape(n) for n in names),
                                      A_all[mname].detach().clone(), G)
        if b is not None and not bias_augment:
            blocks[mname + ".bias"] = KronBlock(mname, (b,), (layout.shape(b),),
                                                G.new_ones(1, 1), G.clone())
    return KFACCurvature(layout, blocks, convention=conv_convention, bias_augment=bias_augment, fisher=fisher,
                         scale=scale, num_data=N, loss=kind, meta={"backend": "curvlinops"})


def dense_reference(model: nn.Module, x: Tensor, y: Tensor, *, kind: str, fisher: str,
                    batch_size: int = 256) -> Tensor:
    """Dense [P, P] GGN ("ggn") or empirical Fisher ("empirical") of the *sum* over samples, from
    curvlinops' exact operators (small models; used by the tests as an independent reference)."""
    from curvlinops import EFLinearOperator, GGNLinearOperator

    layout = ParamLayout.from_module(model)
    named = dict(model.named_parameters())
    params = [named[n] for n in layout.names]
    with torch.no_grad():
        width = model(x[:1]).shape[-1]
    yt = _targets(kind, y, width, params[0].dtype)
    cls = {"ggn": GGNLinearOperator, "empirical": EFLinearOperator}.get(fisher)
    if cls is None:
        raise FedbenchError(f"no curvlinops dense reference for fisher '{fisher}'")
    op = cls(model, _loss_func(kind), params, _batches(x, yt, batch_size), check_deterministic=False,
             num_data=int(x.shape[0]))
    P = layout.numel
    eye = torch.eye(P, dtype=params[0].dtype, device=params[0].device)
    M = op @ eye
    if kind == "mse":
        M = M * _mse_factor(fisher)
    return M
