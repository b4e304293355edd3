"""FedFisher with the FULL Fisher on a regression model (notes/fedfisher.md §1.8; the paper's Figure 1).

The synthetic validation of Theorem 1: each client trains (the engine's plain local training, shared
with FedAvg's cached clients), then uploads its trained weights W_i and its full Fisher over the
trained parameters only, at W_i, mean over its n_i points:

    F_i = (1/n_i) Σ_j φ_j φ_jᵀ,   φ_j = ∇_W f(W_i, x_j)

(under the unit-variance Gaussian likelihood of the ½(y − f)² loss the true Fisher equals the
Gauss-Newton matrix Jᵀ J / n, §1.8 "Fisher"; computed by the curvature engine in float64). A fixed
buffer (two_layer_relu's output weights a_r) is not a parameter and gets no row.

Server (§1.1 Lemma 1, §1.4 weights p_i = n_i / n): minimise ½ Σ_i p_i (W − W_i)ᵀ F_i (W − W_i) from
W̄ = Σ_i p_i W_i, with F = Σ_i p_i F_i and b = Σ_i p_i F_i W_i:
  closed_form  W* = W̄ + F⁺ (b − F W̄), the limit of GD from W̄ (eigh in float64, eigenvalues below
               rtol·λ_max treated as zero)
  gd           W ← W − η_S Σ_i M p_i F_i (W − W_i), ``server_steps`` times (M p_i = 1 for equal client
               sizes: Algorithm 1's plain sum, so η_S = 0.001 is the paper's value)

Recorded beside the test metrics (``state["extra_metrics"]``): the global training loss
L(W) = (1/M) Σ_i L_i(W), L_i the mean ½(y − f)² over client i's training points, of the server model
(``global_train_loss``, Figure 1's y axis) and of the average W̄ (``fedavg_train_loss``), the server
objective at both (``laplace_objective``, ``fedavg_laplace_objective``) and rank(F) (closed form).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, ClientProduct, Message
from fedbench.algorithms.common import NO_CLIENT_DATA, client_weights
from fedbench.algorithms.fedfisher import WEIGHTINGS
from fedbench.algorithms.options import option, read_options
from fedbench.errors import FedbenchError
from fedbench.curvature.layout import ParamLayout
from fedbench.curvature import compute_curvature

Params = Dict[str, Tensor]
SERVERS = ("closed_form", "gd")


# --------------------------------------------------------------------------------------------------
# server solvers on flat float64 vectors
# --------------------------------------------------------------------------------------------------
def closed_form(F: Tensor, b: Tensor, w0: Tensor, rtol: Optional[float] = None) -> tuple[Tensor, int]:
    """(w0 + F⁺(b − F w0), rank): the point GD from w0 converges to (Lemma 1). The pseudo-inverse is taken
    from eigh of the symmetrised F; rtol = None uses d·eps as numpy / torch ``pinv``."""
    F = 0.5 * (F + F.T)
    lam, V = torch.linalg.eigh(F)
    top = float(lam.max()) if lam.numel() else 0.0
    if top <= 0.0:
        return w0.clone(), 0
    rtol = F.shape[0] * torch.finfo(F.dtype).eps if rtol is None else float(rtol)
    keep = lam > rtol * top
    Vk = V[:, keep]
    r = b - F @ w0
    return w0 + Vk @ ((Vk.T @ r) / lam[keep]), int(keep.sum())


def server_gd(F: Tensor, b: Tensor, w0: Tensor, lr: float, steps: int) -> Tensor:
    """``steps`` iterations of w ← w − lr (F w − b) from w0."""
    w = w0.clone()
    for _ in range(int(steps)):
        w = w - lr * (F @ w - b)
    return w


def laplace_objective(w: Tensor, Fs: Sequence[Tensor], Ws: Sequence[Tensor], p: Sequence[float]) -> float:
    """½ Σ_i p_i (w − W_i)ᵀ F_i (w − W_i)."""
    return float(sum(pi * 0.5 * ((w - Wi) @ (Fi @ (w - Wi))) for pi, Fi, Wi in zip(p, Fs, Ws)))


# --------------------------------------------------------------------------------------------------
# the method
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FedFisherFullOptions:
    server: str = option(choices=SERVERS)
    server_lr: float = option(positive=True)
    server_steps: int = option(minimum=0)
    pinv_rtol: Optional[float] = option(nonneg=True)
    weighting: str = option(choices=WEIGHTINGS)
    max_params: int = option(minimum=1)


@ALGORITHMS.register("fedfisher_full")
class FedFisherFull(Algorithm):
    name = "fedfisher_full"
    Options = FedFisherFullOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.server, self.server_lr, self.server_steps = o.server, o.server_lr, o.server_steps
        self.rtol, self.weighting, self.max_params = o.pinv_rtol, o.weighting, o.max_params
        if setup.task != "regression":
            raise FedbenchError(f"fedfisher_full needs a regression data set (its Fisher is the Gaussian-likelihood "
                                f"Gauss-Newton matrix and it records the ½(y − f)² training loss, fedfisher.md §1.8); "
                                f"this data set's task is {setup.task!r}")
        self.layout = ParamLayout.from_module(setup.model)
        d = self.layout.numel
        if d > self.max_params:
            raise FedbenchError(f"fedfisher_full sends a dense d x d Fisher per client and inverts their sum "
                                f"(O(d^2) memory, O(d^3) time); this model has d = {d} trained parameters > "
                                f"algorithm.max_params = {self.max_params} ({8 * d * d / 2 ** 30:.2f} GiB per "
                                f"float64 matrix): use a smaller model or raise max_params")

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None   # plain local training: shares FedAvg's cached clients

    # --- helpers ---------------------------------------------------------------------------------
    def _forward64(self, params: Params, x: Tensor) -> Tensor:
        """The template's output in float64 at ``params`` (its other weights and buffers such as a_r cast along)."""
        tensors = {**dict(self.setup.model.named_parameters()), **dict(self.setup.model.named_buffers()), **params}
        return torch.func.functional_call(self.setup.model, {n: t.double() for n, t in tensors.items()}, (x.double(),))

    def _flat(self, params: Params) -> Tensor:
        return self.layout.flatten({n: params[n].double() for n in self.layout.names})

    def _unflat(self, w: Tensor, ref: Params) -> Params:
        out = self.layout.unflatten(w)
        return {n: out[n].to(ref[n].dtype, copy=True) if n in out else ref[n] for n in ref}

    def fisher(self, client_id: int, params: Params) -> ClientProduct:
        """Product ``fisher``: {"F": the client's full Fisher (= GGN) over the trained parameters, mean over its
        points, float64 [d, d]}, on the loop's float64 worker; not cached (d x d per client)."""
        def compute(model64):
            d = self.layout.numel
            if len(self.setup.client_indices[client_id]) == 0:
                return {"F": torch.zeros(d, d, dtype=torch.float64, device=self.setup.device)}
            x, y = self.setup.client_data(client_id)
            curv = compute_curvature(model64, x.double(), y.double(), structure="full", fisher="true",
                                     scale="mean", loss="mse")
            return {"F": curv.to_dense().detach()}
        return ClientProduct("fedfisher_full_fisher", None, params, compute, label="fisher", dtype=torch.float64)

    def train_loss(self, params: Params) -> float:
        """L(W) = (1/M) Σ_i L_i(W), L_i = mean ½(y − f)² over client i's training points (clients with data)."""
        losses = []
        with torch.no_grad():
            for cid in range(self.setup.num_clients):
                if len(self.setup.client_indices[cid]) == 0:
                    continue
                x, y = self.setup.client_data(cid)
                f = self._forward64(params, x)
                losses.append(float((0.5 * (f.reshape(y.shape) - y.double()) ** 2).mean()))
        return sum(losses) / max(len(losses), 1)

    # --- hooks -----------------------------------------------------------------------------------
    def client_products(self, client_id, params, state, round_idx):
        return [self.fisher(client_id, params)]

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        payload = {"params": {n: t.detach() for n, t in params.items()}, "fisher": products["fisher"]["F"]}
        return Message(client_id, len(self.setup.client_indices[client_id]), payload,
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def aggregate(self, messages: List[Message], state: Dict[str, Any], round_idx: int) -> Dict[str, Any]:
        ref = state["params"]
        p = client_weights([m.num_samples for m in messages], self.weighting, empty_error=NO_CLIENT_DATA)
        Ws = [self._flat(m.payload["params"]) for m in messages]
        Fs = [m.payload["fisher"].to(Ws[0].device, torch.float64) for m in messages]
        w_bar = sum(pi * W for pi, W in zip(p, Ws))
        F = sum(pi * Fi for pi, Fi in zip(p, Fs))
        b = sum(pi * (Fi @ W) for pi, Fi, W in zip(p, Fs, Ws))
        extra: Dict[str, float] = {}
        if self.server == "closed_form":
            w, rank = closed_form(F, b, w_bar, self.rtol)
            extra["fisher_rank"] = float(rank)
        else:
            M = len(messages)
            w = server_gd(M * F, M * b, w_bar, self.server_lr, self.server_steps)
        out = self._unflat(w, ref)
        avg = self._unflat(w_bar, ref)
        extra.update(global_train_loss=self.train_loss(out), fedavg_train_loss=self.train_loss(avg),
                     laplace_objective=laplace_objective(w, Fs, Ws, p),
                     fedavg_laplace_objective=laplace_objective(w_bar, Fs, Ws, p))
        return {**state, "params": out, "extra_metrics": extra}
