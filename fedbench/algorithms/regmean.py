"""RegMean (Jin et al., ICLR 2023) as the FedFisher / FedBEns baseline (notes/fedfisher.md §2,
fedbens.md §2 "RegMean").

Client: after plain local training, the Gram matrix of the inputs of every nn.Linear,
G_i = (1/N) Σ_x x xᵀ, over the client's data (the code: batch 16, at most 1000 batches, so at most
``gram_max_samples`` = 16000 points, a random subset when the client has more); cached beside the
client stage. Uplink: the 16-bit weights and the Grams, SVD + 8-bit compressed with the code's one
global rank ⌊2d / Σ_l (2 b_l + 1)⌋ (``compression: true``, as the code) so the budget is FedAvg's.

Server, for each α in ``alphas`` (the code's a ∈ {0.1, 0.9}, picked by server validation accuracy,
strictly better wins; a single α needs no validation set):
    G̃_i = p_i G_i with off-diagonal entries multiplied by α   (reduce_non_diag)
    W = ((Σ_i G̃_i)⁺ Σ_i G̃_i W_iᵀ)ᵀ                          (W out×in; = (Σ W_i G̃_i)(Σ G̃_i)⁺ for symmetric G)
Every other parameter (convolutions, biases: RegMean merges only Linear weights) takes the
``other_params`` average: ``uniform`` (the code's unweighted mean) or ``num_samples``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from fedbench.algorithms import compression as C
from fedbench.algorithms.base import ALGORITHMS, Algorithm, ClientProduct, Message
from fedbench.algorithms.common import NO_CLIENT_DATA, client_weights, method_generator
from fedbench.algorithms.fedfisher import (WEIGHTINGS, bits_option, decode_any, decode_params, encode_params,
                                           levels_option, rank_option, weighted_sum)
from fedbench.algorithms.options import option, read_options
from fedbench.errors import FedbenchError

Params = Dict[str, Tensor]
OTHER = ("uniform", "num_samples")


def reduce_non_diag(G: Tensor, alpha: float) -> Tensor:
    """Off-diagonal entries × α, diagonal unchanged."""
    out = G * alpha
    out.diagonal().copy_(G.diagonal())
    return out


def regmean_linear(Ws: List[Tensor], Gs: List[Tensor], p: List[float], alpha: float, rtol: float = 1e-15) -> Tensor:
    """Merged weight (out×in) of one Linear layer from client weights and (unscaled) Grams."""
    Gt = [reduce_non_diag(pi * G.double(), alpha) for pi, G in zip(p, Gs)]
    S = sum(Gt)
    rhs = sum(G @ W.double().t() for G, W in zip(Gt, Ws))
    return (torch.linalg.pinv(S, rtol=rtol) @ rhs).t().to(Ws[0].dtype)


def linear_weights(model: nn.Module) -> Dict[str, str]:
    """Linear module name -> its trainable weight's parameter name."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    out = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            w = f"{mname}.weight" if mname else "weight"
            if w in names:
                out[mname] = w
    return out


def compute_grams(model: nn.Module, x: Tensor, modules: Dict[str, str], batch_size: int = 256) -> Dict[str, Tensor]:
    """(1/N) Σ x xᵀ of every listed Linear module's input (rows of x.view(-1, in))."""
    sums: Dict[str, Tensor] = {}
    counts: Dict[str, int] = {}
    handles = []
    named = dict(model.named_modules())

    def hook(name):
        def fn(mod, inp, out):
            a = inp[0].detach().reshape(-1, inp[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + a.t() @ a
            counts[name] = counts.get(name, 0) + a.shape[0]
        return fn

    for m in modules:
        handles.append(named[m].register_forward_hook(hook(m)))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for s in range(0, x.shape[0], batch_size):
                model(x[s:s + batch_size])
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return {m: (sums[m] / counts[m]).float() for m in modules}


def _alphas(key: str, alphas: Any) -> List[float]:
    try:
        alphas = [float(a) for a in alphas]
    except (TypeError, ValueError):
        raise FedbenchError(f"algorithm.alphas must be a list of numbers in [0, 1], got {alphas!r}") from None
    if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
        raise FedbenchError(f"algorithm.alphas must be a non-empty list of numbers in [0, 1], got {alphas!r}")
    return alphas


@dataclass(frozen=True)
class RegMeanOptions:
    alphas: Any = option(check=_alphas)
    weighting: str = option(choices=WEIGHTINGS)
    other_params: str = option(choices=OTHER)
    gram_max_samples: Optional[int] = option(minimum=1)
    compression: bool = option()
    weight_bits: int = option(check=bits_option)
    gram_bits: int = option(check=bits_option)
    gram_levels: str = option(check=levels_option)
    gram_rank: Any = option(check=rank_option)
    pinv_rtol: float = option(nonneg=True)


@ALGORITHMS.register("regmean")
class RegMean(Algorithm):
    name = "regmean"
    Options = RegMeanOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.alphas, self.weighting, self.other, self.gram_max = o.alphas, o.weighting, o.other_params, o.gram_max_samples
        self.compression, self.weight_bits, self.gram_bits = o.compression, o.weight_bits, o.gram_bits
        self.gram_levels = 2 ** self.gram_bits - 1 if o.gram_levels == "code" else C.levels_for_bits(self.gram_bits)
        self.pinv_rtol = o.pinv_rtol
        self.modules = linear_weights(setup.model)
        if not self.modules:
            raise FedbenchError("regmean needs at least one trainable nn.Linear layer in the model")
        if o.gram_rank == "budget":
            d = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)
            params = dict(setup.model.named_parameters())
            sides = [params[w].shape[1] for w in self.modules.values()]
            self.rank = C.budget_rank(d, sides, self.gram_bits)
        else:
            self.rank = o.gram_rank
        if len(self.alphas) > 1:
            setup.require_server_val(self.name)

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None

    def client_products(self, client_id, params, state, round_idx):
        """Product ``grams``: {"G": {module: the Gram matrix of its inputs}} on (up to gram_max of) the client's data."""
        def compute(worker):
            idx = self.setup.client_indices[client_id]
            if len(idx) == 0:
                return {"G": {m: torch.zeros(params[w].shape[1], params[w].shape[1]) for m, w in self.modules.items()}}
            if self.gram_max is not None and len(idx) > self.gram_max:
                g = method_generator("regmean", self.setup.seed, client_id=client_id)
                idx = idx[torch.randperm(len(idx), generator=g)[: self.gram_max].to(idx.device)]
            return {"G": compute_grams(worker, self.setup.train.inputs(idx), self.modules)}
        return [ClientProduct("regmean_gram", {"max_samples": self.gram_max}, params, compute, label="grams")]

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        G = products["grams"]["G"]
        if self.compression:
            grams = {m: C.encode_lowrank(g, self.rank, self.gram_levels) for m, g in G.items()}
            wl = C.levels_for_bits(self.weight_bits)
        else:
            grams, wl = {m: g.float() for m, g in G.items()}, None
        return Message(client_id, len(self.setup.client_indices[client_id]),
                       {"params": encode_params(params, wl), "grams": grams},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def merge(self, Ws: List[Params], Gs: List[Dict[str, Tensor]], p: List[float], alpha: float,
              other_weights: List[float]) -> Params:
        out = weighted_sum(Ws, other_weights)
        for m, w in self.modules.items():
            out[w] = regmean_linear([W[w] for W in Ws], [G[m] for G in Gs], p, alpha, self.pinv_rtol)
        return out

    def aggregate(self, messages, state, round_idx):
        ref = state["params"]
        dev = next(iter(ref.values())).device
        p = client_weights([m.num_samples for m in messages], self.weighting, empty_error=NO_CLIENT_DATA)
        other = client_weights([m.num_samples for m in messages], self.other, empty_error=NO_CLIENT_DATA)
        Ws = [{n: t.to(dev) for n, t in decode_params(m.payload["params"]).items()} for m in messages]
        Gs = [{k: decode_any(v).to(dev) for k, v in m.payload["grams"].items()} for m in messages]
        best, best_acc, trace = None, -float("inf"), []
        for a in self.alphas:
            cand = {n: t.to(ref[n].dtype) for n, t in self.merge(Ws, Gs, p, a, other).items()}
            if len(self.alphas) == 1:
                best = cand
                break
            acc = float(self.setup.val_metrics(cand)["accuracy"])
            trace.append((a, acc))
            if acc > best_acc:
                best, best_acc = cand, acc
        return {**state, "params": best, "alpha_trace": trace}
