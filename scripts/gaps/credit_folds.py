"""UCI Credit: which of PVI's five KFold test folds did FedLap use? (results/gaps.md#fedlap-table1-fold)

PVI splits its shuffled arrays with sklearn's ``KFold(n_splits, shuffle=False)`` and takes the n-th split
(MattAshman/pvi, notebooks/examples/reproduction-dp-pvi.ipynb, ``get_nth_split``); fedbench's loader takes fold
``dataset.kwargs.test_fold`` of 5 (default 0, the first 131 rows). The paper prints one number that depends on the
test fold alone, with no federated training: App. D.2's centralised MAP test NLL, 0.420 at delta = 0 and 0.337 at
delta = 1 (fedlap.md §2). This solves that MAP exactly (fedbench's own solver, eval.map_reference) on each fold's
training rows and prints its test NLL and accuracy beside the paper's. A cheap check: about 10 CPU seconds.

    PYTHONPATH=$PWD python scripts/gaps/credit_folds.py
"""
from pathlib import Path

import torch

from fedbench.data.tabular import load_uci_credit
from fedbench.eval.metrics import evaluate
from fedbench.fl.map_reference import solve_map
from fedbench.models import build_model

MIRROR = Path(__file__).resolve().parents[3] / "shared" / "datasets"
PAPER_TEST_NLL = {0.0: 0.420, 1.0: 0.337}   # App. D.2 (fedlap.md §2)

torch.manual_seed(0)
print("fold  test rows  " + "  ".join(f"delta = {d:g}: test NLL (paper {p:.3f}) / acc %" for d, p in PAPER_TEST_NLL.items()))
for fold in range(5):
    ds = load_uci_credit(Path("data"), MIRROR, False, test_fold=fold)
    model = build_model("logistic_regression", input_shape=tuple(ds.train_x.shape[1:]), num_classes=2, init="zeros")
    init = dict(model.named_parameters())
    cells = []
    for delta in PAPER_TEST_NLL:
        w = solve_map(model, init, ds.train_x, ds.train_y, delta)
        m = evaluate(model, w, lambda idx: ds.test_x[idx], ds.test_y)
        cells.append(f"{m['nll']:>29.3f} / {m['accuracy']:.1f}")
    print(f"{fold:>4}  {len(ds.test_y):>9}  " + "  ".join(cells))
