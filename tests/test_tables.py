"""Collection of run records into a paper table, on synthetic records."""
import json

import pytest

from fedbench.launch.sweep import compose_run, expand_sweep
from fedbench.results.records import compute_run_id, write_json_atomic
from fedbench.results.tables import partition_label, summarise, table_runs, to_markdown
from fedbench.runner import expand_aggregators
from fedbench.launch.sweep import CONF_DIR

PRESET = ["experiment=fedlpa/table6", "profile=quick", "dataset=fmnist"]


def test_preset_expands_to_the_table():
    runs = expand_sweep(["experiment=fedlpa/table6", "profile=paper"])
    assert len(runs) == 4 * 9 * 3
    assert len(expand_sweep(PRESET)) == 9   # restricted to FMNIST, one seed
    cfg = compose_run(expand_sweep(PRESET)[0])
    assert cfg.local.epochs == 2 and cfg.num_clients == 10 and cfg.dataset.normalize is False   # quick: 2 epochs
    assert [a if isinstance(a, str) else a["name"] for a in cfg.aggregators] == \
        ["fedlpa", "fedavg", "fednova", "scaffold", "fedprox", "dense"]
    paper = compose_run(expand_sweep(["experiment=fedlpa/table6", "profile=paper", "dataset=fmnist"])[0])
    assert paper.local.epochs == 20 and len(paper.aggregators) == 9


def test_partition_labels():
    assert partition_label({"name": "noniid-labeldir", "beta": 0.05}) == "beta=0.05"
    assert partition_label({"name": "noniid-#label", "k": 2}) == "#C=2"
    assert partition_label({"name": "niid-bench", "spec": "#C=3"}) == "#C=3"
    assert partition_label({"name": "dirichlet_clientwise", "alpha": 0.1}) == "alpha=0.1"


def test_collect_synthetic_records(tmp_path):
    out = tmp_path / "out"
    # fake ok records for fedavg on two partitions, seeds 0 and 1 of the paper profile
    for ovs in expand_sweep(["experiment=fedlpa/table6", "profile=paper", "dataset=fmnist", "seed=0,1"]):
        cfg = compose_run(ovs)
        for sub in expand_aggregators(cfg, CONF_DIR, allow_missing=True):
            if sub.algorithm.name != "fedavg" or sub.partition.spec not in ("beta=0.05", "#C=2"):
                continue
            acc = 50.0 + sub.seed + (10 if sub.partition.spec == "#C=2" else 0)
            write_json_atomic(out / "runs" / compute_run_id(sub) / "metrics.json",
                              {"run_id": compute_run_id(sub), "status": "ok", "metrics": {"accuracy": acc}})
    df = table_runs(["experiment=fedlpa/table6", "profile=paper", "dataset=fmnist", "seed=0,1"], out)
    s = summarise(df)
    row = s[(s.partition == "beta=0.05") & (s.method == "fedavg")].iloc[0]
    assert row["n"] == 2 and row["mean"] == pytest.approx(50.5) and row["std"] == pytest.approx(0.7071, abs=1e-3)
    row = s[(s.partition == "#C=2") & (s.method == "fedavg")].iloc[0]
    assert row["mean"] == pytest.approx(60.5)
    assert (s[s.method == "fednova"]["n"] == 0).all()
    md = to_markdown(s.assign(paper=float("nan")), df.attrs["table"], "paper")
    assert "| fmnist | beta=0.05 | " in md and "50.50 ± 0.71 (n=2)" in md and "not run (0/2)" in md


def test_row_variants_merge_into_one_column_only_when_they_never_share_a_row():
    import pandas as pd
    from fedbench.results.tables import merge_row_variants
    s = pd.DataFrame([
        {"dataset": "uci", "method": "fedprox(mu=1)", "n": 3, "planned": 3, "mean": 80.0, "std": 1.0},
        {"dataset": "mnist", "method": "fedprox(mu=0.1)", "n": 3, "planned": 3, "mean": 90.0, "std": 1.0},
        {"dataset": "uci", "method": "fedavg", "n": 3, "planned": 3, "mean": 79.0, "std": 1.0},
    ])
    m = merge_row_variants(s, ["dataset"])
    assert list(m["method"]) == ["fedprox", "fedprox", "fedavg"]
    assert list(m["variant"]) == ["(mu=1)", "(mu=0.1)", ""]
    md = to_markdown(m.assign(paper=float("nan")), {"rows": ["dataset"]}, "paper")
    assert "| dataset | fedprox | fedavg |" in md and "(mu=0.1)" in md
    # a sweep of mu inside one row (FedLPA's tables) keeps one column per value
    s2 = pd.concat([s, pd.DataFrame([{"dataset": "uci", "method": "fedprox(mu=0.1)", "n": 1, "planned": 1,
                                      "mean": 1.0, "std": 0.0}])], ignore_index=True)
    assert set(merge_row_variants(s2, ["dataset"])["method"]) == {"fedprox(mu=1)", "fedprox(mu=0.1)", "fedavg"}
