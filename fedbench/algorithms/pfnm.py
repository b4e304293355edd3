"""PFNM (Yurochkin et al., ICML 2019) in FedMA's layer-wise one-shot form, as FedFisher ran it
(notes/fedfisher.md §2 "PFNM", fedbens.md §2; reference-code.md §3).

Hidden layers l = 1 .. K−1 in order; a client's neuron is the row [incoming weights, bias]
(a conv filter's in·kh·kw weights; the incoming weights of layer l ≥ 2 are first "patched" into the
global width of layer l−1 with the previous assignment, zeros for global units the client lacks).
Beta-Bernoulli-process MAP matching with Gaussian likelihood N(θ_i, σ²) and prior N(μ0, σ0²):
natural parameters g_i = μ0/σ0² + Σ_{j→i} w/σ², s_i = 1/σ0² + n_i/σ²; the global neuron is g_i/s_i.
Client j's neuron l goes to global i at cost
    Σ_d (w_ld/σ² + g_id)² / (1/σ² + s_id) − Σ_d g_id²/s_id + log(m_i / (J − m_i)),  m_i = min(count_i, 10)
or to the k-th new neuron at
    Σ_d (w_ld/σ² + μ0_d/σ0²)² / (1/σ0² + 1/σ²) − Σ_d μ0_d²σ0⁻² − 2 log k + 2 log(γ/J),  k ≤ min(L_j, max(700 − L, 1)),
solved with the Hungarian algorithm (maximising). Clients are matched in order of decreasing width,
then ``iterations`` passes over a random client order remove and re-match each client.
Constants as run (§2 [P]/[C]): σ = 1, σ0 = 1, γ = 7, 5 iterations, μ0 = 0 for weights and 0.1 for the
bias. The output layer is not matched: row c of the global output layer is Σ_j a_jc · (client j's
patched row c), a_jc = n_jc / Σ_j n_jc (the class counts are uploaded with the weights).

Fidelity switches:
- ``dummy_bias: true`` (as released): bias-free clients get zero biases, so the global model has
  biases; ``false`` matches weights only and keeps the architecture bias-free.
- ``prior_bias_slot``: ``bias`` puts μ0 = 0.1 on the bias coordinate (the sound reading); the released
  code puts it on the FIRST weight coordinate for layers l ≥ 2 (``first_column``).

The matched model is wider than the clients' (as in the papers; PFNM is one-shot only). The
returned params have the global widths under the template's parameter names; evaluation goes through
``torch.func.functional_call`` on the template, whose Linear / Conv2d / pooling / flatten forward
passes take their shapes from the tensors, so no wider model has to be built (test_matching checks
this against a freshly built wide model). Supported: chains of Linear / Conv2d (the MLPs with ≥ 1
hidden layer, lenet, fedma_cnn, simple_cnn); FedFisher ran it on LeNet and the CNN only. Residual nets (the
ResNet-18s) are refused at construction, in one line naming the model: PFNM's matched layers grow wider than the
clients', which a residual sum cannot take without matching the streams jointly, and no paper runs it there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, Message
from fedbench.algorithms.options import option, read_options
from fedbench.algorithms.otfusion import Layer, layer_chain, model_name
from fedbench.errors import FedbenchError

Params = Dict[str, Tensor]


def _match_one(Xn: np.ndarray, gw: np.ndarray, gs: np.ndarray, s_layer: np.ndarray, prior_norm: np.ndarray,
               s_prior: np.ndarray, counts: List[int], gamma: float, J: int, cap: int, pop_cap: float):
    """Match one client's (normalised) neurons ``Xn`` into the global ones; returns the updated state."""
    L, Lj = gw.shape[0], Xn.shape[0]
    if L:
        inv = 1.0 / (s_layer[None, :] + gs)                       # (L, D)
        param = ((Xn ** 2) @ inv.T + 2.0 * Xn @ (gw * inv).T + ((gw ** 2) * inv).sum(1)[None, :]
                 - ((gw ** 2) / gs).sum(1)[None, :])
        c = np.minimum(np.asarray(counts, dtype=np.float64), pop_cap)
        param = param + np.log(c / (J - c))[None, :]
    else:
        param = np.zeros((Lj, 0))
    max_added = min(Lj, max(cap - L, 1))
    nonparam = (((Xn + prior_norm) ** 2) / (s_prior + s_layer)).sum(1) - ((prior_norm ** 2) / s_prior).sum()
    nonparam = nonparam[:, None] - 2.0 * np.log(np.arange(1, max_added + 1))[None, :] + 2.0 * np.log(gamma / J)
    full = np.hstack([param, nonparam])
    from scipy.optimize import linear_sum_assignment   # here, not at import: scipy.optimize costs every run ~0.4 s

    row, col = linear_sum_assignment(-full)
    assign = [0] * Lj
    new_rows_w, new_rows_s = [], []
    new_L = L
    gw, gs = gw.copy(), gs.copy()
    counts = list(counts)
    for l, i in zip(row, col):
        if i < L:
            counts[i] += 1
            gw[i] += Xn[l]
            gs[i] += s_layer
            assign[l] = int(i)
        else:
            counts.append(1)
            assign[l] = new_L
            new_L += 1
            new_rows_w.append(prior_norm + Xn[l])
            new_rows_s.append(s_prior + s_layer)
    if new_rows_w:
        gw = np.vstack([gw, np.stack(new_rows_w)])
        gs = np.vstack([gs, np.stack(new_rows_s)])
    return gw, gs, counts, assign


def match_layer(X: Sequence[np.ndarray], s_layer: np.ndarray, mean_prior: np.ndarray, s_prior: np.ndarray,
                gamma: float, iterations: int, rng: np.random.Generator, cap: int = 700,
                pop_cap: float = 10.0) -> Tuple[List[List[int]], np.ndarray]:
    """PFNM matching of one layer: (assignment per client, global MAP neurons [L, D])."""
    J = len(X)
    order = sorted(range(J), key=lambda j: -X[j].shape[0])
    Xn = [x * s_layer for x in X]
    prior_norm = mean_prior * s_prior
    first = order[0]
    gw = prior_norm + Xn[first]
    gs = np.outer(np.ones(gw.shape[0]), s_prior + s_layer)
    counts = [1] * gw.shape[0]
    assignment: List[List[int]] = [[] for _ in range(J)]
    assignment[first] = list(range(gw.shape[0]))
    for j in order[1:]:
        gw, gs, counts, assignment[j] = _match_one(Xn[j], gw, gs, s_layer, prior_norm, s_prior, counts, gamma, J,
                                                   cap, pop_cap)
    for _ in range(iterations):
        for j in rng.permutation(J):
            to_delete = []
            for l, i in sorted(enumerate(assignment[j]), key=lambda t: -t[1]):
                counts[i] -= 1
                if counts[i] == 0:
                    del counts[i]
                    to_delete.append(i)
                    for jc in range(J):
                        if jc != j:
                            assignment[jc] = [a - 1 if a > i else a for a in assignment[jc]]
                else:
                    gw[i] = gw[i] - Xn[j][l]
                    gs[i] = gs[i] - s_layer
            gw = np.delete(gw, to_delete, axis=0)
            gs = np.delete(gs, to_delete, axis=0)
            gw, gs, counts, assignment[j] = _match_one(Xn[j], gw, gs, s_layer, prior_norm, s_prior, counts, gamma,
                                                       J, cap, pop_cap)
    return assignment, gw / gs


def patch_inputs(W: np.ndarray, layer: Layer, assign: Sequence[int], width: int) -> np.ndarray:
    """Scatter a client's input units into the global width (zeros elsewhere); W is (out, in_units*block)."""
    Wr = W.reshape(W.shape[0], len(assign), layer.block)
    out = np.zeros((W.shape[0], width, layer.block))
    out[:, np.asarray(assign, dtype=np.int64), :] = Wr
    return out.reshape(W.shape[0], width * layer.block)


def pfnm(clients: Sequence[Params], class_counts: np.ndarray, layers: Sequence[Layer], *, sigma: float = 1.0,
         sigma0: float = 1.0, gamma: float = 7.0, iterations: int = 5, mu0_bias: float = 0.1,
         dummy_bias: bool = True, prior_bias_slot: str = "bias", seed: int = 0, cap: int = 700,
         fallback_weights: Optional[Sequence[float]] = None) -> Tuple[Params, List[int]]:
    """Matched global params (template names, global widths) and the matched hidden widths."""
    rng = np.random.default_rng(seed)
    J = len(clients)
    ref = clients[0]
    dev = next(iter(ref.values())).device
    dtype = next(iter(ref.values())).dtype
    cur = [{L.weight: c[L.weight].detach().double().cpu().numpy().reshape(L.out_units, -1) for L in layers}
           for c in clients]
    biases = [{L.weight: (c[L.bias].detach().double().cpu().numpy() if L.bias else np.zeros(L.out_units))
               for L in layers} for c in clients]
    use_bias = dummy_bias or any(L.bias for L in layers)
    out: Params = {}
    widths: List[int] = []
    in_width = layers[0].in_units
    for k, L in enumerate(layers[:-1]):
        X = [np.hstack([cur[j][L.weight], biases[j][L.weight][:, None]]) if use_bias else cur[j][L.weight]
             for j in range(J)]
        D = X[0].shape[1]
        mean_prior = np.zeros(D)
        if use_bias:
            mean_prior[0 if (prior_bias_slot == "first_column" and k > 0) else D - 1] = mu0_bias
        s_prior = np.full(D, 1.0 / sigma0)
        s_layer = np.full(D, 1.0 / sigma)
        assign, glob = match_layer(X, s_layer, mean_prior, s_prior, gamma, iterations, rng, cap)
        width = glob.shape[0]
        widths.append(width)
        Wg = glob[:, :-1] if use_bias else glob
        shape = (width, in_width, *L.shape[2:]) if len(L.shape) > 2 else (width, in_width * L.block)
        out[L.weight] = torch.from_numpy(Wg.reshape(shape)).to(dtype=dtype, device=dev)
        if use_bias:
            out[L.bias or f"{L.module}.bias"] = torch.from_numpy(glob[:, -1].copy()).to(dtype=dtype, device=dev)
        nxt = layers[k + 1]
        for j in range(J):
            cur[j][nxt.weight] = patch_inputs(cur[j][nxt.weight], nxt, assign[j], width)
        in_width = width
    # output layer: class-count-weighted average of the patched rows (oneshot_matching's last layer)
    L = layers[-1]
    counts = np.asarray(class_counts, dtype=np.float64)           # (J, C)
    tot = counts.sum(0)
    a = np.where(tot[None, :] > 0, counts / np.where(tot > 0, tot, 1.0)[None, :], 0.0)
    if (tot == 0).any():   # a class no client has: the code divides 0/0; use the p_j weights instead [I]
        fb = np.asarray(fallback_weights if fallback_weights is not None else np.full(J, 1.0 / J), dtype=np.float64)
        a[:, tot == 0] = fb[:, None]
    W = sum(a[j][:, None] * cur[j][L.weight] for j in range(J))
    shape = (L.out_units, in_width, *L.shape[2:]) if len(L.shape) > 2 else (L.out_units, in_width * L.block)
    out[L.weight] = torch.from_numpy(W.reshape(shape)).to(dtype=dtype, device=dev)
    if use_bias:
        b = sum(a[j] * biases[j][L.weight] for j in range(J))
        out[L.bias or f"{L.module}.bias"] = torch.from_numpy(np.asarray(b)).to(dtype=dtype, device=dev)
    return out, widths


@dataclass(frozen=True)
class PFNMOptions:
    sigma: float = option(positive=True)
    sigma0: float = option(positive=True)
    gamma: float = option(positive=True)
    iterations: int = option(minimum=0)
    mu0_bias: float = option()
    dummy_bias: bool = option()
    prior_bias_slot: str = option(choices=("bias", "first_column"))
    max_global: int = option(minimum=1)


@ALGORITHMS.register("pfnm")
class PFNM(Algorithm):
    name = "pfnm"
    Options = PFNMOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.sigma, self.sigma0, self.gamma, self.iterations = o.sigma, o.sigma0, o.gamma, o.iterations
        self.mu0_bias, self.dummy_bias, self.prior_bias_slot = o.mu0_bias, o.dummy_bias, o.prior_bias_slot
        self.cap = o.max_global
        if setup.task != "classification":
            raise FedbenchError("pfnm needs a classification task (its output layer is averaged by class counts)")
        # chains only (FedFisher/FedBEns leave PFNM out of their ResNet tables): a one-line error before training
        self.layers = layer_chain(setup.model, self.name, model_name(setup))
        self.num_classes = self.layers[-1].out_units

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None

    def start_params(self, state, client_ids):
        if state.get("pfnm_widths"):
            raise FedbenchError("pfnm is one-shot (rounds=1): its matched model is wider than the clients' model")
        return state["params"]

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        idx = self.setup.client_indices[client_id]
        y = self.setup.train.y[idx].long().cpu()
        counts = torch.bincount(y, minlength=self.num_classes)[: self.num_classes]
        return Message(client_id, len(idx), {"params": params, "class_counts": counts},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def aggregate(self, messages: List[Message], state, round_idx):
        counts = np.stack([m.payload["class_counts"].cpu().numpy() for m in messages])
        n = np.asarray([float(m.num_samples) for m in messages])
        fb = n / n.sum() if n.sum() > 0 else None
        params, widths = pfnm([m.payload["params"] for m in messages], counts, self.layers, sigma=self.sigma,
                              sigma0=self.sigma0, gamma=self.gamma, iterations=self.iterations,
                              mu0_bias=self.mu0_bias, dummy_bias=self.dummy_bias,
                              prior_bias_slot=self.prior_bias_slot, seed=self.setup.seed, cap=self.cap,
                              fallback_weights=fb)
        return {**state, "params": params, "pfnm_widths": widths}
