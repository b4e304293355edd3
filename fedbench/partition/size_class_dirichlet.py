"""FedLap's two-level Dirichlet (App. E.1): client sizes ~ Dir(alpha1), class mix ~ Dir(alpha2).

Notes: fedlap.md §3.1, reference-code.md §5 (``bayes-admm/data_generators.py``, same authors).
Draw order (as in that code): s ~ Dir(alpha1 1_K) in one call; pi ~ Dir(alpha2 1_C) for the K
clients in one call of size K. Mass m_{k,c} = s_k pi_{k,c}; for each class c the shuffled class
indices go to the clients in proportions m_{:,c} / sum_k m_{k,c}.

``rounding`` (a fidelity switch; the paper does not say how counts are rounded):
  * ``cumulative`` (default, the paper's "all points are assigned"): cuts at ``int(cumsum * n_c)``.
  * ``round_min2_as_released``: count ``round(n_c f_{k,c})``, bumped from 1 to 2, taken as
    consecutive slices (the bayes-admm code); a few points may stay unassigned or the last client
    of a class may get fewer than its count.
Client lists are class-major and not shuffled (as released); the training loader shuffles.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fedbench.partition.base import (PARTITIONS, check_choice, check_number, class_labels, concat, cumsum_cuts,
                                     legacy_rng, normalise)


@PARTITIONS.register("size_class_dirichlet")
def size_class_dirichlet(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
                         alpha1: float = 1.0, alpha2: float = 0.5,
                         rounding: str = "cumulative") -> List[np.ndarray]:
    name = "size_class_dirichlet"
    check_number(name, "alpha1", alpha1, positive=True)
    check_number(name, "alpha2", alpha2, positive=True)
    check_choice(name, "rounding", rounding, ("cumulative", "round_min2_as_released"))
    y, C = class_labels(name, labels, num_classes)
    rng = legacy_rng(rng_seed)
    sizes = rng.dirichlet([float(alpha1)] * num_clients)                   # (K,)
    mix = rng.dirichlet([float(alpha2)] * C, num_clients)                    # (K, C)
    mass = sizes[:, None] * mix
    pieces: List[List[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(C):
        idx_c = np.flatnonzero(y == c)
        rng.shuffle(idx_c)
        f = normalise(mass[:, c])
        if rounding == "cumulative":
            for j, piece in enumerate(np.split(idx_c, cumsum_cuts(f, len(idx_c)))):
                pieces[j].append(piece)
        else:
            done = 0
            for j in range(num_clients):
                count = int(np.round(len(idx_c) * f[j])) if np.isfinite(f[j]) else 0
                if count == 1:
                    count = 2
                pieces[j].append(idx_c[done:done + count])
                done += count
    return [concat(p) for p in pieces]
