"""Server-side data: the validation set (FedFisher / FedBEns checkpoint selection, RegMean's alpha, DENSE's best
epoch) and an unlabelled set (FedBE's and FedOV's distillation data).

Both papers' code draw it as ``np.random.seed(3); np.random.choice(len(train), 500)``: with replacement,
from the whole training set, not removed from the clients' data, identical for every seed
(fedfisher.md §1.6, fedbens.md §1.9). ``mode`` switches between that and a clean hold-out:

* ``sampled_with_replacement_from_train`` (the released code): overlaps the clients' data.
* ``holdout``: drawn without replacement and removed from the training set before partitioning.
* size 0: no server data (methods that need it refuse to run, before training).

The unlabelled set (``server_unlabeled``) is drawn after the validation set, from what the validation set left:

* ``holdout`` (FedBE's protocol, Chen & Chao 2021: part of the training set is kept back as the server's
  unlabelled data): removed from the training set before partitioning, so the clients' data change;
* ``sampled_from_train``: drawn without replacement from the training set and left in the clients' data (the same
  convention as the released FedFisher code's validation draw); the client stage is then the plain one, shared with
  every other method. Only inputs are given to methods, never labels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from fedbench.errors import FedbenchError

MODES = ("sampled_with_replacement_from_train", "holdout")
UNLABELED_MODES = ("holdout", "sampled_from_train")


@dataclass(frozen=True)
class ServerValConfig:
    size: int = 0
    mode: str = "sampled_with_replacement_from_train"
    seed: Optional[int] = 3     # None = the run seed

    @classmethod
    def from_cfg(cls, cfg: Optional[Mapping[str, Any]]) -> "ServerValConfig":
        cfg = dict(cfg or {})
        unknown = set(cfg) - {"size", "mode", "seed"}
        if unknown:
            raise FedbenchError(f"server_val: unknown key(s) {sorted(unknown)}; expected size, mode, seed")
        out = cls(**cfg)
        if not isinstance(out.size, int) or isinstance(out.size, bool) or out.size < 0:
            raise FedbenchError(f"server_val.size must be an integer >= 0, got {out.size!r}")
        if out.mode not in MODES:
            raise FedbenchError(f"server_val.mode must be one of {', '.join(MODES)}, got {out.mode!r}")
        if out.seed is not None and (not isinstance(out.seed, int) or isinstance(out.seed, bool)):
            raise FedbenchError(f"server_val.seed must be an integer or null, got {out.seed!r}")
        return out


def draw_server_val(cfg: ServerValConfig, n_train: int, run_seed: int):
    """(validation indices into the training set, indices left for the clients or None = all of them)."""
    if cfg.size == 0:
        return None, None
    if cfg.mode == "holdout" and cfg.size >= n_train:
        raise FedbenchError(f"server_val.size={cfg.size} leaves no training data (training set has {n_train})")
    rng = np.random.RandomState(run_seed if cfg.seed is None else cfg.seed)
    if cfg.mode == "sampled_with_replacement_from_train":
        return rng.choice(n_train, cfg.size), None
    perm = rng.permutation(n_train)
    return np.sort(perm[:cfg.size]), np.sort(perm[cfg.size:])


@dataclass(frozen=True)
class ServerUnlabeledConfig:
    size: int = 0
    mode: str = "holdout"
    seed: Optional[int] = None   # None = the run seed

    @classmethod
    def from_cfg(cls, cfg: Optional[Mapping[str, Any]]) -> "ServerUnlabeledConfig":
        cfg = dict(cfg or {})
        unknown = set(cfg) - {"size", "mode", "seed"}
        if unknown:
            raise FedbenchError(f"server_unlabeled: unknown key(s) {sorted(unknown)}; expected size, mode, seed")
        out = cls(**cfg)
        if not isinstance(out.size, int) or isinstance(out.size, bool) or out.size < 0:
            raise FedbenchError(f"server_unlabeled.size must be an integer >= 0, got {out.size!r}")
        if out.mode not in UNLABELED_MODES:
            raise FedbenchError(f"server_unlabeled.mode must be one of {', '.join(UNLABELED_MODES)}, got {out.mode!r}")
        if out.seed is not None and (not isinstance(out.seed, int) or isinstance(out.seed, bool)):
            raise FedbenchError(f"server_unlabeled.seed must be an integer or null, got {out.seed!r}")
        return out


def draw_server_unlabeled(cfg: ServerUnlabeledConfig, n_train: int, keep, run_seed: int):
    """(unlabelled indices into the training set or None, indices left for the clients or None = all).

    ``keep``: what the validation draw left for the clients (None = the whole training set)."""
    if cfg.size == 0:
        return None, keep
    pool = np.arange(n_train) if keep is None else np.asarray(keep)
    if cfg.size >= len(pool) and cfg.mode == "holdout":
        raise FedbenchError(f"server_unlabeled.size={cfg.size} leaves no training data ({len(pool)} samples left)")
    if cfg.size > len(pool):
        raise FedbenchError(f"server_unlabeled.size={cfg.size} exceeds the {len(pool)} training samples")
    rng = np.random.RandomState(run_seed if cfg.seed is None else cfg.seed)
    perm = rng.permutation(len(pool))
    unl = np.sort(pool[perm[:cfg.size]])
    if cfg.mode == "sampled_from_train":
        return unl, keep
    return unl, np.sort(pool[perm[cfg.size:]])
