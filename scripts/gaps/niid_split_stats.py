"""Realised NIID-Bench splits of Fashion-MNIST (10 clients, FedLPA's rows) for seeds 0-2: sizes and label sets per
client (results/gaps_draft.md §1-2, to become results/gaps.md). Run from the repo root: PYTHONPATH=$PWD python scripts/gaps/niid_split_stats.py"""
import gzip
from pathlib import Path

import numpy as np
from fedbench.partition import make_partition, client_label_counts
MIRROR = Path(__file__).resolve().parents[3] / "shared" / "datasets"
with gzip.open(MIRROR / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte.gz") as f:
    y = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
for spec, name, kw in [("beta=0.1", "noniid-labeldir", {"beta": 0.1}), ("#C=2", "noniid-#label2", {}),
                       ("#C=3", "noniid-#label3", {})]:
    mats = []
    for seed in (0, 1, 2):
        cnt = client_label_counts(make_partition(name, y, 10, seed, **kw), y, 10)
        mats.append(cnt)
        held = cnt > 0
        big = cnt >= 0.05 * cnt.sum(1, keepdims=True)        # classes making >= 5% of a client's data
        sets = ["".join(str(c) for c in np.flatnonzero(r)) for r in (big if name == "noniid-labeldir" else held)]
        uncovered = [c for c in range(10) if not held[:, c].any()]
        holders = held.sum(0).tolist()
        print(f"{spec:9s} seed {seed}: sizes {cnt.sum(1).tolist()}")
        print(f"{'':9s}         label sets {' '.join(sets)}; holders/class {holders}; classes nobody holds {uncovered}")
    same = all((mats[0] == m).all() for m in mats[1:])
    print(f"{spec}: identical count matrices across seeds: {same}\n")
