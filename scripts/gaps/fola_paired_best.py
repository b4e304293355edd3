"""FOLA Figs. 3-4: is FedAvg's small lead over FOLA's aggregation at large alpha noise? Both methods aggregate the
same clients of a seed, so their seeds pair. Per complete (alpha, N) group of the reduced grid, the script prints
(a) each seed's difference between FOLA's and FedAvg's best cells (the best of the 3-seed means over E, lr, B, as
the figure picks them) and (b) each seed's difference at FedAvg's best cell (same clients, same E, lr, B: the
aggregation alone). results/gaps.md#fola-figures3-4; reads the committed runs table, a second:

    python scripts/gaps/fola_paired_best.py [results/tables/fola_figure3_reduced_runs.csv]
"""
import os
import sys

import pandas as pd

SETTING = ["local_epochs", "local.lr", "local.batch_size"]


def paired_best(runs: pd.DataFrame, method: str = "fola", baseline: str = "fedavg", seeds: int = 3):
    """One row per complete (partition, num_clients) group: each method's best setting and the per-seed differences
    method - baseline, best against best and both at the baseline's best setting. A group is complete when ``seeds``
    seeds ran every (method, E, lr, B) cell that the table holds anywhere; only those seeds count."""
    rows = []
    runs = runs.dropna(subset=["accuracy"])
    cells = ["method"] + SETTING
    grid = len(runs.drop_duplicates(cells))
    for (part, n), g in runs.groupby(["partition", "num_clients"]):
        per_seed = g.drop_duplicates(cells + ["seed"]).groupby("seed").size()
        full = per_seed.index[per_seed == grid]
        if len(full) < seeds:        # a group whose grid is still running is left out, as the claims do
            continue
        g = g[g.seed.isin(full)]
        means = g.groupby(["method"] + SETTING).accuracy.mean()
        best = {m: means[m].idxmax() for m in (method, baseline)}

        def per_seed(m, setting):
            at = g[(g.method == m) & (g[SETTING].apply(tuple, axis=1) == tuple(setting))]
            return at.set_index("seed").accuracy.sort_index()

        base = per_seed(baseline, best[baseline])
        rows.append({"partition": part, "num_clients": n, f"{method}_best": best[method],
                     f"{baseline}_best": best[baseline],
                     "best_vs_best": (per_seed(method, best[method]) - base).round(2).tolist(),
                     f"at_{baseline}_best": (per_seed(method, best[baseline]) - base).round(2).tolist()})
    return pd.DataFrame(rows)


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "results/tables/fola_figure3_reduced_runs.csv"
    if not os.path.isfile(path):
        sys.exit(f"fola_paired_best: no runs table at {path} "
                 "(collect it: scripts/campaign.sh --collect fola_figures3_4)")
    with pd.option_context("display.width", 200, "display.max_colwidth", 40):
        print(paired_best(pd.read_csv(path)).to_string(index=False))
