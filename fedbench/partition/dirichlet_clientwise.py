"""FedFisher / FedBEns "client-wise" Dirichlet split (``__getDirichletData__``).

Notes: fedfisher.md §3.2, fedbens.md §3.2. Not the per-class Hsu/NIID-Bench split:
each client i first draws a class distribution q_i ~ Dir(alpha 1_C) (one draw per client, in client
order); then for each class c the shuffled class indices are split among the clients in proportions
q_{:,c} / sum_i q_{i,c}, cut at ``int(cumsum * n_c)``; finally every client's list is shuffled.
Every sample is assigned; no minimum size. The released code sets ``np.random.seed(3)`` before the
split whatever the run seed: fedbench's ``fixed_seed`` switch (FedFisher/FedBEns presets set 3).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fedbench.partition.base import (PARTITIONS, check_number, class_labels, concat, cumsum_cuts, legacy_rng,
                                     normalise)


@PARTITIONS.register("dirichlet_clientwise")
def dirichlet_clientwise(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
                         alpha: float = 0.1) -> List[np.ndarray]:
    name = "dirichlet_clientwise"
    check_number(name, "alpha", alpha, positive=True)
    y, C = class_labels(name, labels, num_classes)
    rng = legacy_rng(rng_seed)
    conc = np.repeat(float(alpha), C)
    q = np.zeros((num_clients, C))
    for i in range(num_clients):               # one draw per client, as released (not one call of size K)
        q[i] = rng.dirichlet(conc)
    pieces: List[List[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(C):
        idx_c = np.flatnonzero(y == c)
        rng.shuffle(idx_c)
        p = normalise(q[:, c])
        for j, piece in enumerate(np.split(idx_c, cumsum_cuts(p, len(idx_c)))):
            pieces[j].append(piece)
    parts = []
    for j in range(num_clients):
        arr = concat(pieces[j])
        rng.shuffle(arr)
        parts.append(arr)
    return parts
