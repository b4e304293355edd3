"""UCI Credit facts behind FedLap's gap (results/gaps_draft.md §3): test-set size, realised PVI split, and how far one
binary feature (A9, "prior default") and a centralised logistic regression get on the 131 test rows.
Run from the repo root: PYTHONPATH=$PWD python scripts/gaps/credit_checks.py"""
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fedbench.data.tabular import load_uci_credit
from fedbench.partition import make_partition

MIRROR = Path(__file__).resolve().parents[3] / "shared" / "datasets"
ds = load_uci_credit(Path("data"), MIRROR, False)
ytr, yte = ds.train_y.numpy(), ds.test_y.numpy()
print(f"train {len(ytr)} (positive {ytr.mean():.3f}), test {len(yte)} (positive {yte.mean():.3f}), "
      f"{ds.train_x.shape[1]} features; 114/131 = {114 / 131:.4f}; majority-class test acc {1 - yte.mean():.4f}")
for seed in (0, 1, 2):
    parts = make_partition("uci_inhomogeneous", ytr, 10, seed)
    print(f"seed {seed}: sizes {[len(p) for p in parts]}, positive rate {[round(float(ytr[p].mean()), 2) for p in parts]}, "
          f"unused {len(ytr) - sum(len(p) for p in parts)}")

raw = pd.read_csv(MIRROR / "uci" / "crx.data", header=None, dtype=str, keep_default_na=False).to_numpy()
raw = raw[~np.any(raw == "?", axis=1)]
raw = raw[np.random.RandomState(0).permutation(len(raw))]      # the loader's row order; test = first 131 rows
a9 = (raw[:131, 8] == "t").astype(np.int64)
print(f"A9 = 't' -> '+' rule: test acc {(a9 == yte).mean():.4f} ({(a9 == yte).sum()}/131)")

X = torch.cat([ds.train_x.double(), torch.ones(len(ytr), 1, dtype=torch.float64)], 1)
Xt = torch.cat([ds.test_x.double(), torch.ones(len(yte), 1, dtype=torch.float64)], 1)
Y = torch.tensor(ytr, dtype=torch.float64)
for lam in (0.0, 1e-2, 1.0):     # L2 on the sum-loss scale (the bias is not penalised)
    w = torch.zeros(X.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(X @ w, Y) + 0.5 * lam * (w[:-1] ** 2).sum() / len(Y)
        loss.backward()
        return loss
    opt.step(closure)
    correct = int(((Xt @ w > 0).long().numpy() == yte).sum())
    print(f"centralised logistic regression, L2 {lam:g}: test acc {correct / 131:.4f} ({correct}/131)")
