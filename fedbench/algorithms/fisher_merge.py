"""Fisher Merge (Matena & Raffel, NeurIPS 2022) as the FedFisher / FedBEns baseline
(notes/fedfisher.md §2 "FisherMerge", fedbens.md §2).

Elementwise closed form with the clients' diagonal TRUE Fisher (the same cached product as
FedFisher(Diag)), merging weights λ_i = p_i = n_i / n:
    w = Σ_i p_i Q(F_i) Q(W_i) / Σ_i p_i Q(F_i)
``floor_mode``:
  * ``fallback_fedavg`` (the FedFisher code): where Σ_i p_i Q(F_i) < floor (1e-6) the coordinate
    takes the FedAvg value Σ_i p_i Q(W_i).
  * ``clamp`` (Matena & Raffel's fisher_floor): every F_i is clamped at ``floor`` before merging.
Quantisation as FedFisher(Diag): weights and Fisher 16-bit per tensor (``compression: false`` = fp32).
No server validation.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedbench.algorithms import compression as C
from fedbench.algorithms.base import ALGORITHMS, Algorithm, Message
from fedbench.algorithms.common import NO_CLIENT_DATA, client_weights
from fedbench.algorithms.fedfisher import (WEIGHTINGS, FisherClient, bits_option, decode_params, encode_params,
                                           fisher_option, weighted_sum)
from fedbench.algorithms.options import option, read_options

FLOOR_MODES = ("fallback_fedavg", "clamp")


def fisher_merge(Ws, Fs, p, floor: float = 1e-6, floor_mode: str = "fallback_fedavg"):
    """Elementwise Fisher-weighted average of parameter dicts (see module docstring)."""
    if floor_mode == "clamp":
        Fs = [{n: t.clamp_min(floor) for n, t in F.items()} for F in Fs]
    avg = weighted_sum(Ws, p)
    Fsum = weighted_sum(Fs, p)
    num = {n: sum(pi * F[n] * W[n] for pi, F, W in zip(p, Fs, Ws)) for n in Fsum}
    out = {}
    for n in Fsum:
        low = Fsum[n] < floor
        out[n] = (num[n] / Fsum[n].masked_fill(low, 1.0)).where(~low, avg[n])
    return out


@dataclass(frozen=True)
class FisherMergeOptions:
    fisher: str = option(check=fisher_option)
    weighting: str = option(choices=WEIGHTINGS)
    floor: float = option(nonneg=True)
    floor_mode: str = option(choices=FLOOR_MODES)
    compression: bool = option()
    weight_bits: int = option(check=bits_option)
    fisher_bits: int = option(check=bits_option)
    curvature_batch_size: int = option(minimum=1)


@ALGORITHMS.register("fisher_merge")
class FisherMerge(Algorithm):
    name = "fisher_merge"
    Options = FisherMergeOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.fisher, self.weighting, self.floor, self.floor_mode = o.fisher, o.weighting, o.floor, o.floor_mode
        self.compression, self.weight_bits, self.fisher_bits = o.compression, o.weight_bits, o.fisher_bits
        self.fisher_client = FisherClient(setup, self.fisher, o.curvature_batch_size)

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None

    def client_products(self, client_id, params, state, round_idx):
        return [self.fisher_client.diag(client_id, params, round_idx)]

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        F = products["fisher"]["F"]
        wl = C.levels_for_bits(self.weight_bits) if self.compression else None
        fl = C.levels_for_bits(self.fisher_bits) if self.compression else None
        return Message(client_id, len(self.setup.client_indices[client_id]),
                       {"params": encode_params(params, wl), "fisher": encode_params(F, fl)},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def aggregate(self, messages, state, round_idx):
        ref = state["params"]
        dev = next(iter(ref.values())).device
        p = client_weights([m.num_samples for m in messages], self.weighting, empty_error=NO_CLIENT_DATA)
        Ws = [{n: t.to(dev) for n, t in decode_params(m.payload["params"]).items()} for m in messages]
        Fs = [{n: t.to(dev) for n, t in decode_params(m.payload["fisher"]).items()} for m in messages]
        out = fisher_merge(Ws, Fs, p, self.floor, self.floor_mode)
        return {**state, "params": {n: out[n].to(ref[n].dtype) for n in ref}}
