"""NIID-Bench partitions (Li et al., ICDE 2022; ``utils.partition_data``), used by FedLPA and DENSE.

Notes: fedlpa.md §3 "Partitions", reference-code.md §6. The RNG calls are made in NIID-Bench's
order on private generators seeded like its ``np.random.seed(s); random.seed(s)``, so the same seed
gives the same split (FedLPA App. G.2 per-client counts are reproduced exactly, see the tests).
"""
from __future__ import annotations

import random
from typing import List, Optional

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.partition.base import (DEFAULT_MAX_RETRIES, PARTITIONS, check_choice, check_number, class_labels,
                                     concat, cumsum_cuts, legacy_rng, normalise)


@PARTITIONS.register("noniid-labeldir")
def noniid_labeldir(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
                    beta: float = 0.5, min_require_size: int = 10,
                    max_retries: int = DEFAULT_MAX_RETRIES) -> List[np.ndarray]:
    """Label skew, p_c ~ Dir(beta 1_K) per class, with NIID-Bench's "balance" trick and min-size redraw.

    Per attempt, for every class c (all C classes, present or not): shuffle the class indices,
    draw the Dirichlet, zero the share of clients that already hold >= N/K samples, renormalise,
    cut at ``int(cumsum(p) * n_c)``. The whole split is redrawn (same stream, continuing) until every
    client holds >= ``min_require_size`` samples, at most ``max_retries`` times. Finally each client's
    list is shuffled, client by client.
    """
    name = "noniid-labeldir"
    check_number(name, "beta", beta, positive=True)
    check_number(name, "min_require_size", min_require_size, integer=True, min_value=0)
    check_number(name, "max_retries", max_retries, integer=True, min_value=1)
    y, C = class_labels(name, labels, num_classes)
    N, K = len(y), num_clients
    if min_require_size * K > N:
        raise FedbenchError(f"partition '{name}': {K} clients x min_require_size={min_require_size} exceeds the "
                            f"{N} samples; lower min_require_size or use fewer clients")
    rng = legacy_rng(rng_seed)
    by_class = [np.flatnonzero(y == c) for c in range(C)]
    conc = np.repeat(float(beta), K)
    cap = N / K
    for _ in range(max_retries):
        pieces: List[List[np.ndarray]] = [[] for _ in range(K)]
        sizes = np.zeros(K, dtype=np.int64)
        for c in range(C):
            idx_c = by_class[c].copy()          # NIID-Bench re-runs np.where every attempt: fresh order
            rng.shuffle(idx_c)
            p = rng.dirichlet(conc)
            p = p * (sizes < cap)               # "balance": stop feeding clients that hold >= N/K
            p = normalise(p)
            for j, piece in enumerate(np.split(idx_c, cumsum_cuts(p, len(idx_c)))):
                pieces[j].append(piece)
                sizes[j] += len(piece)
        if sizes.min() >= min_require_size:
            break
    else:
        raise FedbenchError(f"partition '{name}': no draw gave every client >= {min_require_size} samples in "
                            f"{max_retries} tries; increase beta, lower min_require_size, use fewer clients, "
                            f"or raise max_retries")
    parts = []
    for j in range(K):
        arr = concat(pieces[j])
        rng.shuffle(arr)                        # same permutation as shuffling NIID-Bench's Python list
        parts.append(arr)
    return parts


@PARTITIONS.register("noniid-#label")
def noniid_label_k(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
                   k: int = 2) -> List[np.ndarray]:
    """"#C=k": client i holds class ``i % C`` plus k-1 further distinct classes; classes split equally.

    The extra classes come from Python's ``random.randint(0, C-1)`` by rejection, client by client
    (NIID-Bench; its issue #7 added the ``random.seed``). Then, for each class in order, the class
    indices are shuffled with numpy and ``array_split`` into equal parts, handed to its holders in
    client order. No final shuffle (NIID-Bench has none here). NIID-Bench's separate k == 10 branch
    (no Python draws, every class split over all clients) gives the identical split, so it needs no
    special case. A class nobody holds (possible only when num_clients < C) stays unassigned; its
    shuffle is still drawn so later classes see the same stream.
    """
    name = "noniid-#label"
    check_number(name, "k", k, integer=True)
    y, C = class_labels(name, labels, num_classes)
    if k < 1 or k > C:
        raise FedbenchError(f"partition '{name}': k={k} classes per client must be between 1 and the {C} classes")
    py = random.Random(rng_seed)
    rng = legacy_rng(rng_seed)
    times = [0] * C
    holds: List[List[int]] = []
    for i in range(num_clients):
        current = [i % C]
        times[i % C] += 1
        while len(current) < k:
            c = py.randint(0, C - 1)
            if c not in current:
                current.append(c)
                times[c] += 1
        holds.append(current)
    pieces: List[List[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(C):
        idx_c = np.flatnonzero(y == c)
        rng.shuffle(idx_c)
        if times[c] == 0:
            continue
        split = np.array_split(idx_c, times[c])
        t = 0
        for j in range(num_clients):
            if c in holds[j]:
                pieces[j].append(split[t])
                t += 1
    return [concat(p) for p in pieces]


@PARTITIONS.register("homo")
def homo(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
         split: str = "contiguous") -> List[np.ndarray]:
    """IID equal split of a random permutation.

    ``split: contiguous`` = NIID-Bench ``homo`` (``array_split`` of the permutation);
    ``split: strided`` = PVI ``homogenous`` (client i takes ``perm[i::K]``), FedLap's UCI homogeneous
    split (fedlap.md §3.1). Both use one ``permutation`` draw.
    """
    check_choice("homo", "split", split, ("contiguous", "strided"))
    perm = legacy_rng(rng_seed).permutation(len(labels)).astype(np.int64)
    if split == "strided":
        return [perm[i::num_clients].copy() for i in range(num_clients)]
    return [p.copy() for p in np.array_split(perm, num_clients)]


@PARTITIONS.register("iid-diff-quantity")
def iid_diff_quantity(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
                      beta: float = 0.5, min_require_size: int = 10,
                      max_retries: int = DEFAULT_MAX_RETRIES) -> List[np.ndarray]:
    """Quantity skew: sizes ~ Dir(beta), redrawn until min(p * N) >= min_require_size; IID content.

    NIID-Bench order: one permutation, then Dirichlet draws until the size check passes, then cuts at
    ``int(cumsum(p) * N)``. (NIID-Bench checks the real-valued ``p * N``, so a client can end with
    ``min_require_size - 1`` after truncation; kept as released.)
    """
    name = "iid-diff-quantity"
    check_number(name, "beta", beta, positive=True)
    check_number(name, "min_require_size", min_require_size, integer=True, min_value=0)
    check_number(name, "max_retries", max_retries, integer=True, min_value=1)
    N = len(labels)
    if min_require_size * num_clients > N:
        raise FedbenchError(f"partition '{name}': {num_clients} clients x min_require_size={min_require_size} "
                            f"exceeds the {N} samples; lower min_require_size or use fewer clients")
    rng = legacy_rng(rng_seed)
    perm = rng.permutation(N).astype(np.int64)
    conc = np.repeat(float(beta), num_clients)
    for _ in range(max_retries):
        p = rng.dirichlet(conc)
        p = normalise(p)
        if not np.min(p * N) < min_require_size:   # as NIID-Bench's while-test (a NaN draw also exits)
            break
    else:
        raise FedbenchError(f"partition '{name}': no size draw gave every client >= {min_require_size} samples in "
                            f"{max_retries} tries; increase beta, lower min_require_size, use fewer clients, "
                            f"or raise max_retries")
    return [s.copy() for s in np.split(perm, cumsum_cuts(p, N))]
