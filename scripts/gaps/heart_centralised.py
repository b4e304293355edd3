"""FLamby-Heart: centralised logistic regression (all 486 training rows, scikit-learn) under each standardisation of
the loader (results/gaps.md#fedlap-table1-heart, hypothesis 3): the pooled test accuracy a global model can reach
when the hospitals' rows are standardised per hospital, with the pooled statistics, per hospital for training and
pooled for the test rows (FLamby's pooled test loader), or not at all. No federated training: a cheap bound.

    PYTHONPATH=$PWD python scripts/gaps/heart_centralised.py
"""
from sklearn.linear_model import LogisticRegression

from fedbench.data import default_mirror, load_dataset

MODES = ("center", "pooled", "center_train_pooled_test", "none")
INVERSE_L2 = (0.01, 0.1, 1.0)   # scikit-learn's C: the inverse L2 strength

print("standardize".ljust(26) + "".join(f"C = {c:<8g}" for c in INVERSE_L2))
for mode in MODES:
    ds = load_dataset("flamby_heart", "data", mirror=default_mirror(), standardize=mode)
    accs = [100.0 * (LogisticRegression(C=c, max_iter=5000).fit(ds.train_x.numpy(), ds.train_y.numpy())
                     .predict(ds.test_x.numpy()) == ds.test_y.numpy()).mean() for c in INVERSE_L2]
    print(mode.ljust(26) + "".join(f"{a:<12.2f}" for a in accs))
