"""Do UCI Credit global models that score the same accuracy predict the same test labels? (results/gaps_draft.md §3)
Arguments: name=<run id> of runs made with save_model=true under $FEDBENCH_OUTPUTS (default outputs/).
Run from the repo root: PYTHONPATH=$PWD python scripts/gaps/credit_predictions.py fedavg=<id> feddyn=<id> ..."""
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from fedbench.data.tabular import load_uci_credit
MIRROR = Path(__file__).resolve().parents[3] / "shared" / "datasets"
RUNS = Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs")) / "runs"
ds = load_uci_credit(Path("data"), MIRROR, False)
raw = pd.read_csv(MIRROR / "uci" / "crx.data", header=None, dtype=str, keep_default_na=False).to_numpy()
raw = raw[~np.any(raw == "?", axis=1)]; raw = raw[np.random.RandomState(0).permutation(len(raw))]
a9 = torch.tensor(raw[:131, 8] == "t").long()                 # test rows = first 131 shuffled rows
y = ds.test_y
preds = {}
for name, run in [a.split("=") for a in sys.argv[1:]]:
    sd = torch.load(RUNS / run / "model.pt", map_location="cpu")
    sd = sd["params"]
    w = [v for k, v in sd.items() if k.endswith("weight")][0].reshape(-1).double()
    b = [v for k, v in sd.items() if k.endswith("bias")][0].reshape(-1).double()
    logit = ds.test_x.double() @ w + b
    preds[name] = (logit > 0).long()
    top = torch.argsort(w.abs(), descending=True)[:3].tolist()
    print(f"{name:11s} correct {int((preds[name] == y).sum())}/131, |w| {w.norm():.2f}, largest weights at features {top} "
          f"({', '.join('%.2f' % w[i] for i in top)}), agrees with the A9 rule on {int((preds[name] == a9).sum())}/131")
names = list(preds)
for i in range(len(names)):
    for j in range(i + 1, len(names)):
        print(f"{names[i]} vs {names[j]}: same prediction on {int((preds[names[i]] == preds[names[j]]).sum())}/131 test rows")
print("A9 rule ('t' -> '+') correct on", int((a9 == y).sum()), "/131")
