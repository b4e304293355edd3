"""Local-training settings, validated once before any training starts."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from fedbench.errors import FedbenchError

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class LocalTrainConfig:
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    batch_size: int = 64
    epochs: int = 1
    clip_grad_norm: Optional[float] = None
    drop_last: bool = False  # NIID-Bench / FedFisher keep the last partial batch

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any]) -> "LocalTrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(cfg) - known
        if unknown:
            raise FedbenchError(
                f"unknown local-training key(s) {sorted(unknown)}; known: {sorted(known)}")
        kw = dict(cfg)
        if "betas" in kw and kw["betas"] is not None:
            kw["betas"] = tuple(float(b) for b in kw["betas"])
        out = cls(**kw)
        out.validate()
        return out

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise FedbenchError(f"local.optimizer must be one of {OPTIMIZERS}, got '{self.optimizer}'")
        if not self.lr > 0:
            raise FedbenchError(f"local.lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise FedbenchError(f"local.batch_size must be >= 1, got {self.batch_size}")
        if self.epochs < 0:
            raise FedbenchError(f"local.epochs must be >= 0, got {self.epochs}")
        if not 0 <= self.momentum < 1:
            raise FedbenchError(f"local.momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise FedbenchError(f"local.weight_decay must be >= 0, got {self.weight_decay}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise FedbenchError("local.nesterov needs momentum > 0 and dampening = 0")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise FedbenchError(f"local.clip_grad_norm must be > 0 or null, got {self.clip_grad_norm}")
