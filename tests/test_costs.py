"""Cost tables in the papers' units and layout, with ratios to the baseline method (fedbench/report/costs.py)."""
import math

import pandas as pd
import pytest

from fedbench.errors import FedbenchError
from fedbench.report.costs import attach_ratios, format_cost_cell, to_paper_unit
from fedbench.report.tables import (
    attach_reference,
    column_specs,
    score,
    summarise,
    table_runs,
    to_markdown,
)
from tests.test_tables import _cell, _fake_records

FISHER = ["experiment=fedfisher/table1", "profile=quick", "dataset=fmnist", "model=lenet"]


def _fisher_record(seconds):
    """Records of FedFisher Table 1 whose client train + post compute seconds (per run, 5 clients) are given."""
    def rec(c):
        if c.algorithm.name not in seconds:
            return None
        train, post = seconds[c.algorithm.name]
        return {"metrics": {"accuracy": 70.0},
                "timing": {"total_s": 999.0, "client_train_s": 0.0, "client_train_compute_s": train,
                           "client_post_s": post, "client_post_compute_s": post, "server_s": 1.0},
                "communication": {"uplink_bytes": 5 * 44190 * 4}}
    return rec


def test_unit_conversion():
    assert to_paper_unit(150.0, "minutes", False, 10) == pytest.approx(2.5)
    assert to_paper_unit(2_480_240, "mb", False, 10) == pytest.approx(2.48024)
    assert to_paper_unit(2_480_240, "mb", True, 10) == pytest.approx(0.248024)
    assert to_paper_unit(72.5, "seconds", True, 5) == pytest.approx(14.5)
    assert to_paper_unit(72.5, "accuracy", True, 5) == 72.5          # not a cost: unchanged
    assert to_paper_unit(None, "seconds", True, 5) is None
    with pytest.raises(FedbenchError):
        to_paper_unit(1.0, "seconds", True, 0)


def test_fedfisher_table1_per_client_seconds_and_ratios(tmp_path):
    out = tmp_path / "out"
    # per run: FedAvg 60 s training over 5 clients; K-FAC 60 + 6 s Fisher; Diag 60 + 9 s
    _fake_records(out, FISHER, _fisher_record({"fedavg": (60.0, 0.0), "fedfisher_kfac": (60.0, 6.0),
                                               "fedfisher_diag": (60.0, 9.0)}))
    df = table_runs(FISHER, out)
    meta = df.attrs["table"]
    assert set(df.loc[df["method"] == "fedavg", "timing.client_train_compute_s"]) == {60.0}   # raw, per run
    s = attach_ratios(attach_reference(summarise(df), "fedfisher", "table1"), meta)
    avg, kfac, diag = (_cell(s, method=m) for m in ("fedavg", "fedfisher_kfac", "fedfisher_diag"))
    assert avg["mean"] == pytest.approx(12.0) and avg["paper"] == 14.5 and avg["metric"] == "seconds"
    assert kfac["mean"] == pytest.approx(13.2) and kfac["paper"] == 16.0
    assert kfac["ratio"] == pytest.approx(1.1) and diag["ratio"] == pytest.approx(69 / 60)
    assert avg["ratio"] == pytest.approx(1.0)
    assert kfac["paper_ratio"] == pytest.approx(16.0 / 14.5) and diag["paper_ratio"] == pytest.approx(16.6 / 14.5)
    md = to_markdown(s, meta, "quick")
    assert "| method | fmnist: client time (s) |" in md
    assert "| fedfisher_kfac | 13.2 s (1.10× fedavg; paper 16.0 s, 1.10×) |" in md
    assert "| fedfisher_diag | 13.8 s (1.15× fedavg; paper 16.6 s, 1.14×) |" in md
    assert "no ✓/✗" in md and "✓ within" not in md and "Within tolerance" not in md   # costs: never scored
    assert "| fedavg | 12.0 s (1.00× fedavg; paper 14.5 s, 1.00×) |" in md
    assert "Δ" not in md.split("|---", 1)[1].split("\n\n")[0]
    assert score(s, meta)["paper_cells"] == 0                # hardware differs: costs are never scored


def test_paper_ratio_matches_fedfishers_printed_overhead():
    """The paper's own ratio from its seconds agrees with its printed "vs FedAvg" % (rounding of the seconds)."""
    from fedbench.results.reference import load_reference
    ref = load_reference("fedfisher", "table1")
    sec = ref[ref["metric"] == "seconds"].set_index(["dataset", "method"])["mean"]
    pct = ref[(ref["metric"] == "overhead_pct") & ref["mean"].notna()]
    assert len(pct) == 4
    for r in pct.itertuples():
        ratio = sec[(r.dataset, r.method)] / sec[(r.dataset, "fedavg")]
        assert 100 * (ratio - 1) == pytest.approx(r.mean, abs=0.25)


def test_missing_baseline_run_shows_dash_not_a_crash(tmp_path):
    out = tmp_path / "out"
    _fake_records(out, FISHER, _fisher_record({"fedfisher_kfac": (60.0, 6.0)}))   # no FedAvg record
    df = table_runs(FISHER, out)
    s = attach_reference(summarise(df), "fedfisher", "table1")
    md = to_markdown(s, df.attrs["table"], "quick")
    assert "| fedfisher_kfac | 13.2 s (— fedavg; paper 16.0 s, 1.10×) |" in md
    assert "| fedavg | not run (0/1) (paper 14.5 s, 1.00×) |" in md
    k = _cell(attach_ratios(s, df.attrs["table"]), method="fedfisher_kfac")
    assert math.isnan(k["ratio"]) and k["paper_ratio"] == pytest.approx(16.0 / 14.5)


def test_fedlpa_table4_minutes_and_mb_per_run(tmp_path):
    out = tmp_path / "out"
    preset = ["experiment=fedlpa/table4", "profile=quick"]
    cost = {"fedavg": (120.0, 2_480_240), "fedlpa": (156.0, 7_200_000), "fednova": (120.0, 2_480_240)}

    def rec(c):
        if c.algorithm.name not in cost:
            return None
        t, b = cost[c.algorithm.name]
        return {"metrics": {"accuracy": 40.0}, "timing": {"total_s": t}, "communication": {"uplink_bytes": b}}
    _fake_records(out, preset, rec)
    df = table_runs(preset, out)
    s = attach_reference(summarise(df), "fedlpa", "table4")
    md = to_markdown(s, df.attrs["table"], "quick")
    assert "| method | cifar10: computation (min) | cifar10: communication (MB) |" in md
    row = next(l for l in md.splitlines() if l.startswith("| fedlpa "))
    assert "2.60 min (1.30× fedavg; paper 65.0 min, 1.30×)" in row
    assert "7.20 MB (2.90× fedavg; paper 2.77 MB, 1.12×)" in row
    assert "| scaffold | not run (0/1) (paper 50.0 min, 1.00×) |" in md


def test_fedbens_per_mixture_coefficients_and_named_baseline():
    """FedBEns prints 30.9·M s: our cost is shown per mixture, ratios compare the costs at the run's M."""
    s = pd.DataFrame([
        {"dataset": "cifar10", "num_clients": 5, "column": "client runtime (s)", "metric": "seconds",
         "method": "fedbens", "variant": "(members=5)", "n": 1, "finished": 1, "planned": 1, "mean": 150.0,
         "paper": 30.9, "scales_with": "M"},
        {"dataset": "cifar10", "num_clients": 5, "column": "server runtime (s)", "metric": "seconds",
         "method": "fedbens", "variant": "(members=5)", "n": 1, "finished": 1, "planned": 1, "mean": 100.0,
         "paper": 7.2, "scales_with": "M^2"},
        {"dataset": "cifar10", "num_clients": 5, "column": "client runtime (s)", "metric": "seconds",
         "method": "otfusion", "variant": "", "n": 1, "finished": 1, "planned": 1, "mean": 25.0, "paper": 25.9},
        {"dataset": "cifar10", "num_clients": 5, "column": "server runtime (s)", "metric": "seconds",
         "method": "otfusion", "variant": "", "n": 1, "finished": 1, "planned": 1, "mean": 2.0, "paper": 1.1},
    ])
    r = attach_ratios(s, {"rows": ["dataset", "num_clients"], "cost_baseline": "otfusion"})
    client = r.iloc[0].to_dict()
    assert client["ratio"] == pytest.approx(6.0) and client["paper_ratio"] == pytest.approx(30.9 * 5 / 25.9)
    assert r.iloc[1]["paper_ratio"] == pytest.approx(7.2 * 25 / 1.1) and r.iloc[1]["ratio"] == pytest.approx(50.0)
    assert format_cost_cell(client) == "30.0·M s (6.00× otfusion; paper 30.9·M s, 5.97×)"
    assert format_cost_cell(r.iloc[1].to_dict()) == "4.00·M² s (50.0× otfusion; paper 7.20·M² s, 164×)"
    no_m = {**client, "variant": ""}
    assert format_cost_cell(no_m).startswith("150 s (M unknown)")


def test_bad_cost_columns_fail_with_one_line():
    meta = {"paper": "x", "id": "t", "rows": ["dataset"]}
    with pytest.raises(FedbenchError, match="minutes is read from timing"):
        column_specs({**meta, "columns": [{"name": "t", "value": "communication.uplink_bytes", "metric": "minutes"}]})
    with pytest.raises(FedbenchError, match="per_client"):
        column_specs({**meta, "columns": [{"name": "a", "value": "metrics.accuracy", "per_client": True}]})
    ok = column_specs({**meta, "columns": [{"name": "c", "value": "sum(timing.client_*_compute_s)",
                                             "metric": "seconds", "per_client": True}]})
    assert ok[0].per_client and ok[0].metric == "seconds"
