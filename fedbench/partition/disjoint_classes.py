"""Disjoint class groups: the C classes are cut into ``num_clients`` contiguous groups.

FOLA §IV-E (fola.md §3.3): 2 clients with 5 disjoint classes each ("equivalent to alpha = 0"),
{0-4} / {5-9}. Each client gets every sample of its classes (ascending index order). No randomness.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.partition.base import PARTITIONS, class_labels


@PARTITIONS.register("disjoint_classes")
def disjoint_classes(labels: np.ndarray, num_clients: int, rng_seed: int, *,
                     num_classes: Optional[int] = None) -> List[np.ndarray]:
    name = "disjoint_classes"
    y, C = class_labels(name, labels, num_classes)
    if num_clients > C:
        raise FedbenchError(f"partition '{name}': {num_clients} clients cannot hold disjoint groups of the {C} "
                            f"classes; use at most {C} clients")
    return [np.flatnonzero(np.isin(y, g)).astype(np.int64) for g in np.array_split(np.arange(C), num_clients)]
