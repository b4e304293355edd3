"""FOLA's online diagonal empirical Fisher, accumulated during local training (notes/fola.md §1.5–1.8).

Two ways to form a step's increment x_t (``mode``):

* ``"minibatch_sq"`` (released code, ``cnn_ours.py``): x_t = g_b², the square of the gradient of the
  minibatch-*mean* task loss (no prior term);
* ``"per_sample_sq"`` (paper, Eqs. 21–22): x_t = (1/|b|) Σ_{i∈b} g_i², the batch mean of per-sample
  squared gradients (computed batched from (model, x, y) with the curvature engine).

Two accumulators are kept, so both normalisations are available at the end (``fisher(normalize)``):

* ``"none"`` (code): Σ_t (|b_t|/N) · x_t. One epoch adds ≈ one dataset average, so the scale grows
  with the number of local epochs E (the released code's behaviour);
* ``"steps"`` (paper, Eq. 22 as the notes' corrected Algorithm 1 reads it): (1/T) Σ_t x_t, the mean
  over the T local steps.

Usage by a training loop (serial): after ``loss.backward()`` on the task loss and before the
optimiser step, ``acc.update(grads={n: p.grad for ...}, batch_size=len(batch))`` (minibatch mode) or
``acc.update(x=xb, y=yb)`` (per-sample mode; the model passed at construction is evaluated at its
current weights). :class:`OnlineDiagFisherHook` adapts this to the training engine's
``step_hooks`` protocol (``after_backward(client_ids, grads, batch_sizes)`` with stacked gradients).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from fedbench.curvature.layout import ParamLayout
from fedbench.curvature.structures import DiagCurvature
from fedbench.errors import FedbenchError
from fedbench.curvature.compute import compute_curvature, diag_from_forward

ONLINE_MODES = ("minibatch_sq", "per_sample_sq")
NORMALIZE = ("none", "steps")


class OnlineDiagFisher:
    """Online diagonal empirical Fisher of one client.

    Args:
        params: the model (its trainable parameters are tracked; required for ``per_sample_sq``)
            or a dict name -> tensor giving names, shapes, dtype and device.
        num_data: N, the client's number of training samples (the |b|/N weights).
        mode: "minibatch_sq" | "per_sample_sq".
        loss: likelihood for per-sample gradients ("auto" | "ce" | "bce" | "mse").
        batch_size: chunk size of the per-sample computation.
    """

    def __init__(self, params, num_data: int, mode: str = "minibatch_sq", *, loss: str = "auto",
                 batch_size: int = 256):
        if mode not in ONLINE_MODES:
            raise FedbenchError(f"unknown online Fisher mode '{mode}'; choose one of: {', '.join(ONLINE_MODES)}")
        if not isinstance(num_data, int) or num_data < 1:
            raise FedbenchError(f"online Fisher needs num_data >= 1, got {num_data!r}")
        self.model: Optional[nn.Module] = params if isinstance(params, nn.Module) else None
        if self.model is not None:
            self.layout = ParamLayout.from_module(self.model)
            ref = {n: p for n, p in self.model.named_parameters() if n in self.layout}
        else:
            ref = dict(params)
            self.layout = ParamLayout(list(ref), [t.shape for t in ref.values()])
        if mode == "per_sample_sq" and self.model is None:
            raise FedbenchError("online Fisher mode 'per_sample_sq' needs the model, not a parameter dict")
        self.mode = mode
        self.num_data = num_data
        self.loss = loss
        self.batch_size = batch_size
        self._ref = {n: (t.shape, t.dtype, t.device) for n, t in ref.items()}
        self.reset()

    def reset(self) -> None:
        self.weighted = {n: torch.zeros(s, dtype=dt, device=dv) for n, (s, dt, dv) in self._ref.items()}
        self.unweighted = {n: torch.zeros(s, dtype=dt, device=dv) for n, (s, dt, dv) in self._ref.items()}
        self.steps = 0
        self.weight_sum = 0.0
        self._sq: Optional[Dict[str, Tensor]] = None   # minibatch_sq's squared-gradient buffers

    def _add(self, sq: Mapping[str, Tensor], batch_size: int) -> None:
        w = float(batch_size) / self.num_data
        for n in self.weighted:
            s = sq[n].detach()
            self.weighted[n].add_(s, alpha=w)
            self.unweighted[n].add_(s)
        self.steps += 1
        self.weight_sum += w

    @torch.no_grad()
    def update(self, grads: Optional[Mapping[str, Tensor]] = None, *, batch_size: Optional[int] = None,
               x: Optional[Tensor] = None, y: Optional[Tensor] = None, tap=None) -> None:
        """One optimiser step.

        minibatch_sq: ``grads`` = gradient of the minibatch-mean task loss per parameter name
            (``None``: read ``p.grad`` of the model), ``batch_size`` = |b| (or taken from ``x``).
        per_sample_sq: ``x``, ``y`` = the minibatch; per-sample gradients of the task NLL at the
            model's current weights (``grads`` is ignored). Or ``tap`` (``compute.tap_forward`` on the training
            loop's model) and ``y``: the same squares read off the loop's own forward pass on the minibatch
            (``compute.diag_from_forward``, same bits, no second pass).
        """
        if self.mode == "minibatch_sq":
            if batch_size is None:
                if x is None:
                    raise FedbenchError("online Fisher (minibatch_sq) needs batch_size (or x) for the |b|/N weight")
                batch_size = int(x.shape[0])
            if grads is None:
                if self.model is None:
                    raise FedbenchError("online Fisher: pass grads, or construct it with the model")
                named = dict(self.model.named_parameters())
                grads = {n: named[n].grad for n in self.weighted}
                if any(g is None for g in grads.values()):
                    raise FedbenchError("online Fisher: some parameters have no .grad; call it after backward()")
            if self._sq is None:   # reused every step: a fresh 2 MB tensor per layer and step costs page faults
                self._sq = {n: torch.empty_like(grads[n]) for n in self.weighted}
            self._add({n: torch.mul(grads[n], grads[n], out=self._sq[n]) for n in self.weighted}, batch_size)
            return
        if tap is not None and y is not None:
            c = diag_from_forward(tap, y, fisher="empirical", scale="mean", loss=self.loss)
            self._add(c.diag, int(y.shape[0]))
            return
        if x is None or y is None:
            raise FedbenchError("online Fisher mode 'per_sample_sq' needs the minibatch (x, y)")

        c = compute_curvature(self.model, x, y, structure="diag", fisher="empirical", scale="mean",
                              loss=self.loss, batch_size=self.batch_size)
        self._add(c.diag, int(x.shape[0]))

    def fisher(self, normalize: str = "none") -> Dict[str, Tensor]:
        """The accumulated diagonal: "none" = Σ_t (|b_t|/N) x_t (code), "steps" = (1/T) Σ_t x_t (paper)."""
        if normalize not in NORMALIZE:
            raise FedbenchError(f"unknown online Fisher normalisation '{normalize}'; choose one of: "
                                f"{', '.join(NORMALIZE)}")
        if normalize == "none":
            return {n: t.clone() for n, t in self.weighted.items()}
        T = max(self.steps, 1)
        return {n: t / T for n, t in self.unweighted.items()}

    def curvature(self, normalize: str = "none") -> DiagCurvature:
        return DiagCurvature(self.layout, self.fisher(normalize), fisher="empirical", scale="mean",
                             num_data=self.num_data, loss=self.loss,
                             meta={"online": self.mode, "normalize": normalize, "steps": self.steps})


class OnlineDiagFisherHook:
    """``step_hooks`` adapter for ``fedbench.train.engine``: one :class:`OnlineDiagFisher`
    (mode "minibatch_sq") per client id, fed with the engine's stacked gradients.

    ``after_backward(client_ids, grads, batch_sizes)``: ``grads[name]`` is [k, *shape] for the k
    active clients, ``batch_sizes`` their |b|. Note the engine's gradients include any extra loss
    terms; FOLA's Fisher uses the task-loss gradient only (Algorithm 1), which holds when the
    prior term is zero (round 1, λ = 0) or when the engine passes the task gradient.
    """

    def __init__(self, params: Mapping[str, Tensor], num_data: Mapping[int, int]):
        self.accs = {int(cid): OnlineDiagFisher(params, int(n), "minibatch_sq") for cid, n in num_data.items()}

    def after_backward(self, client_ids: Sequence[int], grads: Mapping[str, Tensor], batch_sizes) -> None:
        sizes = [int(b) for b in (batch_sizes.tolist() if torch.is_tensor(batch_sizes) else batch_sizes)]
        for j, cid in enumerate(client_ids):
            self.accs[int(cid)].update({n: g[j] for n, g in grads.items()}, batch_size=sizes[j])

    def __getitem__(self, cid: int) -> OnlineDiagFisher:
        return self.accs[int(cid)]
