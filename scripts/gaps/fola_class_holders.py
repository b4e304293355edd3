"""FOLA Fig. 3's split (MNIST, per-class contiguous Dirichlet, alpha = 0.1), realised for N = 5 ... 100 and seeds 0-2:
how many clients effectively hold each class (1 / sum of the squared shares of its samples, averaged over classes),
and the same for the what-if partition.coarse_clients=5 (N clients cut from the N = 5 split, which keeps N = 5's
label mixes). results/gaps.md#fola-figures3-4; a few CPU seconds:

    PYTHONPATH=$PWD python scripts/gaps/fola_class_holders.py
"""
import gzip
from pathlib import Path

import numpy as np

from fedbench.partition import client_label_counts, make_partition

MIRROR = Path(__file__).resolve().parents[3] / "shared" / "datasets"
with gzip.open(MIRROR / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz") as f:
    y = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)


def holders(n: int, coarse=None) -> float:
    per_seed = []
    for seed in (0, 1, 2):
        parts = make_partition("dirichlet_per_class_contiguous", y, n, seed, alpha=0.1, coarse_clients=coarse)
        share = client_label_counts(parts, y, 10).astype(float)
        share /= share.sum(0, keepdims=True)
        per_seed.append((1 / (share ** 2).sum(0)).mean())
    return float(np.mean(per_seed))


print("N      effective holders a class (split)   (coarse_clients=5)")
for n in (5, 10, 20, 50, 100):
    print(f"{n:3d}    {holders(n):6.2f}                              {holders(n, 5):6.2f}")
