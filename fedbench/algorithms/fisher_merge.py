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

from fedbench.algorithms import compression as C
from fedbench.algorithms.base import ALGORITHMS, Algorithm, Message
from fedbench.algorithms.common import NO_CLIENT_DATA, client_weights
from fedbench.algorithms.fedfisher import (FISHERS, WEIGHTINGS, FisherClient, fisher_name,
                                           decode_params, encode_params, weighted_sum)
from fedbench.algorithms.options import (boolean as cfg_bool, check_keys, choice as cfg_choice, integer as cfg_int,
                                         number as cfg_num)

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


@ALGORITHMS.register("fisher_merge")
class FisherMerge(Algorithm):
    name = "fisher_merge"
    KEYS = ("fisher", "weighting", "floor", "floor_mode", "compression", "weight_bits", "fisher_bits",
            "curvature_batch_size")

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        check_keys(self.cfg, self.KEYS, self.name)
        c = self.cfg
        self.fisher = cfg_choice({**c, "fisher": fisher_name(c.get("fisher", "true"))}, "fisher", "true", FISHERS)
        self.weighting = cfg_choice(c, "weighting", "num_samples", WEIGHTINGS)
        self.floor = cfg_num(c, "floor", 1e-6, nonneg=True)
        self.floor_mode = cfg_choice(c, "floor_mode", "fallback_fedavg", FLOOR_MODES)
        self.compression = cfg_bool(c, "compression", True)
        self.weight_bits = C.check_bits("weight_bits", c.get("weight_bits", 16))
        self.fisher_bits = C.check_bits("fisher_bits", c.get("fisher_bits", 16))
        self.fisher_client = FisherClient(setup, self.fisher, cfg_int(c, "curvature_batch_size", 64, minimum=1))

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
