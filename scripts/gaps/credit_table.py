"""UCI Credit records under $FEDBENCH_OUTPUTS/runs: per method, mean (std over seeds) of the last-3-round mean accuracy
at rounds 10/25/50(/100), FedLap Table 1's summary (results/gaps_draft.md §3). Filters: rounds=, epochs=, lr=, partition=, init= (default | zeros),
standardize= (true | false: the loader's raw-numeric reading), test_fold= (default 0; 4 is gaps.md#fedlap-table1-fold's).
Run from the repo root: python scripts/gaps/credit_table.py epochs=1 rounds=50"""
import csv
import json
import os
import statistics as st
import sys
from pathlib import Path

RUNS = Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs")) / "runs"
want = dict(a.split("=") for a in sys.argv[1:])          # e.g. rounds=50 epochs=1 partition=uci_inhomogeneous
rows = {}
for m in RUNS.glob("*/metrics.json"):
    r = json.load(open(m)); c = r["config"]
    if c["dataset"]["name"] != "uci_credit" or c["rounds"] != int(want.get("rounds", 50)): continue
    if c["local"]["epochs"] != int(want.get("epochs", 10)) or c["local"]["lr"] != float(want.get("lr", 1e-3)): continue
    if c["partition"]["name"] != want.get("partition", "uci_inhomogeneous"): continue
    if c["dataset"].get("kwargs", {}).get("test_fold", 0) != int(want.get("test_fold", 0)) or "positive_class" in c["dataset"].get("kwargs", {}): continue
    if c["dataset"].get("kwargs", {}).get("standardize", True) != (want.get("standardize", "true") == "true"): continue
    if c["algorithm"].get("weighting", "num_samples") != "num_samples": continue
    if c["model"].get("init", "default") != want.get("init", "default"): continue
    if c["algorithm"]["name"] == "fedprox" and c["algorithm"].get("scale") != "sum": continue
    acc = [float(x["accuracy"]) for x in csv.DictReader(open(m.parent / "history.csv"))]
    rows.setdefault(c["algorithm"]["name"], {})[c["seed"]] = [sum(acc[R - 3:R]) / 3 for R in (10, 25, 50, 100) if len(acc) >= R]
for alg, by_seed in sorted(rows.items()):
    cols = list(zip(*by_seed.values()))
    cells = [f"{st.mean(v):.1f}({st.stdev(v) if len(v) > 1 else 0:.1f})" for v in cols]
    print(f"{alg:11s} seeds {sorted(by_seed)}: " + "  ".join(cells))
