"""FedLap, FedLap-Cov and FedLap-Func (Swaroop, Khan & Doshi-Velez, "Connecting Federated ADMM to Bayes").

Everything follows ``notes/fedlap.md``; section numbers below refer to that note.

Scales. The paper writes every client objective on the SUM-loss scale (ℓ_k = Σ over the N_k client
points, δ = O(1) prior precision = global weight decay, §1.1). fedbench's engine minimises the MEAN
minibatch loss plus the method's terms, so every sum-scale term is divided by N_k here (§1.4
"implementation recipe", §1.5 "mean-form loss", §1.6 "mean-form client loss"): the minibatch loss is
then an unbiased estimate of (1/N_k) × the paper's objective and both have the same minimiser.
Curvatures (H_k, V_k, S_g) stay on the sum scale.

FedLap (§1.4, Eq. 9), per client k and round:
    client  w_k = argmin ℓ_k(w) + δ v_kᵀw + (δ/2)||w − w_g||²
            engine term: (δ/N_k) [v_kᵀw + ½||w − w_g||²]
    dual    v_k ← v_k + ρ_k (w_k − w_g)          (computed on the client, uploaded: P values)
    server  w_g = Σ_k v_k
Fixed point: δ v_k = −∇ℓ_k(w_g) and Σ_k ∇ℓ_k(w_g) + δ w_g = 0, the MAP with weight decay δ.

FedLap-Cov (§1.5, Eq. 21), diagonal everywhere:
    client  w_k = argmin ℓ_k(w) + v_kᵀw − ½ wᵀV_k w + ½||w − w_g||²_{S_g}
            engine term: (1/N_k) Σ_j [v_kj w_j − ½ V_kj w_j² + ½ S_gj (w_j − w_gj)²]
    then    H_k = diag GGN (sum over D_k) at the new w_k (one extra pass, §1.5 "where H_k is evaluated")
            S_k = H_k − V_k + S_g;  v_k ← v_k + ρ (S_k w_k − S_g w_g);  V_k ← (1 − ρ) V_k + ρ H_k
            (old V_k, S_g, w_g: the ones the client trained with) — uploads v_k and V_k: 2P values
    server  S_g = δ + Σ_k V_k;  w_g = Σ_k v_k / S_g

FedLap-Func (§1.6, Eq. 17, with the −A + B sign):
    client  FedLap's objective − A + B, where (from round 2 on; round 1 = FedLap)
            A = Σ_{i∈M_k} τ_i ℓ(ŷ_i, w)       ŷ_i = soft labels client k uploaded last round
            B = Σ_{k'} Σ_{i∈M_k'} τ_i ℓ(ŷ_{i,g}, w)   ŷ_{i,g} = predictions of the broadcast w_g
            engine term: FedLap's + (1/N_k)(−A + B)
    dual    as FedLap; uploads v_k (P) and the soft labels of its memory points (|M_k| × outputs)
    server  w_g = argmin_w Σ_k [Σ_{i∈M_k} τ_i ℓ(ŷ_i, w) − δ v_kᵀw] + ½δ||w||², Adam, full batch
Memory M_k: ``memory_per_class`` random training points per class of client k, chosen once per seed
before training; τ_i = τ_f N_{k,c} / M_{k,c} (App. E). ℓ(ŷ, w) is the soft-label cross-entropy
(BCE with a soft target for one-logit models).

Initialisation (§1.4 "Initialisation", recommended reading): the sites start at 1, so v_k = V_k = 0,
the prior mean w_g⁽⁰⁾ = 0 anchors round 1, and the optimiser of round 1 starts from the run's shared
random initialisation. ``init: duals_from_init`` is the note's alternative consistent option
(v_k⁽⁰⁾ chosen so that the server rule gives w_g⁽⁰⁾ = w_init).

State is kept in the server state for simulation (like FedDyn's h_k): per-client duals, the global
mean and, for Cov, the global diagonal precision. ``Message.info['params']`` carries the client's
trained weights (not uploaded) for local-accuracy metrics.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, ClientProduct, Message
from fedbench.algorithms.common import method_generator
from fedbench.algorithms.options import option, read_options
from fedbench.errors import FedbenchError
from fedbench.train.engine import LocalObjective
from fedbench.curvature import compute_curvature

Params = Dict[str, Tensor]

RHO_RULES = ("nk_over_n", "one_over_k", "schedule")
INITS = ("zero_prior_mean", "duals_from_init")
LOCAL_STARTS = ("global", "previous_local")
COV_FISHERS = ("ggn", "mc", "empirical", "true")
HESSIAN_AT = ("new_local", "previous_local")
TAU_WEIGHTINGS = ("class_count", "uniform")
CLIENT_SIGNS = ("minus_a_plus_b", "literal_minus_a_minus_b")
SERVER_INITS = ("sum_v", "previous")


# --------------------------------------------------------------------------------------------------
# small helpers (pure functions, tested directly)
# --------------------------------------------------------------------------------------------------
def _zeros(params: Params) -> Params:
    return {n: torch.zeros_like(t) for n, t in params.items()}


def _detach(params: Params) -> Params:
    return {n: t.detach().clone() for n, t in params.items()}


def rho_value(rule, client_size: int, total: int, num_clients: int, round_idx: int,
              schedule_rounds: int = 10) -> float:
    """Damping ρ_k of the site update (§1.4 "ρ"): N_k/N, 1/K, the CIFAR schedule (N_k/N for the
    first ``schedule_rounds`` rounds, then 1/K), or a constant in (0, 1]."""
    if isinstance(rule, Real) and not isinstance(rule, bool):
        return float(rule)
    if rule == "nk_over_n":
        return client_size / max(total, 1)
    if rule == "one_over_k":
        return 1.0 / num_clients
    if rule == "schedule":
        return client_size / max(total, 1) if round_idx <= schedule_rounds else 1.0 / num_clients
    raise FedbenchError(f"algorithm.rho must be one of {RHO_RULES} or a number in (0, 1], got {rule!r}")


def fedlap_dual_update(v: Params, w_k: Params, w_g: Params, rho: float) -> Params:
    """FedLap / FedLap-Func site update (Eq. 9): v_k + ρ (w_k − w_g)."""
    return {n: v[n] + rho * (w_k[n] - w_g[n]) for n in v}


def cov_dual_update(v: Params, V: Params, H: Params, w_k: Params, w_g: Params, S_g: Params,
                    rho: float) -> Tuple[Params, Params]:
    """FedLap-Cov site update (Eq. 21, diagonal), with the old V_k, S_g, w_g:
    S_k = H_k − V_k + S_g;  v_k + ρ (S_k w_k − S_g w_g);  V_k + ρ (S_k − S_g) = (1 − ρ) V_k + ρ H_k."""
    v_new, V_new = {}, {}
    for n in v:
        S_k = H[n] - V[n] + S_g[n]
        v_new[n] = v[n] + rho * (S_k * w_k[n] - S_g[n] * w_g[n])
        V_new[n] = (1.0 - rho) * V[n] + rho * H[n]
    return v_new, V_new


def cov_server(vs: Sequence[Params], Vs: Sequence[Params], delta: float) -> Tuple[Params, Params]:
    """FedLap-Cov server (Eq. 21): S_g = δ + Σ_k V_k, w_g = S_g⁻¹ Σ_k v_k (elementwise)."""
    S_g = {n: delta + sum(V[n] for V in Vs) for n in Vs[0]}
    w_g = {n: sum(v[n] for v in vs) / S_g[n] for n in vs[0]}
    return w_g, S_g


def fedlap_term(params: Params, ctx: dict) -> Tensor:
    """(δ/N_k) [v_kᵀw + ½||w − w_g||²]: Eq. 9's sum-scale terms divided by N_k (ctx['coef'] = δ/N_k)."""
    v, w_g = ctx["v"], ctx["w_g"]
    s = sum((v[n] * p).sum() + 0.5 * ((p - w_g[n]) ** 2).sum() for n, p in params.items())
    return ctx["coef"] * s


def fedlap_cov_term(params: Params, ctx: dict) -> Tensor:
    """(1/N_k) Σ_j [v_j w_j − ½ V_j w_j² + ½ S_gj (w_j − w_gj)²]: Eq. 21's terms / N_k (ctx['inv_n'] = 1/N_k)."""
    v, V, w_g, S_g = ctx["v"], ctx["V"], ctx["w_g"], ctx["S_g"]
    s = sum((v[n] * p - 0.5 * V[n] * p * p + 0.5 * S_g[n] * (p - w_g[n]) ** 2).sum() for n, p in params.items())
    return ctx["inv_n"] * s


def soft_label_nll(out: Tensor, soft: Tensor) -> Tensor:
    """Per-point ℓ(ŷ, w) (§1.6 "loss on soft labels"): −Σ_c ŷ_c log softmax(f)_c, or BCE with a soft
    target for a single logit. out: [M, C] logits, soft: [M, C] probabilities; returns [M]."""
    if out.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(out.squeeze(-1), soft.squeeze(-1), reduction="none")
    return -(soft * F.log_softmax(out, dim=-1)).sum(-1)


def soft_labels(out: Tensor) -> Tensor:
    """Model predictions used as soft labels: softmax, or sigmoid for one logit ([M, 1])."""
    return torch.sigmoid(out) if out.shape[-1] == 1 else F.softmax(out, dim=-1)


def select_memory(labels: Tensor, per_class: int, rng: np.random.Generator) -> Tuple[List[int], List[int], List[float]]:
    """``per_class`` random positions per class present in ``labels`` (fewer if the class has fewer
    points; none for an absent class). Returns (positions, classes, N_{k,c}/M_{k,c} per point)."""
    lab = np.asarray(labels.detach().cpu()).reshape(-1)
    pos, cls, ratio = [], [], []
    if per_class == 0:
        return pos, cls, ratio
    for c in np.unique(lab):
        where = np.flatnonzero(lab == c)
        m = min(per_class, len(where))
        pick = rng.choice(where, size=m, replace=False)
        for p in sorted(pick.tolist()):
            pos.append(int(p))
            cls.append(int(c))
            ratio.append(len(where) / m)
    return pos, cls, ratio


# --------------------------------------------------------------------------------------------------
# config validation (one-line FedbenchError)
# --------------------------------------------------------------------------------------------------
def _rho(key: str, val):
    if isinstance(val, Real) and not isinstance(val, bool):
        if not (math.isfinite(float(val)) and 0 < float(val) <= 1):
            raise FedbenchError(f"algorithm.rho as a number must be in (0, 1], got {val}")
        return float(val)
    if val not in RHO_RULES:
        raise FedbenchError(f"algorithm.rho must be one of {', '.join(RHO_RULES)} or a number in (0, 1], got {val!r}")
    return val


@dataclass(frozen=True)
class FedLapOptions:
    delta: float = option(positive=True)
    rho: Any = option(check=_rho)
    rho_schedule_rounds: int = option(minimum=0)
    init: str = option(choices=INITS)
    local_start: str = option(choices=LOCAL_STARTS)


@dataclass(frozen=True)
class FedLapCovOptions(FedLapOptions):
    fisher: str = option(choices=COV_FISHERS)
    mc_samples: int = option(minimum=1)
    hessian_at: str = option(choices=HESSIAN_AT)
    curvature_batch_size: int = option(minimum=1)


@dataclass(frozen=True)
class FedLapFuncOptions(FedLapOptions):
    tau: float = option(nonneg=True)
    tau_weighting: str = option(choices=TAU_WEIGHTINGS)
    memory_per_class: int = option(minimum=0)
    client_sign: str = option(choices=CLIENT_SIGNS)
    server_iters: int = option(minimum=0)
    server_lr: float = option(positive=True)
    server_init: str = option(choices=SERVER_INITS)


# --------------------------------------------------------------------------------------------------
# FedLap
# --------------------------------------------------------------------------------------------------
@ALGORITHMS.register("fedlap")
class FedLap(Algorithm):
    """FedLap (§1.4). Config: delta, rho, rho_schedule_rounds, init, local_start."""

    name = "fedlap"
    resumable = True   # all cross-round memory is in the state dict (tests/test_resume.py)
    Options = FedLapOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = self.opts = read_options(self.Options, cfg, self.name)
        self.delta, self.rho, self.rho_schedule_rounds = o.delta, o.rho, o.rho_schedule_rounds
        self.init, self.local_start = o.init, o.local_start
        self.sizes = [len(ix) for ix in setup.client_indices]
        self.total = sum(self.sizes)

    # --- helpers ---------------------------------------------------------------------------------
    def rho_k(self, client_id: int, round_idx: int) -> float:
        return rho_value(self.rho, self.sizes[client_id], self.total, len(self.sizes), round_idx,
                         self.rho_schedule_rounds)

    def _dev_scalar(self, x: float) -> Tensor:
        p = next(iter(self._template_params().values()))
        return torch.tensor(float(x), device=p.device, dtype=p.dtype)

    def _template_params(self) -> Params:
        return dict(self.setup.model.named_parameters())

    def _init_duals(self, init: Params) -> List[Params]:
        """v_k⁽⁰⁾: zero (sites = 1), or (ρ_k/Σρ)·w_init so that Σ_k v_k = w_init (§1.4, the
        alternative consistent option; FedLap-Cov multiplies by S_g⁽⁰⁾ = δ)."""
        k = self.setup.num_clients
        if self.init == "zero_prior_mean":
            return [_zeros(init) for _ in range(k)]
        r = [self.rho_k(c, 1) for c in range(k)]
        tot = sum(r)
        return [{n: (r[c] / tot) * t.detach().clone() for n, t in init.items()} for c in range(k)]

    # --- server ----------------------------------------------------------------------------------
    def init_state(self, params):
        init = _detach(params)
        v = self._init_duals(init)
        w_g = _zeros(init) if self.init == "zero_prior_mean" else {n: sum(vk[n] for vk in v) for n in init}
        # round 1 starts the optimiser from the shared random init (w_g⁽⁰⁾ = 0 would kill NN gradients)
        return {"params": w_g, "v": v, "start": init, "w_local": None}

    def aggregate(self, messages, state, round_idx):
        v = list(state["v"])
        for m in messages:
            v[m.client_id] = m.payload["v"]
        w_g = {n: sum(vk[n] for vk in v) for n in state["params"]}
        return {**state, "params": w_g, "v": v, "start": None,
                "w_local": self._locals(messages, state)}

    def _locals(self, messages, state):
        if self.local_start != "previous_local":
            return None
        prev = list(state["w_local"]) if state.get("w_local") is not None else [None] * self.setup.num_clients
        for m in messages:
            prev[m.client_id] = m.info["params"]
        return prev

    # --- client ----------------------------------------------------------------------------------
    def client_stage_key(self, round_idx):
        """Round 1 with the zero prior mean trains every client on mean loss + (δ/2N_k)||w||² from the
        shared init, the same for FedLap, FedLap-Cov (v = V = 0, S_g = δ) and FedLap-Func (no memory
        terms in round 1), so the three share one cached client stage. Later rounds depend on the duals."""
        if round_idx != 1 or self.init != "zero_prior_mean":
            return None
        return {"fedlap_round1_prior_precision_sum_scale": self.delta}

    def start_params(self, state, client_ids):
        if state.get("start") is not None:                       # round 1
            return state["start"]
        if self.local_start == "previous_local" and state.get("w_local") is not None:
            return [state["w_local"][c] if state["w_local"][c] is not None else state["params"] for c in client_ids]
        return state["params"]

    def _base_ctx(self, state, client_ids):
        shared = {"w_g": state["params"]}
        per = [{"coef": self._dev_scalar(self.delta / max(self.sizes[c], 1)), "v": state["v"][c]}
               for c in client_ids]
        return shared, per

    def local_objective(self, state, client_ids, round_idx):
        shared, per = self._base_ctx(state, client_ids)
        return LocalObjective(terms=[fedlap_term], shared_ctx=shared, client_ctx=per)

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        v_new = fedlap_dual_update(state["v"][client_id], params, state["params"], self.rho_k(client_id, round_idx))
        return Message(client_id, self.sizes[client_id], {"v": v_new},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos], "params": params})


# --------------------------------------------------------------------------------------------------
# FedLap-Cov
# --------------------------------------------------------------------------------------------------
@ALGORITHMS.register("fedlap_cov")
class FedLapCov(FedLap):
    """FedLap-Cov (§1.5), diagonal. Extra config: fisher, mc_samples, hessian_at, curvature_batch_size."""

    name = "fedlap_cov"
    Options = FedLapCovOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = self.opts
        self.fisher, self.mc_samples, self.hessian_at = o.fisher, o.mc_samples, o.hessian_at
        self.curv_bs = o.curvature_batch_size

    def init_state(self, params):
        init = _detach(params)
        k = self.setup.num_clients
        S_g = {n: torch.full_like(t, self.delta) for n, t in init.items()}    # δI + Σ V_k with V_k = 0
        v = self._init_duals(init)
        v = [{n: self.delta * t for n, t in vk.items()} for vk in v]        # S_g⁽⁰⁾ w_init split over clients
        w_g = {n: sum(vk[n] for vk in v) / S_g[n] for n in init}
        return {"params": w_g, "precision": S_g, "v": v, "V": [_zeros(init) for _ in range(k)],
                "start": init, "w_local": None, "w_prev": None}

    def downlink(self, state):
        return {"params": state["params"], "precision": state["precision"]}   # 2P (§1.9)

    def local_objective(self, state, client_ids, round_idx):
        shared = {"w_g": state["params"], "S_g": state["precision"]}
        per = [{"inv_n": self._dev_scalar(1.0 / max(self.sizes[c], 1)), "v": state["v"][c], "V": state["V"][c]}
               for c in client_ids]
        return LocalObjective(terms=[fedlap_cov_term], shared_ctx=shared, client_ctx=per)

    def _loss_kind(self, width: int) -> str:
        if self.setup.task == "regression":
            return "mse"
        return "bce" if width == 1 else "ce"

    def diag_curvature(self, worker, client_id: int, params: Params, round_idx: int) -> Params:
        """H_k: per-example diagonal GGN (or the chosen Fisher), SUM over the client's N_k points (§1.5), at
        ``params`` (which ``worker`` holds)."""

        idx = self.setup.client_indices[client_id]
        if len(idx) == 0:
            return _zeros(params)
        x, y = self.setup.train.inputs(idx), self.setup.train.targets(idx)
        with torch.no_grad():
            width = worker(x[:1]).shape[-1]
        gen = None
        if self.fisher == "mc":   # reproducible per (seed, round, client); a distinct stream from training
            gen = method_generator("fedlap", self.setup.seed, round_idx, client_id)
        curv = compute_curvature(worker, x, y, structure="diag", fisher=self.fisher, scale="sum",
                                 loss=self._loss_kind(width), batch_size=self.curv_bs, mc_samples=self.mc_samples,
                                 generator=gen)
        return {n: curv.diag[n].detach().to(params[n].dtype) for n in params}

    def client_products(self, client_id, params, state, round_idx):
        """Product ``H``: {"H": H_k} at the trained weights, or (hessian_at: previous_local) at App. B's
        "m_old", the client's most recent weights before this update (round 1: the start)."""
        at = params
        if self.hessian_at == "previous_local":
            prev = state.get("w_prev")
            at = prev[client_id] if prev is not None and prev[client_id] is not None else \
                (state["start"] if state.get("start") is not None else state["params"])
        parts = {"fisher": self.fisher, "mc_samples": self.mc_samples if self.fisher == "mc" else None,
                 "hessian_at": self.hessian_at, "scale": "sum"}
        return [ClientProduct("fedlap_cov_diag_curvature", parts, at, label="H",
                              compute=lambda worker: {"H": self.diag_curvature(worker, client_id, at, round_idx)})]

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        H = products["H"]["H"]
        v_new, V_new = cov_dual_update(state["v"][client_id], state["V"][client_id], H, params, state["params"],
                                       state["precision"], self.rho_k(client_id, round_idx))
        return Message(client_id, self.sizes[client_id], {"v": v_new, "V": V_new},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos], "params": params})

    def aggregate(self, messages, state, round_idx):
        v, V = list(state["v"]), list(state["V"])
        for m in messages:
            v[m.client_id] = m.payload["v"]
            V[m.client_id] = m.payload["V"]
        w_g, S_g = cov_server(v, V, self.delta)
        prev = list(state["w_prev"]) if state.get("w_prev") is not None else [None] * self.setup.num_clients
        for m in messages:
            prev[m.client_id] = m.info["params"]
        return {**state, "params": w_g, "precision": S_g, "v": v, "V": V, "start": None,
                "w_local": self._locals(messages, state),
                "w_prev": prev if self.hessian_at == "previous_local" else None}


# --------------------------------------------------------------------------------------------------
# FedLap-Func
# --------------------------------------------------------------------------------------------------
class FuncTerm:
    """FedLap's term plus (1/N_k)(−A + B) on the memory points (§1.6), one forward on all of M.

    ctx: 'mem_x' [M, ...] memory inputs, 'tau' [M] per-point τ_i, 'soft_prev' [M, C] soft labels each
    point's owner uploaded last round (A), 'soft_g' [M, C] predictions of the broadcast w_g (B),
    per client 'own' [M] (1 where i ∈ M_k) and 'inv_n' = 1/N_k. ``sign_b`` = +1 (−A + B, default)
    or −1 (the literal −(A + B) of the LaTeX, §1.6 "sign ambiguity").
    """

    def __init__(self, model, sign_b: float):
        self.model = model
        self.sign_b = float(sign_b)

    def __call__(self, params: Params, ctx: dict) -> Tensor:
        out = torch.func.functional_call(self.model, params, (ctx["mem_x"],))
        a = soft_label_nll(out, ctx["soft_prev"]) * ctx["own"]
        b = soft_label_nll(out, ctx["soft_g"])
        func = (ctx["tau"] * (self.sign_b * b - a)).sum()
        return fedlap_term(params, ctx) + ctx["inv_n"] * func


@ALGORITHMS.register("fedlap_func")
class FedLapFunc(FedLap):
    """FedLap-Func (§1.6). Extra config: tau, tau_weighting, memory_per_class, client_sign,
    server_iters, server_lr, server_init."""

    name = "fedlap_func"
    Options = FedLapFuncOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = self.opts
        self.tau, self.tau_weighting, self.memory_per_class = o.tau, o.tau_weighting, o.memory_per_class
        self.client_sign, self.server_iters, self.server_lr = o.client_sign, o.server_iters, o.server_lr
        self.server_init = o.server_init
        if setup.task == "regression":
            raise FedbenchError("fedlap_func needs a classification task (memory points are chosen per class)")
        # predictions for soft labels and the memory terms: an eval-mode copy (no dropout; soft labels
        # are the model's predictions), never the shared template
        self._fmodel = copy.deepcopy(setup.model).eval()
        self._choose_memory()

    def _choose_memory(self) -> None:
        """M_k once per seed, before training (§1.6 "details"): per client, ``memory_per_class`` random
        own training points per class present; τ_i = τ_f · N_{k,c}/M_{k,c} (App. E) or τ_f."""
        data = self.setup.train
        glob, owner, cls, tau = [], [], [], []
        for k, idx in enumerate(self.setup.client_indices):
            rng = np.random.default_rng([int(self.setup.seed), 0x4D454D, k])   # "MEM" stream, per client
            pos, c, ratio = select_memory(data.targets(idx), self.memory_per_class, rng)
            glob += [int(idx[p]) for p in pos]
            owner += [k] * len(pos)
            cls += c
            tau += [self.tau * (r if self.tau_weighting == "class_count" else 1.0) for r in ratio]
        dev = self.setup.client_indices[0].device if self.setup.client_indices else self.setup.device
        p = next(iter(self._template_params().values()))
        self.mem_index = torch.tensor(glob, dtype=torch.long, device=dev)
        self.mem_owner = torch.tensor(owner, dtype=torch.long, device=p.device)
        self.mem_class = torch.tensor(cls, dtype=torch.long, device=p.device)
        self.mem_tau = torch.tensor(tau, dtype=p.dtype, device=p.device)
        self.mem_x = data.inputs(self.mem_index).to(p.device) if glob else None

    def _predict(self, params: Params) -> Tensor:
        with torch.no_grad():
            return soft_labels(torch.func.functional_call(self._fmodel, params, (self.mem_x,)))

    def init_state(self, params):
        st = super().init_state(params)
        st["soft"] = None            # [M, C]: soft labels each owner uploaded last
        st["server_objective"] = []
        return st

    def local_objective(self, state, client_ids, round_idx):
        shared, per = self._base_ctx(state, client_ids)
        if state.get("soft") is None or self.mem_x is None:          # round 1 (or M = ∅): FedLap
            return LocalObjective(terms=[fedlap_term], shared_ctx=shared, client_ctx=per)
        dt = self.mem_tau.dtype
        shared.update(mem_x=self.mem_x, tau=self.mem_tau, soft_prev=state["soft"],
                      soft_g=self._predict(state["params"]))
        for d, c in zip(per, client_ids):
            d["own"] = (self.mem_owner == c).to(dt)
            d["inv_n"] = self._dev_scalar(1.0 / max(self.sizes[c], 1))
        sign_b = 1.0 if self.client_sign == "minus_a_plus_b" else -1.0
        return LocalObjective(terms=[FuncTerm(self._fmodel, sign_b)], shared_ctx=shared, client_ctx=per)

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        msg = super().client_message(client_id, params, result, pos, state, round_idx, products)
        own = self.mem_owner == client_id
        if self.mem_x is not None and bool(own.any()):
            with torch.no_grad():
                out = torch.func.functional_call(self._fmodel, params, (self.mem_x[own],))
            msg.payload["soft_labels"] = soft_labels(out)               # |M_k| × outputs, uploaded
        return msg

    def server_objective(self, w: Params, soft: Optional[Tensor], v_sum: Params) -> Tensor:
        """Σ_i τ_i ℓ(ŷ_i, w) − δ (Σ_k v_k)ᵀw + ½δ||w||² (Eq. 17's server problem)."""
        reg = sum(-self.delta * (v_sum[n] * p).sum() + 0.5 * self.delta * (p * p).sum() for n, p in w.items())
        if soft is None or self.mem_x is None:
            return reg
        out = torch.func.functional_call(self._fmodel, w, (self.mem_x,))
        return (self.mem_tau * soft_label_nll(out, soft)).sum() + reg

    def aggregate(self, messages, state, round_idx):
        v = list(state["v"])
        for m in messages:
            v[m.client_id] = m.payload["v"]
        v_sum = {n: sum(vk[n] for vk in v) for n in state["params"]}
        soft = state.get("soft")
        if self.mem_x is not None:
            soft = soft.clone() if soft is not None else None
            for m in messages:
                if "soft_labels" not in m.payload:
                    continue
                if soft is None:
                    soft = torch.zeros(len(self.mem_owner), m.payload["soft_labels"].shape[-1],
                                       dtype=self.mem_tau.dtype, device=self.mem_tau.device)
                soft[self.mem_owner == m.client_id] = m.payload["soft_labels"]
        w_g, trace = self._server_optimise(v_sum, soft, state)
        return {**state, "params": w_g, "v": v, "soft": soft, "start": None,
                "w_local": self._locals(messages, state), "server_objective": trace}

    def _server_optimise(self, v_sum: Params, soft: Optional[Tensor], state) -> Tuple[Params, List[float]]:
        """Adam on the full memory (§1.6 server table: iterations and lr configurable; init Σ_k v_k,
        the FedLap solution, or the previous w_g). Returns w_g and the objective every ~1% of steps."""
        if soft is None or self.mem_x is None:
            # no function-space sites (M = ∅): the problem is ½δ||w − Σv||² + const, solved exactly,
            # so FedLap-Func without memory is FedLap (§1.6)
            w0 = {n: t.detach().clone() for n, t in v_sum.items()}
            with torch.no_grad():
                return w0, [float(self.server_objective(w0, None, v_sum))]
        init = v_sum if self.server_init == "sum_v" else state["params"]
        w = {n: t.detach().clone().requires_grad_(True) for n, t in init.items()}
        opt = torch.optim.Adam(list(w.values()), lr=self.server_lr)
        every = max(1, self.server_iters // 100)
        trace = []
        for it in range(self.server_iters):
            opt.zero_grad(set_to_none=True)
            loss = self.server_objective(w, soft, v_sum)
            if it % every == 0:
                trace.append(float(loss.detach()))
            loss.backward()
            opt.step()
        with torch.no_grad():
            trace.append(float(self.server_objective(w, soft, v_sum)))
        return {n: t.detach() for n, t in w.items()}, trace
