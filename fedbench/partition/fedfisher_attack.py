"""FedFisher App. E privacy split (Table 6 / Fig. 4): one client holds a whole class plus random others.

Notes: fedfisher.md §4 "Table 6" (App. E). Client 1 (index 0) holds **every** training sample of
``target_label`` (3) plus ``num_others`` (1000) samples drawn uniformly without replacement from the other
classes; the remaining samples (no ``target_label`` left) are split over clients 2..K with the FedFisher
client-wise Dirichlet split (``dirichlet_clientwise``, alpha = 0.1). Not stated by the paper [I]: how the
1000 others are drawn (uniform over the non-target samples here) and the seeds (one stream: the 1000 others
are drawn first from ``RandomState(seed)``, then ``dirichlet_clientwise`` runs with the same seed on the
rest, in index order); client 1's list is shuffled with the first stream.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.partition.base import PARTITIONS, check_number, class_labels, legacy_rng
from fedbench.partition.dirichlet_clientwise import dirichlet_clientwise


@PARTITIONS.register("fedfisher_attack")
def fedfisher_attack(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
                     target_label: int = 3, num_others: int = 1000, alpha: float = 0.1) -> List[np.ndarray]:
    name = "fedfisher_attack"
    check_number(name, "alpha", alpha, positive=True)
    check_number(name, "target_label", target_label, integer=True, min_value=0)
    check_number(name, "num_others", num_others, integer=True, min_value=0)
    y, C = class_labels(name, labels, num_classes)
    if target_label >= C:
        raise FedbenchError(f"partition '{name}': target_label={target_label} is outside the {C} classes")
    if num_clients < 2:
        raise FedbenchError(f"partition '{name}' needs num_clients >= 2 (client 1 + the Dirichlet clients), "
                            f"got {num_clients}")
    target = np.flatnonzero(y == target_label)
    others = np.flatnonzero(y != target_label)
    if num_others > len(others):
        raise FedbenchError(f"partition '{name}': num_others={num_others} exceeds the {len(others)} samples "
                            f"of the other classes")
    rng = legacy_rng(rng_seed)
    picked = np.sort(rng.choice(others, size=int(num_others), replace=False)).astype(np.int64)
    first = np.concatenate([target, picked]).astype(np.int64)
    rng.shuffle(first)
    mask = np.ones(len(y), dtype=bool)
    mask[first] = False
    rest = np.flatnonzero(mask)
    parts = dirichlet_clientwise(y[rest], num_clients - 1, rng_seed, num_classes=C, alpha=alpha)
    return [first] + [rest[p].astype(np.int64) for p in parts]
