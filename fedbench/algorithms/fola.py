"""FOLA (Liu et al., TPAMI 2023): online diagonal empirical-Fisher Laplace + Gaussian-product aggregation.

Notes: ``../shared/reference/notes/fola.md`` (section numbers below refer to it).

Round r (1-based), client n, diagonal precisions ω, global posterior N(μ_S, diag(ω_S)⁻¹):

* local training from θ = μ_S on  mean task loss + c_r · ½ Σ ω_S (θ − μ_S)²  (Eq. 16), c_r = λ
  (``round_scaling: paper``) or λ/r (``code``, §1.6 table). ``prior_grad: live`` lets the term's
  gradient flow (the paper); ``detached_as_released`` reproduces the released code, whose penalty is
  read from a detached ``state_dict()`` and so has no gradient (trains like plain SGD; §1.6, §1.8-17).
* Fisher F_n of the task loss (Algorithm 1: g = ∂L_task/∂θ), either accumulated over the local steps
  (``fisher.mode: online``, Eq. 22) or from one pass at the trained weights (``offline``, §1.7). A
  step's increment is the batch mean of per-sample squared gradients (``fisher.grad: per_sample_sq``,
  Eqs. 21–22) or the square of the minibatch-mean gradient (``minibatch_sq``, the code, §1.8-4);
  increments are averaged over the T steps (``fisher.normalize: steps``, Eq. 22) or summed with
  weights |b|/N_n (``none``, the code: scale grows with E).
* client precision ω_n = F_n / r + (r−1)/r · ω_S (``round_scaling: paper``, Eq. 24), or
  ω_n = ω_S + F_n (``code``: the accumulator starts at ω_S, so ω_S is a running sum; the offline
  code resets it, ω_n = F_n). Uplink: μ_n = θ_n and ω_n (2 × the model).
* server (``aggregation: product``, Eq. 12 diagonal): ω_S = Σ π_n ω_n,
  μ_S = Σ π_n ω_n μ_n / (ω_S + ε) (``agg_eps_mode: denominator``, the code's ε = 1e-5, §1.3) or
  Σ π_n (ω_n + ε) μ_n / (ω_S + ε) (``per_client``: each client gets ε extra precision, so coordinates
  with ω ≈ 0 everywhere fall back to the FedAvg average instead of shrinking to 0). ``aggregation:
  mean`` keeps the prior loss but averages μ like FedAvg (ω_S = Σ π_n ω_n still; Fig. 9(b)(c), §1.7).

The engine's step hooks see the gradient of (task loss + prior term). With a live prior the task
gradient is recovered as g − c_r ω_S ⊙ (θ_t − μ_S), with θ_t tracked by replaying the engine's
(S)GD update (clipping included); ``per_sample_sq`` also replays the engine's minibatches (same
per-client generator) to get per-sample gradients at θ_t; the serial engine passes both (θ_t and the minibatch), the
batched one is replayed. ``fisher.gradient: total`` squares the
engine's gradient as is (cheaper, not the paper's Fisher). Both need ``local.optimizer: sgd``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, ClientProduct, Message, weighted_average
from fedbench.algorithms.common import client_weights
from fedbench.algorithms.options import option, read_options
from fedbench.curvature import OnlineDiagFisher, compute_curvature
from fedbench.curvature.compute import tap_forward
from fedbench.curvature.posterior import EPS_MODES, diag_gaussian_product
from fedbench.errors import FedbenchError
from fedbench.train.engine import LocalObjective, client_generator, data_loss, epoch_batches
from fedbench.train.terms import QuadraticPriorTerm

Params = Dict[str, Tensor]

PRIOR_GRADS = ("live", "detached_as_released")
ROUND_SCALINGS = ("paper", "code")
AGGREGATIONS = ("product", "mean")
FISHER_MODES = ("online", "offline")
FISHER_GRADS = ("per_sample_sq", "minibatch_sq")
FISHER_NORMALIZE = ("steps", "none")
FISHER_GRADIENTS = ("task", "total")


@dataclass(frozen=True)
class FolaFisherOptions:
    mode: str = option(choices=FISHER_MODES)
    grad: str = option(choices=FISHER_GRADS)
    normalize: str = option(choices=FISHER_NORMALIZE)
    gradient: str = option(choices=FISHER_GRADIENTS)
    chunk_size: int = option(minimum=1)


@dataclass(frozen=True)
class FolaOptions:
    lambda_prior: float = option(nonneg=True)
    prior_grad: str = option(choices=PRIOR_GRADS)
    prior_init_precision: float = option(nonneg=True)
    round_scaling: str = option(choices=ROUND_SCALINGS)
    aggregation: str = option(choices=AGGREGATIONS)
    agg_eps: float = option(nonneg=True)
    agg_eps_mode: str = option(choices=EPS_MODES)
    fisher: FolaFisherOptions = option()


def loss_kind(setup) -> str:
    """The curvature likelihood matching the engine's data loss."""
    return "mse" if getattr(setup, "task", "classification") == "regression" else "auto"


# ---- server-side formulas (the Gaussian product, Eq. 12, is curvature.posterior.diag_gaussian_product) ----------
def client_precision(fisher: Params, prior_precision: Params, round_idx: int, round_scaling: str,
                     mode: str) -> Params:
    """ω_n from the round's Fisher: Eq. 24 (paper) or the code's running sum (online) / reset (offline)."""
    r = int(round_idx)
    if round_scaling == "paper":
        return {n: fisher[n] / r + prior_precision[n] * ((r - 1) / r) for n in fisher}
    if mode == "online":
        return {n: prior_precision[n] + fisher[n] for n in fisher}
    return {n: fisher[n].clone() for n in fisher}


def prior_coefficient(lam: float, round_idx: int, round_scaling: str) -> float:
    """c_r in c_r · ½ Σ ω_S (θ − μ_S)²: λ (paper, Eq. 16) or λ / r (code, §1.6)."""
    return lam if round_scaling == "paper" else lam / int(round_idx)


# ---- client-side Fisher -------------------------------------------------------------------------------
def _load(worker: torch.nn.Module, params: Params) -> None:
    with torch.no_grad():
        for n, p in worker.named_parameters():
            p.copy_(params[n])


def offline_fisher_product(setup, params: Params, client_id: int, *, grad: str, normalize: str = "none",
                           chunk_size: int = 256) -> ClientProduct:
    """Product ``fisher``: {"fisher": ``offline_diag_fisher`` at the trained weights}, cached with the client
    stage when the round's local training is."""
    parts = {"grad": grad, "normalize": normalize if grad == "minibatch_sq" else "mean"}
    return ClientProduct("offline_diag_fisher", parts, params, label="fisher", compute=lambda worker: {
        "fisher": offline_diag_fisher(setup, worker, params, client_id, grad=grad, normalize=normalize,
                                      chunk_size=chunk_size)})


def offline_diag_fisher(setup, worker: torch.nn.Module, params: Params, client_id: int, *, grad: str,
                        normalize: str = "none", chunk_size: int = 256) -> Params:
    """One pass over the client's data at ``params`` (FOLA-offline / FedCurv, §1.7, §2): per-sample squares
    (the exact diagonal empirical Fisher, mean over samples) or the code's Σ_b (|b|/N) g_b² over minibatches
    of local.batch_size (``normalize: steps`` averages over the batches instead)."""
    idx = setup.client_indices[client_id]
    n = len(idx)
    _load(worker, params)
    if n == 0:
        return {k: torch.zeros_like(v) for k, v in params.items()}
    if grad == "per_sample_sq":
        x, y = setup.train.inputs(idx), setup.train.targets(idx)
        c = compute_curvature(worker, x, y, structure="diag", fisher="empirical", scale="mean",
                              loss=loss_kind(setup), batch_size=int(chunk_size))
        return {k: c.diag[k].detach().clone() for k in params}
    acc = OnlineDiagFisher(params, int(n), "minibatch_sq")
    named = dict(worker.named_parameters())
    for b in torch.split(torch.arange(n, device=idx.device), setup.local.batch_size):
        sub = idx[b]
        out = worker(setup.train.inputs(sub))
        loss = data_loss(out, setup.train.targets(sub), setup.task).mean()
        g = torch.autograd.grad(loss, list(named.values()))
        acc.update(dict(zip(named, g)), batch_size=len(sub))
    return acc.fisher(normalize)


class _BatchReplay:
    """The engine's minibatch stream of one client (same generator, order and augmentation draws)."""

    def __init__(self, setup, client_id: int, round_idx: int):
        self.data = setup.train
        self.idx = setup.client_indices[client_id]
        self.local = setup.local
        self.gen = client_generator(setup.seed, round_idx, client_id)
        self.queue: List[Tensor] = []

    def next(self):
        if not self.queue:
            self.queue = list(epoch_batches(len(self.idx), self.local.batch_size, self.gen, self.local.drop_last))
            if not self.queue:
                raise FedbenchError("FOLA online Fisher: a client without data took a training step")
        b = self.queue.pop(0)
        idx = self.idx[b.to(self.idx.device)]
        x = self.data.raw(idx)
        if self.data.augment is not None and x.shape[0] > 0:
            x = self.data.augment(x, self.gen)
        return self.data.normalize(x), self.data.targets(idx)


class FolaOnlineHook:
    """``step_hooks`` member accumulating each client's online diagonal Fisher (Eq. 22).

    ``prior``: (c_r, μ_S, ω_S) of a live prior term whose gradient is in the engine's gradient (to be
    removed for ``gradient: task``), or None. ``after_backward`` also accepts the pre-step weights and
    the minibatch as keywords (``params=``, ``x=``, ``y=``), which the serial engine passes (``wants_batch``);
    then no replay is needed (the batched engine's steps are still replayed). ``outputs(client_id)``: the
    client's Fisher so far (normalised by ``normalize``), which
    the engine puts into the training result (and its epoch snapshots) as ``extras["online_fisher"]``.
    """

    # the serial engine passes its pre-step weights and minibatch (params=, x=, y=): no replay of them, the same bits
    wants_batch = True
    # per_sample_sq under the serial engine: read the squares off the engine's own forward pass (``watch``)
    tap_forward = True

    def __init__(self, setup, client_ids: Sequence[int], start: Params, round_idx: int, *, grad: str,
                 gradient: str, prior: Optional[tuple] = None, worker: Optional[torch.nn.Module] = None,
                 chunk_size: int = 256, normalize: str = "none"):
        self.setup = setup
        self.grad = grad
        self.normalize = normalize
        self.prior = prior if gradient == "task" else None
        self.worker = worker
        self.loss = loss_kind(setup)
        self.chunk = int(chunk_size)
        sizes = {int(c): max(len(setup.client_indices[c]), 1) for c in client_ids}
        ref = worker if grad == "per_sample_sq" else start
        self.accs = {c: OnlineDiagFisher(ref, n, grad, loss=self.loss, batch_size=self.chunk) for c, n in sizes.items()}
        self.track = grad == "per_sample_sq" or self.prior is not None
        if self.track and setup.local.optimizer != "sgd":
            raise FedbenchError("FOLA's online Fisher replays the local SGD update; set local.optimizer: sgd, "
                                "or use algorithm.fisher.grad: minibatch_sq with fisher.gradient: total")
        self.theta = {c: {n: t.detach().clone() for n, t in start.items()} for c in sizes} if self.track else {}
        self.buf: Dict[int, Optional[Params]] = {c: None for c in sizes}
        self.replay = {c: _BatchReplay(setup, c, round_idx) for c in sizes} if grad == "per_sample_sq" else {}
        self._scratch: Dict[str, Params] = {}
        self._coef_om: Optional[Params] = None
        self.tap = None

    def watch(self, worker: torch.nn.Module):
        """The serial engine shows the hook its worker before training; for the paper's per-sample squares the hook
        then reads each step's per-sample gradients off the engine's own forward pass (a tap on the worker) instead
        of a second forward pass at the same weights: the same bits, about 1.2x faster a step
        (scripts/bench_fola_online.py --engine). Returns the tap (the engine keeps its graph through the backward
        and removes the tap after training), or None: another estimator, or a model ``tap_forward`` declines."""
        self.tap = tap_forward(worker) if self.grad == "per_sample_sq" and self.tap_forward else None
        return self.tap

    def __getitem__(self, cid: int) -> OnlineDiagFisher:
        return self.accs[int(cid)]

    def outputs(self, cid: int) -> Dict[str, Params]:
        return {"online_fisher": self.accs[int(cid)].fisher(self.normalize)}

    @torch.no_grad()
    def after_backward(self, client_ids, grads: Mapping[str, Tensor], batch_sizes, *, params=None, x=None,
                       y=None) -> None:
        sizes = [int(b) for b in (batch_sizes.tolist() if torch.is_tensor(batch_sizes) else batch_sizes)]
        for j, cid in enumerate(client_ids):
            cid = int(cid)
            g = {n: t[j] for n, t in grads.items()}
            theta = {n: t[j] for n, t in params.items()} if params is not None else self.theta.get(cid)
            acc = self.accs[cid]
            if self.grad == "minibatch_sq":   # per_sample_sq takes the task loss's own per-sample gradients
                acc.update(self._task_gradient(g, theta) if self.prior is not None else g, batch_size=sizes[j])
            else:
                if x is not None:
                    xb, yb = x[j][: sizes[j]], y[j][: sizes[j]]
                else:
                    xb, yb = self.replay[cid].next()
                if xb.shape[0] != sizes[j]:
                    raise FedbenchError(f"FOLA online Fisher lost track of client {cid}'s minibatches "
                                        f"({xb.shape[0]} vs {sizes[j]} samples)")
                with torch.enable_grad():
                    if self.tap is not None and x is not None and sizes[j] <= self.chunk:   # one chunk: same bits
                        acc.update(tap=self.tap, y=yb)
                    else:
                        _load(self.worker, theta)
                        acc.update(x=xb, y=yb)
            if self.track and params is None:
                self._sgd_step(cid, g)

    def _buffers(self, name: str, like: Params) -> Params:
        """Per-hook scratch tensors shaped as ``like``, reused on every step: the per-step arithmetic below is
        element-wise over every weight, and a fresh tensor per operation makes it about 1.3x slower
        (scripts/bench_fola_online.py). Bit-identical."""
        if name not in self._scratch:
            self._scratch[name] = {n: torch.empty_like(t) for n, t in like.items()}
        return self._scratch[name]

    def _task_gradient(self, g: Params, theta: Params) -> Params:
        """g − c_r ω_S ⊙ (θ − μ_S): the engine's gradient without the live prior term's (c_r ω_S fixed this round)."""
        coef, mu, om = self.prior
        if self._coef_om is None:
            self._coef_om = {n: coef * om[n] for n in g}
        diff, out = self._buffers("prior_diff", g), self._buffers("task_grad", g)
        for n in g:
            torch.sub(theta[n], mu[n], out=diff[n]).mul_(self._coef_om[n])
            torch.sub(g[n], diff[n], out=out[n])
        return out

    def _sgd_step(self, cid: int, g: Params) -> None:
        """θ ← θ − lr · d exactly as the engine's optimiser (after clipping the full gradient)."""
        local = self.setup.local
        theta = self.theta[cid]
        if local.clip_grad_norm is not None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in g.values()]))
            coef = torch.clamp(local.clip_grad_norm / (norm + 1e-6), max=1.0)
            clipped = self._buffers("clipped", g)
            g = {n: torch.mul(t, coef, out=clipped[n]) for n, t in g.items()}
        d = {n: (t + local.weight_decay * theta[n]) if local.weight_decay else t for n, t in g.items()}
        if local.momentum:
            buf = self.buf[cid]
            if buf is None:
                buf = {n: t.clone() for n, t in d.items()}
            else:
                buf = {n: buf[n] * local.momentum + (1 - local.dampening) * d[n] for n in d}
            self.buf[cid] = buf
            d = {n: d[n] + local.momentum * buf[n] for n in d} if local.nesterov else buf
        for n in theta:
            theta[n].add_(d[n], alpha=-local.lr)


# ---- the method ----------------------------------------------------------------------------------------
@ALGORITHMS.register("fola")
class FOLA(Algorithm):
    name = "fola"
    Options = FolaOptions
    resumable = True   # all cross-round memory (μ_S, ω_S) is in the state dict; the online hook lives one round

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.lam, self.prior_grad, self.gamma = o.lambda_prior, o.prior_grad, o.prior_init_precision
        self.round_scaling, self.aggregation, self.eps, self.eps_mode = \
            o.round_scaling, o.aggregation, o.agg_eps, o.agg_eps_mode
        f = o.fisher
        self.fisher_mode, self.fisher_grad, self.fisher_normalize = f.mode, f.grad, f.normalize
        self.fisher_gradient, self.chunk = f.gradient, f.chunk_size
        if self.fisher_gradient == "total" and self.fisher_grad == "per_sample_sq":
            raise FedbenchError("algorithm.fisher.gradient: total squares the engine's minibatch gradient; "
                                "use it with fisher.grad: minibatch_sq (per_sample_sq always uses the task loss)")
        if self.aggregation == "product" and self.eps == 0 and self.gamma == 0:
            raise FedbenchError("algorithm.agg_eps = 0 with prior_init_precision = 0 divides by zero where every "
                                "client's precision is 0; set agg_eps > 0 (the code uses 1e-5)")
        self._worker = copy.deepcopy(setup.model) if setup is not None else None

    # server
    def init_state(self, params):
        return {"params": params, "precision": {n: torch.full_like(t, self.gamma) for n, t in params.items()}}

    def downlink(self, state):
        return {"params": state["params"], "precision": state["precision"]}

    def client_stage_key(self, round_idx):
        """Round-1 clients train plainly when no prior term is live (ω_S = 0 or no live prior). FOLA-offline's
        then share the cached FedAvg clients and cache their offline Fisher beside them. The online Fisher is
        accumulated during training (the hook's output, stored with the trained weights), so FOLA-online's
        round-1 stage has its own key (cached, reused by every λ and rerun); ``plain_training`` stores its weights
        as FedAvg's stage too."""
        if round_idx != 1 or not (self.prior_grad != "live" or self.lam == 0 or self.gamma == 0):
            return None
        if self.fisher_mode == "offline":
            return {}
        return {"online_fisher": {"grad": self.fisher_grad, "normalize": self.fisher_normalize,
                                  "gradient": self.fisher_gradient, "chunk_size": self.chunk}}

    def plain_training(self, round_idx):
        """Round 1 without a live prior: plain SGD; the online hook only reads gradients and replays batches with its
        own generator (tests/test_share_epochs.py checks the weights equal FedAvg's bit for bit)."""
        return self.client_stage_key(round_idx) is not None

    def _prior_active(self, state, round_idx) -> bool:
        return (self.prior_grad == "live" and prior_coefficient(self.lam, round_idx, self.round_scaling) > 0
                and any(bool((t != 0).any()) for t in state["precision"].values()))

    # client
    def local_objective(self, state, client_ids, round_idx):
        coef = prior_coefficient(self.lam, round_idx, self.round_scaling)
        live = self._prior_active(state, round_idx)
        terms, shared = [], {}
        if live:   # detached_as_released: the code's penalty has no gradient, i.e. no term (§1.6)
            terms = [QuadraticPriorTerm(scale=coef)]
            shared = {"prior_mean": state["params"], "prior_precision": state["precision"]}
        hooks = []
        if self.fisher_mode == "online":
            prior = (coef, state["params"], state["precision"]) if live else None
            hooks = [FolaOnlineHook(self.setup, client_ids, state["params"], round_idx, grad=self.fisher_grad,
                                    gradient=self.fisher_gradient, prior=prior, worker=self._worker,
                                    chunk_size=self.chunk, normalize=self.fisher_normalize)]
        return LocalObjective(terms=terms, shared_ctx=shared, step_hooks=hooks)

    def client_products(self, client_id, params, state, round_idx):
        if self.fisher_mode == "online":   # accumulated during training (the hook)
            return []
        return [offline_fisher_product(self.setup, params, client_id, grad=self.fisher_grad,
                                       normalize=self.fisher_normalize, chunk_size=self.chunk)]

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        if self.fisher_mode == "online":   # the hook's output, from this training or the cached stage
            fisher = result.extras["online_fisher"][pos]
        else:
            fisher = products["fisher"]["fisher"]
        omega = client_precision(fisher, state["precision"], round_idx, self.round_scaling, self.fisher_mode)
        omega = {n: omega[n].to(params[n].dtype) for n in params}
        n = len(self.setup.client_indices[client_id])
        return Message(client_id, n, {"params": params, "precision": omega},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def aggregate(self, messages, state, round_idx):
        w = client_weights([m.num_samples for m in messages])   # π_n = m_n / Σ m (§1.3); uniform if all empty
        means = [m.payload["params"] for m in messages]
        precs = [m.payload["precision"] for m in messages]
        if self.aggregation == "product":
            mu, omega = diag_gaussian_product(means, precs, w, eps=self.eps, eps_mode=self.eps_mode)
        else:
            mu, omega = weighted_average(means, w), weighted_average(precs, w)
        return {**state, "params": mu, "precision": omega}
