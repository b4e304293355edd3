"""scripts/gaps/fola_paired_best.py (results/gaps.md#fola-figures3-4): each method's best setting is picked on its
3-seed mean, then the seeds pair, best against best and at the baseline's best setting; a group still running its
grid is left out."""
from __future__ import annotations

import pandas as pd

from tests.script_loader import load_script


def _load():
    return load_script("gaps/fola_paired_best.py")


def _runs(acc, part="alpha=10", n=5):
    # acc[(method, epochs)] = accuracy per seed 0, 1, 2; lr 0.1, B 32 throughout
    return pd.DataFrame([{"partition": part, "num_clients": n, "method": m, "local_epochs": e, "local.lr": 0.1,
                          "local.batch_size": 32, "seed": s, "accuracy": a}
                         for (m, e), per in acc.items() for s, a in enumerate(per)])


def test_paired_differences_follow_each_methods_best_setting():
    acc = {("fola", 10): [95.0, 95.2, 95.1], ("fola", 20): [94.0, 94.1, 94.2],
           ("fedavg", 10): [94.9, 95.0, 95.0], ("fedavg", 20): [95.3, 95.4, 95.2]}
    out = _load().paired_best(_runs(acc))
    row = out.iloc[0]
    assert row["fola_best"] == (10, 0.1, 32) and row["fedavg_best"] == (20, 0.1, 32)
    assert row["best_vs_best"] == [-0.3, -0.2, -0.1]
    assert row["at_fedavg_best"] == [-1.3, -1.3, -1.0]


def test_a_group_still_running_its_grid_is_left_out():
    acc = {("fola", 10): [95.0, 95.2, 95.1], ("fedavg", 10): [94.9, 95.0, 95.0]}
    done = _runs(acc)
    running = _runs({("fola", 10): [90.0], ("fedavg", 10): [99.0]}, n=50)
    out = _load().paired_best(pd.concat([done, running]))
    assert out.num_clients.tolist() == [5]
    assert out.iloc[0]["best_vs_best"] == [0.1, 0.2, 0.1]


def test_a_group_whose_seeds_ran_part_of_the_grid_is_left_out():
    # every seed of N = 20 ran E = 10 only; N = 5 ran E = 10 and 20, so the grid has both
    acc = {("fola", 10): [95.0, 95.2, 95.1], ("fola", 20): [94.0, 94.1, 94.2],
           ("fedavg", 10): [94.9, 95.0, 95.0], ("fedavg", 20): [95.3, 95.4, 95.2]}
    part = {k: v for k, v in acc.items() if k[1] == 10}
    out = _load().paired_best(pd.concat([_runs(acc), _runs(part, n=20)]))
    assert out.num_clients.tolist() == [5]
