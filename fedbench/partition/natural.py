"""Natural split: one client per group id (e.g. FLamby-Heart's 4 hospitals, fedlap.md §3.1).

Clients are the sorted distinct group ids; client i holds the samples of the i-th id in ascending
index order. No randomness.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.partition.base import PARTITIONS


@PARTITIONS.register("natural")
def natural(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
            groups: Optional[np.ndarray] = None) -> List[np.ndarray]:
    if groups is None:
        raise FedbenchError("partition 'natural' needs per-sample group ids, and this dataset has none; "
                            "pick another partition")
    groups = np.asarray(groups)
    if groups.shape != (len(labels),):
        raise FedbenchError(f"partition 'natural': groups has shape {groups.shape}, expected ({len(labels)},)")
    ids = np.unique(groups)
    if len(ids) != num_clients:
        raise FedbenchError(f"partition 'natural': the data has {len(ids)} natural clients, so set "
                            f"num_clients={len(ids)} (got {num_clients})")
    return [np.flatnonzero(groups == g).astype(np.int64) for g in ids]
