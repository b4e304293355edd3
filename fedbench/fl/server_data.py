"""The server's validation set (FedFisher / FedBEns checkpoint selection, RegMean's alpha, DENSE's best epoch).

Both papers' code draw it as ``np.random.seed(3); np.random.choice(len(train), 500)``: with replacement,
from the whole training set, not removed from the clients' data, identical for every seed
(fedfisher.md §1.6, fedbens.md §1.9). ``mode`` switches between that and a clean hold-out:

* ``sampled_with_replacement_from_train`` (the released code): overlaps the clients' data.
* ``holdout``: drawn without replacement and removed from the training set before partitioning.
* size 0: no server data (methods that need it refuse to run, before training).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from fedbench.errors import FedbenchError

MODES = ("sampled_with_replacement_from_train", "holdout")


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
