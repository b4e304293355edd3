"""FOLA Fig. 3's split (MNIST, per-class contiguous Dirichlet, alpha = 0.1), realised for seeds 0-2: per class, the
effective number of clients holding it (1 / sum of the squared shares of its samples); per client, the effective
number of classes it holds (1 / sum of its squared class proportions, weighted by client size); the largest client's
share of the data. For the released split at N = 5 ... 100, and for the what-if partition.coarse_clients=M (N clients
cut at random from the M-client split: M's label mixes). results/gaps.md#fola-figures3-4; a few CPU seconds:

    PYTHONPATH=$PWD python scripts/gaps/fola_class_holders.py
"""
import gzip
from pathlib import Path

import numpy as np

from fedbench.partition import client_label_counts, make_partition

MIRROR = Path(__file__).resolve().parents[3] / "shared" / "datasets"
with gzip.open(MIRROR / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz") as f:
    y = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)


def stats(n: int, coarse=None) -> np.ndarray:
    per_seed = []
    for seed in (0, 1, 2):
        parts = make_partition("dirichlet_per_class_contiguous", y, n, seed, alpha=0.1, coarse_clients=coarse)
        cnt = client_label_counts(parts, y, 10).astype(float)
        weight = cnt.sum(1) / cnt.sum()
        holders = (1 / ((cnt / cnt.sum(0, keepdims=True)) ** 2).sum(0)).mean()
        mix = cnt / np.maximum(cnt.sum(1, keepdims=True), 1)
        classes = (weight / np.maximum((mix ** 2).sum(1), 1e-12)).sum()
        per_seed.append((holders, classes, weight.max()))
    return np.mean(per_seed, 0)


print("N    label mixes of   holders a class   classes a client   largest client")
for n, coarse in [(5, None), (10, None), (20, None), (50, None), (100, None), (20, 5), (100, 5), (100, 20), (100, 50)]:
    h, c, w = stats(n, coarse)
    print(f"{n:3d}  {'M = %d' % coarse if coarse else 'itself':14s}   {h:6.2f}            {c:6.2f}             {w:6.3f}")
