"""FOLA / FedMA per-class Dirichlet with contiguous slices (FOLA's ``dirichlet_data.py``).

Notes: fola.md §1.8 item 6 and §3.3, reference-code.md §2. One call draws the (C x K) matrix
p_c ~ Dir(alpha 1_K) per class (``dirichlet([alpha]*K, C)``). Client n, in client order, takes
``int(n_c * p_{c,n})`` consecutive samples of every class c from where the previous client stopped,
so up to K-1 samples per class stay unassigned; no resampling, no minimum size, no shuffling.

``empty_client`` (a fidelity switch):
  * ``first_of_class0`` (as released): a client that received nothing gets the first sample of
    class 0, which another client usually holds too (one duplicated sample). At FOLA's alpha=0.01
    with 20 clients most clients are empty, so this is needed to run those settings at all.
  * ``error``: refuse the draw with a one-line error.

Within a class the samples are taken in ascending index order. The released code sorts with
numpy's default (unstable) argsort, whose order of ties depends on the numpy build and CPU, so the
exact sample identity of the original is not reproducible; the per-client class counts are.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.partition.base import PARTITIONS, check_choice, check_number, class_labels, concat, legacy_rng


@PARTITIONS.register("dirichlet_per_class_contiguous")
def dirichlet_per_class_contiguous(labels: np.ndarray, num_clients: int, rng_seed: int, *,
                                   num_classes: Optional[int] = None, alpha: float = 0.5,
                                   empty_client: str = "first_of_class0") -> List[np.ndarray]:
    name = "dirichlet_per_class_contiguous"
    check_number(name, "alpha", alpha, positive=True)
    check_choice(name, "empty_client", empty_client, ("first_of_class0", "error"))
    y, C = class_labels(name, labels, num_classes)
    by_class = [np.flatnonzero(y == c) for c in range(C)]
    sample = legacy_rng(rng_seed).dirichlet([float(alpha)] * num_clients, C).T    # (K, C)
    if not np.isfinite(sample).all():
        # numpy's legacy Dirichlet returns NaN when every gamma draw of a class underflows to 0 (alpha ~1e-3)
        raise FedbenchError(f"partition '{name}': alpha={alpha} is too small for numpy's Dirichlet draw (it returned "
                            f"NaN shares for seed {rng_seed}); use alpha >= 0.01")
    start = [0] * C
    parts = []
    for i in range(num_clients):
        pieces = []
        for c in range(C):
            n_c = len(by_class[c])
            end = start[c] + int(n_c * sample[i, c])
            pieces.append(by_class[c][start[c]:min(end, n_c)])
            start[c] = end
        arr = concat(pieces)
        if arr.size == 0:
            if empty_client == "error":
                raise FedbenchError(f"partition '{name}': client {i} received no samples at alpha={alpha}; "
                                    f"increase alpha, use fewer clients, or set empty_client=first_of_class0")
            if len(by_class[0]) == 0:
                raise FedbenchError(f"partition '{name}': client {i} is empty and class 0 has no sample to give it; "
                                    f"increase alpha or use fewer clients")
            arr = by_class[0][:1].astype(np.int64)
        parts.append(arr)
    return parts
