"""Optimisers over stacked per-client parameters ([K, *shape]), updating only chosen rows.

They reproduce ``torch.optim.SGD`` / ``torch.optim.Adam`` (L2 weight decay) update for update,
which the serial-vs-batched test checks; rows not being stepped (clients that finished their
epochs) keep parameters and optimiser state untouched.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from fedbench.train.config import LocalTrainConfig


class StackedOptimizer:
    def __init__(self, params: Dict[str, Tensor], cfg: LocalTrainConfig):
        self.params = params
        self.cfg = cfg
        k = next(iter(params.values())).shape[0]
        dev = next(iter(params.values())).device
        self.state: Dict[str, Dict[str, Tensor]] = {}
        self.steps = torch.zeros(k, dtype=torch.float64, device=dev)
        self.momentum_started = torch.zeros(k, dtype=torch.bool, device=dev)

    @torch.no_grad()
    def step(self, grads: Dict[str, Tensor], rows: Optional[Tensor] = None) -> None:
        """grads[name] has shape [len(rows), *shape] (or [K, *shape] when rows is None)."""
        cfg = self.cfg
        if cfg.optimizer == "sgd":
            self._sgd(grads, rows)
        else:
            self._adam(grads, rows)

    def _get(self, t: Tensor, rows):
        return t if rows is None else t[rows]

    def _put(self, t: Tensor, rows, value: Tensor) -> None:
        if rows is None:
            t.copy_(value)
        else:
            t.index_copy_(0, rows, value)

    def _sgd(self, grads, rows):
        cfg = self.cfg
        if cfg.momentum:
            started = self._get(self.momentum_started, rows)
        for name, g in grads.items():
            p_all = self.params[name]
            p = self._get(p_all, rows)
            d = g + cfg.weight_decay * p if cfg.weight_decay else g
            if cfg.momentum:
                st = self.state.setdefault(name, {})
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p_all)
                buf_old = self._get(st["buf"], rows)
                view = (-1,) + (1,) * (d.dim() - 1)
                buf = torch.where(started.view(view), buf_old * cfg.momentum + (1 - cfg.dampening) * d, d)
                self._put(st["buf"], rows, buf)
                d = d + cfg.momentum * buf if cfg.nesterov else buf
            self._put(p_all, rows, p - cfg.lr * d)
        if cfg.momentum:
            self._put(self.momentum_started, rows, torch.ones_like(started))

    def _adam(self, grads, rows):
        cfg = self.cfg
        b1, b2 = cfg.betas
        t = self._get(self.steps, rows) + 1
        self._put(self.steps, rows, t)
        bc1 = (1 - b1 ** t)
        bc2_sqrt = (1 - b2 ** t).sqrt()
        for name, g in grads.items():
            p_all = self.params[name]
            p = self._get(p_all, rows)
            if cfg.weight_decay:
                g = g + cfg.weight_decay * p
            st = self.state.setdefault(name, {})
            if "m" not in st:
                st["m"] = torch.zeros_like(p_all)
                st["v"] = torch.zeros_like(p_all)
            m = self._get(st["m"], rows).lerp(g, 1 - b1)
            v = self._get(st["v"], rows) * b2 + (1 - b2) * g * g
            self._put(st["m"], rows, m)
            self._put(st["v"], rows, v)
            view = (-1,) + (1,) * (g.dim() - 1)
            step_size = (cfg.lr / bc1).to(p.dtype).view(view)
            denom = v.sqrt() / bc2_sqrt.to(p.dtype).view(view) + cfg.eps
            self._put(p_all, rows, p - step_size * m / denom)


def clip_stacked_(grads: Dict[str, Tensor], max_norm: float) -> None:
    """Per-client gradient-norm clipping, as torch.nn.utils.clip_grad_norm_ does for one model."""
    k = next(iter(grads.values())).shape[0]
    sq = sum(g.reshape(k, -1).pow(2).sum(1) for g in grads.values())
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)))
