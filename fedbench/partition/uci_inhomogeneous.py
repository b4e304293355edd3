"""PVI's ``inhomogenous1`` split (Ashman et al. 2022), FedLap's heterogeneous UCI Credit split.

Notes: fedlap.md §3.1. Half of the K clients are small with few positives, half are big:
  small size = floor((1 - csf) N / K), big size = floor((1 + csf) N / K);
  class_balance = fraction of label 0 ("negative"); a small client takes
  floor(small * (balance + (1 - balance) * cbf)) negatives and the rest of its size in positives,
  both as consecutive runs of the positive / negative index lists (data order), then permuted;
  the remaining points are pooled (positives first), permuted once, and dealt in consecutive blocks
  of the big size. A few points stay unassigned.
With N = 520 and 45% positives, csf = 0.3 and cbf = 0.9 give 5 x 36 (34 negatives + 2 positives,
6% positive) and 5 x 67 (66% positive on average), as in the paper.
Labels > 0 count as positive. RNG calls (as PVI, on the legacy stream): one permutation per small
client, then one for the pooled rest.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.partition.base import PARTITIONS, check_number, class_labels, concat, legacy_rng


@PARTITIONS.register("uci_inhomogeneous")
def uci_inhomogeneous(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
                      client_size_factor: float = 0.3, class_balance_factor: float = 0.9) -> List[np.ndarray]:
    name = "uci_inhomogeneous"
    check_number(name, "client_size_factor", client_size_factor)
    check_number(name, "class_balance_factor", class_balance_factor)
    if not 0 <= client_size_factor < 1:
        raise FedbenchError(f"partition '{name}': client_size_factor must be in [0, 1), got {client_size_factor}")
    if not 0 <= class_balance_factor <= 1:
        raise FedbenchError(f"partition '{name}': class_balance_factor must be in [0, 1], got {class_balance_factor}")
    y, _ = class_labels(name, labels, num_classes)
    n, m = len(y), num_clients
    if m == 1:
        return [np.arange(n, dtype=np.int64)]
    if m % 2:
        raise FedbenchError(f"partition '{name}' needs an even number of clients (half small, half big), got {m}")
    small = int(np.floor((1 - client_size_factor) * n / m))
    big = int(np.floor((1 + client_size_factor) * n / m))
    balance = float(np.mean(y == 0))
    small_neg = int(np.floor(small * (balance + (1 - balance) * class_balance_factor)))
    small_pos = small - small_neg
    pos, neg = np.flatnonzero(y > 0), np.flatnonzero(y == 0)
    for kind, need, have in (("negative", small_neg, len(neg)), ("positive", small_pos, len(pos))):
        if need * (m // 2) > have:
            raise FedbenchError(f"partition '{name}': not enough {kind} samples ({have}) to give each of the "
                                f"{m // 2} small clients {need}; change class_balance_factor or client_size_factor")
    rng = legacy_rng(rng_seed)
    parts = []
    for i in range(m // 2):
        client = concat([pos[i * small_pos:(i + 1) * small_pos], neg[i * small_neg:(i + 1) * small_neg]])
        parts.append(client[rng.permutation(len(client))])
    rest = concat([pos[(m // 2) * small_pos:], neg[(m // 2) * small_neg:]])
    rest = rest[rng.permutation(len(rest))]
    for i in range(m // 2):
        parts.append(rest[i * big:(i + 1) * big].copy())
    return parts
