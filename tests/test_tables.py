"""Collection of run records into a paper table, on synthetic records."""
from tests.conftest import ok_record
import json
import math

import pandas as pd
import pytest

from fedbench.launch.sweep import compose_run, expand_sweep
from fedbench.results.records import compute_run_id, write_json_atomic
from fedbench.report.tables import partition_label, score, summarise, table_runs, to_markdown
from fedbench.config.aggregators import expand_aggregators
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
                              ok_record(compute_run_id(sub), sub.algorithm.name, metrics={"accuracy": acc}))
    df = table_runs(["experiment=fedlpa/table6", "profile=paper", "dataset=fmnist", "seed=0,1"], out)
    s = summarise(df)
    row = s[(s.partition == "beta=0.05") & (s.method == "fedavg")].iloc[0]
    assert row["n"] == 2 and row["mean"] == pytest.approx(50.5) and row["std"] == pytest.approx(0.7071, abs=1e-3)
    row = s[(s.partition == "#C=2") & (s.method == "fedavg")].iloc[0]
    assert row["mean"] == pytest.approx(60.5)
    assert (s[s.method == "fednova"]["n"] == 0).all()
    md = to_markdown(s.assign(paper=float("nan")), df.attrs["table"], "paper")
    assert "| fmnist | beta=0.05 | " in md and "50.50 ± 0.71 / —" in md and "**n = 2** seed(s)" in md and "not run (0/2)" in md


def test_entries_of_one_method_with_different_settings_are_separate_columns(tmp_path):
    # FedLPA's CG and GD solvers on the same clients: two cells, never one averaged cell of both
    out = tmp_path / "out"
    preset = ["experiment=fedlpa/table6", "profile=paper", "dataset=fmnist", "partition.spec='beta=0.1'", "seed=0,1",
              "aggregators=[fedavg,{name:fedlpa,solver:cg},fedlpa,{name:fedprox,mu:0.01}]"]
    for ovs in expand_sweep(preset):
        for sub in expand_aggregators(compose_run(ovs), CONF_DIR, allow_missing=True):
            acc = {"fedavg": 30.0, "fedprox": 31.0}.get(sub.algorithm.name) or \
                (50.0 if sub.algorithm.solver == "cg" else 40.0)
            write_json_atomic(out / "runs" / compute_run_id(sub) / "metrics.json",
                              {**ok_record(compute_run_id(sub), sub.algorithm.name), "metrics": {"accuracy": acc + sub.seed},
                               "timing": {"server_s": 2.0 * sub.seed}, "communication": {"uplink_bytes": 100}})
    s = summarise(table_runs(preset, out)).set_index("method")
    # the records' costs can be the table's metric
    cost = summarise(table_runs(preset, out), "timing.server_s").set_index("method")
    assert cost.loc["fedlpa(solver=gd)", "mean"] == pytest.approx(1.0) and cost.loc["fedavg", "n"] == 2
    assert set(s.index) == {"fedavg", "fedlpa(solver=cg)", "fedlpa(solver=gd)", "fedprox(mu=0.01)"}
    assert s.loc["fedlpa(solver=cg)", "mean"] == pytest.approx(50.5) and s.loc["fedlpa(solver=gd)", "n"] == 2
    assert s.loc["fedlpa(solver=gd)", "mean"] == pytest.approx(40.5)
    # such a collection can be written beside the preset's own table instead of over it
    from fedbench.errors import FedbenchError
    from fedbench.report.tables import collect
    path = collect(preset, out, tmp_path / "tables", suffix="solvers")
    assert path.name == "fedlpa_table6_solvers.md" and (tmp_path / "tables" / "fedlpa_table6_solvers_runs.csv").is_file()
    assert "fedlpa(solver=cg)" in path.read_text()
    with pytest.raises(FedbenchError, match="--name"):
        collect(preset, out, tmp_path / "tables", suffix="../x")


def test_reproduce_rejects_a_bad_table_name_before_training(tmp_path, monkeypatch, capsys):
    import fedbench.launch.jobs as jobs
    from tests.script_loader import load_script
    main = load_script("reproduce.py").main
    monkeypatch.setattr(jobs, "run_job_records", lambda *a, **k: pytest.fail("trained despite a bad --name"))
    monkeypatch.setattr(jobs, "run_local", lambda *a, **k: pytest.fail("trained despite a bad --name"))
    monkeypatch.chdir(tmp_path)
    assert main(["--name", "a/b", "experiment=fedlpa/table6", "profile=quick", "dataset=fmnist"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedbench: error: --name")
    # options may also follow the overrides (the same one-line error, not argparse's usage message)
    assert main(["experiment=fedlpa/table6", "--name", "a/b", "profile=quick", "dataset=fmnist"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedbench: error: --name")
    # a setting that is a row key (FedBEns Fig. 4's T) separates rows already: labels stay plain
    from fedbench.report.tables import split_conflated_methods
    rows = [{"method": "fedbens", "T": t, "seed": 0, "_algo": {"name": "fedbens", "temperature": t}} for t in (0.1, 1)]
    assert [r["method"] for r in split_conflated_methods(rows, ["T"])] == ["fedbens", "fedbens"]
    rows = [{"method": "fedprox(mu=0.1)", "seed": 0, "_algo": {"name": "fedprox", "mu": 0.1, "x": {"y": v}}}
            for v in (1, 2)]
    assert [r["method"] for r in split_conflated_methods(rows, [])] == ["fedprox(mu=0.1,x.y=1)", "fedprox(mu=0.1,x.y=2)"]


def test_row_variants_merge_into_one_column_only_when_they_never_share_a_row():
    import pandas as pd
    from fedbench.report.tables import merge_row_variants
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


# --- derived columns (table.columns): rounds to an accuracy, min / max over components, GA / LA ---------------
def _fake_records(out, preset, record_for):
    """An ok record for every (run, aggregator) of a preset's sweep for which ``record_for(cfg)`` returns a dict."""
    for ovs in expand_sweep(preset):
        for sub in expand_aggregators(compose_run(ovs), CONF_DIR, allow_missing=True):
            if sub.algorithm.get("_missing"):
                continue
            rec = record_for(sub)
            if rec is not None:
                rid = compute_run_id(sub)
                write_json_atomic(out / "runs" / rid / "metrics.json", {**ok_record(rid, sub.algorithm.name), **rec})


def _cell(s, **keys):
    sel = s
    for k, v in keys.items():
        sel = sel[sel[k].astype(str) == str(v)]
    assert len(sel) == 1, (keys, len(sel))
    return sel.iloc[0]


def test_fedlap_table3_rounds_to_accuracy_with_never(tmp_path):
    from fedbench.report.tables import attach_reference
    out = tmp_path / "out"
    preset = ["experiment=fedlap/table3", "profile=paper", "seed=0,1,2", "dataset=mnist", "partition=homo"]
    firsts = {("mnist", "fedavg"): [5, 6, 8], ("mnist", "feddyn"): [3, None, 4]}   # feddyn seed 1 never reaches 97.5

    def rec(c):
        if c.dataset.name != "mnist" or c.partition.name != "homo" or c.algorithm.name not in ("fedavg", "feddyn"):
            return None
        r = firsts[("mnist", c.algorithm.name)][c.seed]
        return {"metrics": {"accuracy": 97.9}, "summary": {"first_round_accuracy_ge_97.5": r,
                                                          "first_round_accuracy_ge_72": 1}}
    _fake_records(out, preset, rec)
    df = table_runs(preset, out)
    # the 97.5 % column applies to MNIST rows only, 72 % to CIFAR-10 only, 75/78 % to FMNIST and CIFAR-10
    assert set(df["threshold"]) == {97.5}
    for ds, want in (("fmnist", {75, 78}), ("cifar10", {72, 75, 78})):
        other = table_runs(["experiment=fedlap/table3", "profile=quick", f"dataset={ds}"], out)
        assert set(other["threshold"]) == want and (other["status"] == "missing").all()
    s = attach_reference(summarise(df), "fedlap", "table3")
    avg = _cell(s, dataset="mnist", partition="homog", method="fedavg")
    assert (avg["n"], avg["never"], avg["finished"]) == (3, 0, 3)
    assert avg["mean"] == pytest.approx(19 / 3) and avg["std"] == pytest.approx(1.5275, abs=1e-4)
    assert avg["paper"] == 6.0 and avg["metric"] == "rounds_to_acc"
    dyn = _cell(s, dataset="mnist", partition="homog", method="feddyn")
    assert (dyn["n"], dyn["never"], dyn["finished"]) == (2, 1, 3) and dyn["mean"] == pytest.approx(3.5)
    assert _cell(s, dataset="mnist", partition="homog", method="fedlap")["finished"] == 0
    md = to_markdown(s, df.attrs["table"], "paper")
    assert "| dataset | partition | num_clients | threshold | fedavg | fedprox(mu=0.1) | feddyn |" in md
    row = next(l for l in md.splitlines() if l.startswith("| mnist | homog | 10 | 97.5 |"))
    assert "6.33 ± 1.53 (n=3) / 6.00 / Δ +0.33" in row
    assert "never 1/3; reached: 3.50 ± 0.71 (n=2) / 4.00 ✗ |" in row        # shown, no difference taken: outside
    sc = score(s, df.attrs["table"])   # counted as the cell says (the reached mean, 3.5 against 4, would be within)
    assert [(o["method"], o["mean"]) for o in sc["outside"]] == [("feddyn", pytest.approx(3.5))]
    assert "not run (0/3)" in row


def test_fedlap_table3_reads_rounds_from_histories_of_runs_without_thresholds(tmp_path):
    """Table 3's FMNIST cells from Table 1-style runs: no summary.first_round_* in the record, only the history."""
    from fedbench.results.records import write_csv_atomic
    out = tmp_path / "out"
    preset = ["experiment=fedlap/table3", "profile=paper", "seed=0,1", "dataset=fmnist", "partition=homo"]
    curves = {0: [70.0, 76.0, 77.0, 79.0], 1: [74.0, 74.5, 75.0, 77.5]}   # seed 1 never reaches 78 in 4 rounds

    def rec(c):
        return {"metrics": {"accuracy": curves[c.seed][-1]}, "summary": {"last3_mean_accuracy": 1.0},
                "test_seed": c.seed} if c.algorithm.name == "fedavg" else None
    _fake_records(out, preset, rec)
    for d in (out / "runs").iterdir():
        seed = json.loads((d / "metrics.json").read_text())["test_seed"]
        rows = [{"round": i + 1, "accuracy": a} for i, a in enumerate(curves[seed])]
        write_csv_atomic(d / "history.csv", rows, ["round", "accuracy"])
    df = table_runs(preset, out)
    avg = df[(df["algorithm"] == "fedavg") & (df["status"] == "ok")]
    got = {(r.seed, r.threshold): (None if pd.isna(r.value) else r.value, r.never) for r in avg.itertuples()}
    assert got == {(0, 75): (2.0, False), (0, 78): (4.0, False), (1, 75): (3.0, False), (1, 78): (None, True)}


def test_fedbens_table8_ensemble_min_max_components(tmp_path):
    from fedbench.report.tables import attach_reference
    out = tmp_path / "out"
    preset = ["experiment=fedbens/table8", "profile=paper", "dataset=fmnist", "seed=0,1"]
    comps = {0: [50.0, 58.0, 55.0, 52.0, 57.0], 1: [54.0, 60.0, 53.0, 59.0, 56.0]}

    def rec(c):
        if c.partition.alpha != 0.05:
            return None
        m = {f"component{i}_accuracy": a for i, a in enumerate(comps[c.seed])}
        return {"metrics": {"accuracy": 61.0 + c.seed, "component0_nll": 0.1, **m}}
    _fake_records(out, preset, rec)
    s = attach_reference(summarise(table_runs(preset, out)), "fedbens", "table8")
    ens = _cell(s, partition="alpha=0.05", column="ensemble")
    lo = _cell(s, partition="alpha=0.05", column="min component")
    hi = _cell(s, partition="alpha=0.05", column="max component")
    assert ens["mean"] == pytest.approx(61.5) and ens["paper"] == 60.08
    assert lo["mean"] == pytest.approx(51.5) and lo["std"] == pytest.approx(2.1213, abs=1e-4) and lo["paper"] == 53.41
    assert hi["mean"] == pytest.approx(59.0) and hi["paper"] == 59.98 and hi["n"] == 2
    assert _cell(s, partition="alpha=0.4", column="max component")["finished"] == 0
    md = to_markdown(s, {**table_runs(preset, out).attrs["table"]}, "paper")
    assert "| dataset | partition | fedbens: ensemble | fedbens: min component | fedbens: max component |" in md
    assert "51.50 ± 2.12 / 53.41 / Δ -1.91 ✓" in md


def test_fola_table2_ga_la_and_rounds_columns(tmp_path):
    from fedbench.report.tables import attach_reference
    out = tmp_path / "out"
    preset = ["experiment=fola/table2", "profile=paper", "seed=0"]

    def rec(c):
        if c.algorithm.name not in ("fedavg", "scaffold"):
            return None
        avg = c.algorithm.name == "fedavg"
        return {"metrics": {"accuracy": 43.0 if avg else 20.0, "local_accuracy": 14.0},
                "summary": {"first_round_accuracy_ge_30": 25 if avg else None,
                            "first_round_accuracy_ge_40": 70 if avg else None}}
    _fake_records(out, preset, rec)
    df = table_runs(preset, out)
    s = attach_reference(summarise(df), "fola", "table2")
    assert _cell(s, method="fedavg", column="GA")["paper"] == 42.16
    assert _cell(s, method="fedavg", column="LA")["paper"] == 14.15
    r30 = _cell(s, method="fedavg", column="round GA=30%")
    assert r30["mean"] == 25 and r30["paper"] == 23
    sc = _cell(s, method="scaffold", column="round GA=40%")
    assert sc["never"] == 1 and sc["n"] == 0 and math.isnan(sc["paper"])     # the paper's "-": never either
    md = to_markdown(s, df.attrs["table"], "paper")
    assert "| dataset | partition | local_epochs | method | GA | LA | round GA=30% | round GA=40% |" in md
    row = next(l for l in md.splitlines() if "| scaffold |" in l)
    assert "20.00 ± 0.00 / 20.30 / Δ -0.30 ✓" in row and row.count("never 1/1 / —") == 2


def test_bad_column_declarations_fail_with_one_line():
    from fedbench.errors import FedbenchError
    from fedbench.report.tables import column_specs, table_layout
    import pandas as pd
    meta = {"paper": "x", "id": "t", "rows": ["dataset", "partition"]}
    for cols, match in [([{"name": "a"}], "name and a value"),
                        ([{"name": "a", "value": "accuracy", "colour": 1}], "unknown field"),
                        ([{"name": "a", "value": "metrics.component*_acc"}], "glob"),
                        ([{"name": "a", "value": "accuracy", "where": {"alpha": 1}}], "filters on 'alpha'"),
                        ([{"name": "a", "value": "accuracy", "keys": {"dataset": 1}}], "clashes"),
                        ([{"name": "a", "value": "accuracy"}, {"name": "a", "value": "nll"}], "twice")]:
        with pytest.raises(FedbenchError, match=match):
            column_specs({**meta, "columns": cols})
    with pytest.raises(FedbenchError, match="layout"):
        table_layout({**meta, "layout": {"rows": ["dataset", "threshold"]}}, pd.DataFrame())


def test_cells_keep_small_values_readable():
    from fedbench.report.tables import format_cell
    # accuracies: 2 decimals; losses below 0.1 (FedFisher Fig. 1's training error): 3 significant digits
    assert format_cell({"mean": 74.2812, "std": 3.4456, "n": 3, "paper": 68.36}) == "74.28 ± 3.45 (n=3) / 68.36 / Δ +5.92 ✗"
    assert format_cell({"mean": 0.01532, "std": 0.004471, "n": 2}).startswith("0.0153 ± 0.00447 (n=2) / —")
    assert format_cell({"mean": 0.0, "std": 0.0, "n": 1}).startswith("0.00 ± 0.00 (n=1)")
    # tolerance: max(3 points, 2 x combined standard error); the paper's std counts with the paper's seed count
    assert format_cell({"mean": 70.0, "std": 1.0, "n": 3, "paper": 67.5}).endswith("Δ +2.50 ✓")
    assert format_cell({"mean": 70.0, "std": 1.0, "n": 3, "paper": 66.5}).endswith("Δ +3.50 ✗")
    assert format_cell({"mean": 70.0, "std": 1.0, "n": 3, "paper": 66.5, "paper_std": 4.0}, paper_n=3).endswith("✓")
    assert format_cell({"mean": 70.0, "std": 1.0, "n": 3, "paper": 60.0, "stale": 2}).startswith("70.00 ± 1.00 (n=3) (+2 stale)")


def test_nll_cells_have_their_own_tolerance_floor():
    """3 'points' would accept any NLL: NLL cells (FedLap Table 5) use a 0.05-nat floor, joined from their metric."""
    from fedbench.report.tables import attach_reference, format_cell, within_tolerance
    cell = {"mean": 0.45, "std": 0.01, "n": 3, "paper": 0.56}
    assert within_tolerance(cell, 3) is True                       # the accuracy-point floor
    assert within_tolerance({**cell, "tol_floor": 0.05}, 3) is False
    assert within_tolerance({**cell, "mean": 0.52, "tol_floor": 0.05}, 3) is True
    summary = pd.DataFrame([{"dataset": "fmnist", "partition": "homog", "num_clients": 10, "method": "fedavg",
                             "mean": 0.45, "std": 0.01, "n": 3}])
    nll = attach_reference(summary, "fedlap", "table5", "nll").iloc[0].to_dict()
    assert nll["paper"] == pytest.approx(0.56) and nll["tol_floor"] == pytest.approx(0.05)
    assert format_cell(nll, 3).endswith("✗")
    acc = attach_reference(summary.assign(mean=84.0), "fedlap", "table1", "accuracy")
    assert "tol_floor" not in acc
    # a derived-column table (App. D.2) gives each row its own metric's floor: the MAP test NLL is an NLL (fold 0's
    # 0.27 against the paper's 0.337 is outside), its rounds-to-1 % beside it keeps the 3-point floor
    key = {"dataset": "uci_credit", "partition": "homog", "num_clients": 2, "map_delta": 1, "method": "fedlap"}
    d2 = pd.DataFrame([{**key, "metric": "map_test_nll", "mean": 0.269, "std": 0.0, "n": 1},
                       {**key, "metric": "rounds_to_1pct", "mean": 4.0, "std": 0.0, "n": 1}])
    nll_row, rounds_row = (r.to_dict() for _, r in attach_reference(d2, "fedlap", "appD2", "accuracy").iterrows())
    assert nll_row["paper"] == pytest.approx(0.337) and nll_row["tol_floor"] == pytest.approx(0.05)
    assert format_cell(nll_row, 1).endswith("✗")
    assert rounds_row["paper"] == pytest.approx(2.0) and format_cell(rounds_row, 1).endswith("✓")   # |Δ| = 2 rounds


def test_row_winner_of_a_loss_is_its_lowest_mean():
    from fedbench.report.tables import score
    rows = [("a", 0.40, 0.45), ("b", 0.60, 0.50), ("c", 0.50, 0.70)]   # (method, ours, paper)
    s = pd.DataFrame([{"dataset": "d", "partition": "p", "method": m, "mean": o, "std": 0.0, "n": 3, "paper": p}
                      for m, o, p in rows])
    assert score(s, {}, "nll")["order_held"] == 1          # lowest: a, ours and the paper's
    assert score(s, {}, "accuracy")["order_held"] == 0     # highest: b here, c in the paper


def test_a_row_whose_paper_best_is_tied_holds_for_either():
    from fedbench.report.tables import score
    s = pd.DataFrame([{"dataset": "d", "partition": "p", "method": m, "mean": o, "std": 0.0, "n": 3, "paper": p}
                      for m, o, p in [("a", 0.60, 0.56), ("b", 0.50, 0.56), ("c", 0.70, 0.63)]])
    assert score(s, {}, "nll")["order_held"] == 1          # b is ours; a and b tie in the paper
    s.loc[1, "paper"] = 0.57
    failed = score(s, {}, "nll")["order_failed"]
    assert [(f["paper_winner"], f["our_winner"]) for f in failed] == [("a", "b")]


def _read_entries(entries, order):
    """(unresolved containers, run ids) of each entry, read in ``order`` (shared configs keep the last values set)."""
    from fedbench.report import plans as P
    out = {}
    for i in order:
        with P.applied(entries[i]) as pair:
            out[i] = (P._containers(pair), [compute_run_id(s) for s in pair[1]])
    return [out[i] for i in sorted(out)]


def test_shared_compositions_equal_real_ones_in_any_order_and_a_mismatch_falls_back(monkeypatch):
    """Tables compose runs that differ only in values (seed=, local.lr=, num_clients=, ...) once and set an entry's
    values while reading it; read in any order, what they read must equal real compositions, and when the first
    reused entry of a group does not equal its composition, the table is composed run by run."""
    import dataclasses
    import random
    from fedbench.report import plans as P
    runs = expand_sweep(["experiment=fola/figure3", "profile=quick"])
    fixed = {P.split_values(r, CONF_DIR)[0] for r in runs}
    assert len(runs) == 48 and len(fixed) == 1   # five value axes, one group
    reused = P._compose_sweep(runs, CONF_DIR, reuse=True)
    direct = P._compose_sweep(runs, CONF_DIR, reuse=False)
    assert len({id(e.cfg) for e in reused}) == 1 and all(e.values is None for e in direct)
    order = list(range(len(runs)))
    expected = _read_entries(direct, order)
    assert _read_entries(reused, order) == expected
    random.Random(0).shuffle(order)
    assert _read_entries(reused, order) == expected   # the values set last never leak into the next entry
    assert len({tuple(ids) for _, ids in expected}) == len(runs)   # every run its own ids
    real = P.applied
    monkeypatch.setattr(P, "applied", lambda e: real(dataclasses.replace(e, values=None)))   # a value not set
    assert P._compose_sweep(runs, CONF_DIR, reuse=True) is None
    P.sweep_configs.cache_clear()
    fallback = P.sweep_configs(("experiment=fola/figure3", "profile=quick"), CONF_DIR)
    monkeypatch.setattr(P, "applied", real)
    assert len({id(e.cfg) for e in fallback}) == len(runs) and _read_entries(fallback, order) == expected
    P.sweep_configs.cache_clear()


def test_values_an_aggregators_entry_reads_compose_apart():
    """expand_aggregators resolves an entry's interpolations (mu: ${local.lr}) once per composition, so runs that
    differ in a value it reads get their own composition, while their seeds still share one."""
    from fedbench.report import plans as P
    runs = expand_sweep(["dataset=mnist", "model=mlp_500_300", "aggregators=[fedavg,{name:fedprox,mu:${local.lr}}]",
                         "local.lr=0.1,0.01", "seed=0,1,2"])
    reused = P._compose_sweep(runs, CONF_DIR, reuse=True)
    assert len(runs) == 6 and len({id(e.cfg) for e in reused}) == 2
    order = [5, 0, 3, 1, 4, 2]
    assert _read_entries(reused, order) == _read_entries(P._compose_sweep(runs, CONF_DIR, reuse=False), order)
    for e in reused:
        with P.applied(e) as (cfg, subs):
            assert subs[1].algorithm.mu == cfg.local.lr


def test_value_overrides_that_are_shared_and_those_that_are_not():
    """Only a plain key=value of a key that is no group, outside algorithm/aggregators, set once, with a scalar or
    a list of scalars and no interpolation is set in place; everything else composes."""
    from fedbench.report import plans as P
    ovs = ["experiment=fola/figure3", "dataset=fmnist", "seed=1", "local.lr=0.01", "share_epochs=[1,2]", "+foo=1",
           "algorithm.lam=2", "aggregators=[fedavg]", "x=${seed}", "y={a:1}", "num_clients=5", "num_clients=6",
           "~tags", "profile=reduced"]
    fixed, values = P.split_values(ovs, CONF_DIR)
    assert [o.input_line for o in values] == ["seed=1", "local.lr=0.01", "share_epochs=[1,2]", "profile=reduced"]
    assert list(fixed) == [o for o in ovs if o not in {o.input_line for o in values}]


def test_resolved_run_cache_follows_the_values_and_equals_a_fresh_resolution():
    """A table read twice reuses each shared run's resolved config and run id; the cache is keyed by the config and
    the values ``applied`` set on it, so each entry gets its own resolution and id, equal to resolving the config
    afresh, also for an interpolation that reads a swept key (FedNova's rho: ${local.momentum}); a run config that
    is not shared (a tuned run) is never cached."""
    from omegaconf import OmegaConf
    from fedbench.report import plans as P
    runs = expand_sweep(["dataset=mnist", "model=mlp_500_300", "aggregators=[fedavg,fednova]",
                         "local.momentum=0,0.5,0.9", "seed=0,1"])
    entries = P._compose_sweep(runs, CONF_DIR, reuse=True)
    assert len(entries) == 6 and len({id(e.cfg) for e in entries}) == 1
    P._RESOLVED.clear()
    P._TEMPLATES.clear()
    seen, rhos = {}, set()
    for order in (range(6), reversed(range(6))):   # the second pass reads the cache
        for i in order:
            with P.applied(entries[i]) as (_, subs):
                for sub in subs:
                    c, rid = P.resolved_run(sub, shared=True)
                    assert c == OmegaConf.to_container(sub, resolve=True) and rid == compute_run_id(sub)
                    assert seen.setdefault((i, id(sub)), (id(c), rid)) == (id(c), rid)   # one resolution
                    rhos.add(c["algorithm"].get("rho"))
    assert rhos == {None, 0, 0.5, 0.9} and len({rid for _, rid in seen.values()}) == 12
    assert len(P._TEMPLATES) == 2 and all(t.patch and t.checked for t in P._TEMPLATES.values())   # patched, not full
    tuned = OmegaConf.create(OmegaConf.to_container(entries[0].subs[0]))
    before = len(P._RESOLVED)
    assert P.resolved_run(tuned, shared=False)[1] == compute_run_id(tuned) and len(P._RESOLVED) == before
    P._RESOLVED.clear()
    P._TEMPLATES.clear()


def test_interpolations_that_can_follow_a_value_key():
    """A node is read again when it reads a swept key, a key above or below one, another such node, or anything
    but keys and environment variables (another resolver, a relative key)."""
    from fedbench.report.plans import dependent_interpolations, interpolation_refs
    assert interpolation_refs("${paths.output_root}/cache") == ["paths.output_root"]
    assert interpolation_refs("${oc.env:FEDBENCH_DATA,data}") == [""]
    assert interpolation_refs("${oc.env:A,${b.c}}") == ["b.c", ""]
    assert interpolation_refs("${.x}") == [None] and interpolation_refs("${eval:1}") == [None]
    nodes = {("paths", "a"): "${oc.env:X,y}", ("paths", "b"): "${paths.a}/c", ("algorithm", "rho"): "${local.momentum}",
             ("z",): "${algorithm}", ("w",): "${oc.select:seed}"}
    assert dependent_interpolations(nodes, [("seed",)]) == [("w",)]
    assert dependent_interpolations(nodes, [("local", "momentum")]) == [("algorithm", "rho"), ("z",), ("w",)]
    assert dependent_interpolations(nodes, [("local",)]) == [("algorithm", "rho"), ("z",), ("w",)]
    assert dependent_interpolations(nodes, [("paths",)]) == [("paths", "b"), ("w",)]   # paths.a: read as the key


def test_a_metric_no_record_has_is_one_line_and_writes_nothing(tmp_path):
    from fedbench.errors import FedbenchError
    from fedbench.report.tables import collect
    out, preset = tmp_path / "out", ["experiment=fedlpa/table6", "profile=paper", "dataset=fmnist", "seed=0"]
    for ovs in expand_sweep(preset):
        for sub in expand_aggregators(compose_run(ovs), CONF_DIR, allow_missing=True):
            if sub.algorithm.name == "fedavg":
                write_json_atomic(out / "runs" / compute_run_id(sub) / "metrics.json",
                                  ok_record(compute_run_id(sub), "fedavg", metrics={"accuracy": 50.0, "nll": 1.0}))
    with pytest.raises(FedbenchError, match=r"metric 'nlll' is in none of the 9 finished records.*accuracy, nll"):
        collect(preset, out, tmp_path / "results" / "tables", "nlll")
    assert not (tmp_path / "results").exists()
    assert collect(preset, out, tmp_path / "results" / "tables", "nll", publish=False).is_file()


def test_a_tie_for_first_in_our_printed_means_wins_for_no_method():
    from fedbench.report.tables import score
    # Table 10 on Fashion-MNIST: FedLPA's diverged GD and the baselines all print 10.00; the paper has FedLPA first
    s = pd.DataFrame([{"dataset": "d", "partition": "p", "method": m, "mean": o, "std": 0.0, "n": 3, "paper": p}
                      for m, o, p in [("fedlpa", 10.0, 13.77), ("fedavg", 29.99 / 3, 10.57), ("scaffold", 10.0, 10.17)]])
    failed = score(s, {}, "accuracy")["order_failed"]
    assert [(f["paper_winner"], f["our_winner"]) for f in failed] == [("fedlpa", "fedlpa/fedavg/scaffold")]
    s.loc[0, "mean"] = 10.01                                # one test sample in 10,000 more: a win that shows
    assert score(s, {}, "accuracy")["order_held"] == 1


def test_fedlap_appE5_reads_all_16_paper_cells_from_round_histories(tmp_path):
    """App. E.5 prints the mean and the max of the last 3 rounds at rounds 10 / 25 / 50 and the rounds to 75 / 78 %:
    eight columns per split, each joined to its own reference cell (metric_variant, rounds, threshold)."""
    from fedbench.report.tables import attach_reference
    from fedbench.results.records import write_csv_atomic
    out = tmp_path / "out"
    preset = ["experiment=fedlap/appE5", "profile=paper", "seed=0"]
    curve = [60.0 + 0.5 * r for r in range(1, 51)]   # 60.5 ... 85.0: reaches 75 at round 30, 78 at round 36
    _fake_records(out, preset, lambda c: {"metrics": {"accuracy": curve[-1]},
                                          "summary": {"first_round_accuracy_ge_75": 30, "first_round_accuracy_ge_78": 36}})
    for d in (out / "runs").iterdir():
        write_csv_atomic(d / "history.csv", [{"round": i + 1, "accuracy": a} for i, a in enumerate(curve)],
                         ["round", "accuracy"])
    s = attach_reference(summarise(table_runs(preset, out)), "fedlap", "appE5")
    assert len(s) == 16 and s["paper"].notna().all() and (s["n"] == 1).all()
    homog = lambda col: _cell(s, partition="homog", column=col)   # noqa: E731
    assert homog("mean r10")["mean"] == pytest.approx((64.5 + 64.0 + 65.0) / 3) and homog("mean r10")["paper"] == 74.0
    assert homog("max r25")["mean"] == pytest.approx(72.5) and homog("max r25")["paper"] == 78.2
    assert homog("max r50")["mean"] == pytest.approx(85.0) and homog("max r50")["paper"] == 80.3
    assert homog("first >= 78")["mean"] == 36 and homog("first >= 78")["paper"] == 25.0
    assert _cell(s, partition="heterog", column="first >= 75")["paper"] == 16.0


def test_runs_read_once_reads_a_table_once_within_its_scope(tmp_path, monkeypatch):
    """make tables collects every table, then the scoreboard reads the same sweeps: inside runs_read_once each
    (overrides, output root, record store) is read once, every caller gets its own copy, and outside the scope every
    call reads again (a campaign writes records between calls)."""
    import fedbench.report.tables as tables
    reads = []

    def fake_read(overrides, output_root, conf_dir):
        reads.append((tuple(overrides), str(output_root)))
        df = pd.DataFrame({"method": ["fedavg"], "accuracy": [float(len(reads))]})
        df.attrs["table"] = {"rows": ["dataset"]}
        return df

    monkeypatch.setattr(tables, "_read_table_runs", fake_read)
    monkeypatch.setenv("FEDBENCH_RECORDS", str(tmp_path / "store_a"))
    table_runs(["a=1"], tmp_path)
    table_runs(["a=1"], tmp_path)
    assert len(reads) == 2   # no scope: read every time
    with tables.runs_read_once():
        first = table_runs(["a=1"], tmp_path)
        first.loc[0, "accuracy"] = -1.0   # a caller's change stays in its copy
        first.attrs["table"]["rows"] = ["x"]
        again = table_runs(["a=1"], tmp_path)
        assert len(reads) == 3 and again.loc[0, "accuracy"] == 3.0 and again.attrs["table"] == {"rows": ["dataset"]}
        with tables.runs_read_once():   # a nested scope shares the outer one's reads
            table_runs(["a=1"], tmp_path)
        assert len(reads) == 3
        table_runs(["a=2"], tmp_path)                # other overrides,
        table_runs(["a=1"], tmp_path / "other")      # another output root
        monkeypatch.setenv("FEDBENCH_RECORDS", str(tmp_path / "store_b"))
        table_runs(["a=1"], tmp_path)                # or another record store: read apart
        assert len(reads) == 6
    table_runs(["a=1"], tmp_path)
    assert len(reads) == 7   # the scope closed: read again
