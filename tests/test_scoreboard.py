"""Committed records, stale numerics in tables, `make tables` from a fresh clone, and the scoreboard."""
import re
from pathlib import Path

import pandas as pd
import pytest

from fedbench import numerics
from fedbench.errors import FedbenchError
from fedbench.launch.sweep import CONF_DIR, compose_run, expand_sweep
from fedbench.results.records import compute_run_id, write_csv_atomic, write_json_atomic
from fedbench.report.scoreboard import (FIGURE, _claim_status, claim_cells, collection_summaries, load_campaign, plot_scoreboard,
                                        render, scoreboard_cells)
from fedbench.report.tables import COLLECTIONS, collect, read_collections, runs_read_once, score, summarise
from fedbench.config.aggregators import expand_aggregators
from tests.conftest import ok_record

ROOT = Path(__file__).resolve().parents[1]
TABLE = ["experiment=fedfisher/table2", "profile=paper", "dataset=fmnist", "model=lenet", "partition.alpha=0.1",
         "seed=0,1,2"]
ACC = {"fedavg": 40.0, "fedfisher_kfac": 68.0, "fedfisher_diag": 55.0}


def _write_records(out: Path, stale_seed=None):
    for ovs in expand_sweep(TABLE):
        for sub in expand_aggregators(compose_run(ovs), CONF_DIR):
            name = sub.algorithm.name
            if name not in ACC:
                continue
            rid = compute_run_id(sub)
            rec = ok_record(rid, name, metrics={"accuracy": ACC[name] + sub.seed})
            if stale_seed is not None and sub.seed == stale_seed:
                rec["numerics"] = {"core": numerics.CORE - 1, "method": 1}   # made by older arithmetic
            write_json_atomic(out / "runs" / rid / "metrics.json", rec)
            write_csv_atomic(out / "runs" / rid / "history.csv", [{"round": 1, "accuracy": ACC[name] + sub.seed}])


def test_stale_records_are_left_out_of_cells_and_counted(tmp_path):
    _write_records(tmp_path / "out", stale_seed=2)
    md = collect(TABLE, tmp_path / "out", tmp_path / "tables", publish=False).read_text()
    # seeds 0 and 1 only: 68.5 ± 0.71 for K-FAC, and the stale seed-2 record is announced, never averaged in
    assert "68.50 ± 0.71 (+1 stale) / 68.36 / Δ +0.14 ✓" in md
    assert "**n = 2** seed(s)" in md and "paper n = 5" in md


def test_collect_publishes_records_and_make_tables_regenerates_from_them(tmp_path, monkeypatch):
    store = tmp_path / "committed"
    monkeypatch.setenv("FEDBENCH_RECORDS", str(store))
    _write_records(tmp_path / "out")
    results = tmp_path / "results"
    first = collect(TABLE + ["hardware=cpu", "progress=false"], tmp_path / "out", results / "tables").read_text()
    assert len(list(store.glob("*/metrics.json"))) == 9 and not list(store.glob("*/*.pt"))
    (entry,) = read_collections(results / COLLECTIONS)
    assert entry["name"] == "fedfisher_table2" and entry["profile"] == "paper"
    assert "hardware=cpu" not in entry["overrides"] and "progress=false" not in entry["overrides"]
    # `make tables` names the records it reads from outside the store: none once published, all before
    seen = []
    collect(TABLE, tmp_path / "out", tmp_path / "t2", publish=False, unpublished=seen)
    assert seen == []
    monkeypatch.setenv("FEDBENCH_RECORDS", str(tmp_path / "empty_store"))
    seen = []
    collect(TABLE, tmp_path / "out", tmp_path / "t3", publish=False, unpublished=seen)
    assert len(seen) == 9
    monkeypatch.setenv("FEDBENCH_RECORDS", str(store))
    # a fresh clone: no outputs/, only the committed store
    again = collect(entry["overrides"], tmp_path / "empty", tmp_path / "again", publish=False).read_text()
    assert again == first and "69.00 ± 1.00 / 68.36 / Δ +0.64 ✓" in again


def test_score_counts_cells_and_row_winners():
    s = pd.DataFrame([
        {"dataset": "fmnist", "partition": "a", "method": "x", "n": 3, "mean": 70.0, "std": 1.0, "paper": 69.0},
        {"dataset": "fmnist", "partition": "a", "method": "y", "n": 3, "mean": 60.0, "std": 1.0, "paper": 50.0},
        {"dataset": "fmnist", "partition": "b", "method": "x", "n": 3, "mean": 50.0, "std": 1.0, "paper": 69.0},
        {"dataset": "fmnist", "partition": "b", "method": "y", "n": 3, "mean": 60.0, "std": 1.0, "paper": 61.0},
        {"dataset": "fmnist", "partition": "b", "method": "z", "n": 0, "mean": float("nan"), "std": 0.0, "paper": 1.0},
    ])
    sc = score(s, {"rows": ["dataset", "partition"]})
    assert (sc["paper_cells"], sc["run"], sc["within"]) == (5, 4, 2)
    assert [(o["partition"], o["method"]) for o in sc["outside"]] == [("a", "y"), ("b", "x")]
    assert (sc["rows"], sc["order_held"]) == (2, 1)
    assert sc["order_failed"] == [{"row": "fmnist/b", "paper_winner": "x", "our_winner": "y"}]


def test_claims_hold_only_when_every_row_agrees():
    s = pd.DataFrame([
        {"dataset": "d", "partition": "a", "method": "w", "n": 3, "mean": 70.0},
        {"dataset": "d", "partition": "a", "method": "l", "n": 3, "mean": 60.0},
        {"dataset": "d", "partition": "b", "method": "w", "n": 3, "mean": 50.0},
        {"dataset": "d", "partition": "b", "method": "l", "n": 3, "mean": 55.0},
    ])
    colls = {"t": {"summary": s, "meta": {"rows": ["dataset", "partition"]}}}
    assert _claim_status({"collection": "t", "winner": "w", "loser": "l"}, colls) == \
        ("not reproduced", "1/2 rows (fails: d/b)")
    assert _claim_status({"collection": "t", "winner": "w", "loser": "l", "where": {"partition": "a"}}, colls)[0] == \
        "reproduced"
    assert _claim_status({"collection": "missing", "winner": "w", "loser": "l"}, colls)[0] == "not run"
    # fewer than the paper's seeds for either method in a compared row: the claim's detail says provisional
    meta3 = {"rows": ["dataset", "partition"], "profiles": {"paper": {"sweep": {"seed": [0, 1, 2]}}}}
    full = s.assign(n=3)
    assert _claim_status({"collection": "t", "winner": "w", "loser": "l", "where": {"partition": "a"}},
                         {"t": {"summary": full, "meta": meta3}}) == ("reproduced", "1/1 rows")
    full.loc[0, "n"] = 2
    assert _claim_status({"collection": "t", "winner": "w", "loser": "l", "where": {"partition": "a"}},
                         {"t": {"summary": full, "meta": meta3}}) == \
        ("reproduced", "1/1 rows; provisional: fewer than 3 seeds in 1 of 1 rows")
    # a lead that does not show at the tables' two decimals is a tie, not a win (10.00 against 10.00, 9.99, 10.00)
    tie = s.assign(mean=[10.0, 29.99 / 3, 50.0, 55.0])
    assert _claim_status({"collection": "t", "winner": "w", "loser": "l", "where": {"partition": "a"}},
                         {"t": {"summary": tie, "meta": meta3}}) == ("not reproduced", "0/1 rows (fails: d/a)")
    # the means are read as printed, as a row's winner is: 10.004 against 9.996 prints 10.00 against 10.00, a tie,
    # though the lead itself rounds to 0.01
    tie = s.assign(mean=[10.004, 9.996, 50.0, 55.0])
    assert _claim_status({"collection": "t", "winner": "w", "loser": "l", "where": {"partition": "a"}},
                         {"t": {"summary": tie, "meta": meta3}}) == ("not reproduced", "0/1 rows (fails: d/a)")
    assert score(tie.assign(paper=[12.0, 11.0, 50.0, 55.0]), meta3, "accuracy")["order_failed"][0]["our_winner"] == "w/l"
    # a loss (the collection's metric is nll): the winner must have the lower mean
    colls["t"]["metric"] = "nll"
    assert _claim_status({"collection": "t", "winner": "w", "loser": "l"}, colls) == \
        ("not reproduced", "1/2 rows (fails: d/a)")


def test_a_claim_against_a_list_of_losers_needs_the_winner_ahead_of_each():
    # "FedLPA is highest in round 1": one claim against every other series; a row counts once, however many of the
    # listed losers ran in it, and fails naming the ones the winner is not ahead of (a tie is not a lead)
    s = pd.DataFrame([
        {"dataset": "d", "rounds": 1, "method": "w", "n": 3, "mean": 70.0},
        {"dataset": "d", "rounds": 1, "method": "a", "n": 3, "mean": 60.0},
        {"dataset": "d", "rounds": 1, "method": "b", "n": 3, "mean": 69.0},
        {"dataset": "d", "rounds": 50, "method": "w", "n": 3, "mean": 90.0},
        {"dataset": "d", "rounds": 50, "method": "a", "n": 3, "mean": 95.0},
        {"dataset": "d", "rounds": 50, "method": "b", "n": 3, "mean": 90.0},
        {"dataset": "d", "rounds": 50, "method": "c", "n": 3, "mean": 80.0},
    ])
    colls = {"t": {"summary": s, "meta": {"rows": ["dataset", "rounds"]}}}
    claim = {"collection": "t", "winner": "w", "loser": ["a", "b", "c"]}
    assert _claim_status({**claim, "where": {"rounds": [1]}}, colls) == ("reproduced", "1/1 rows")
    assert _claim_status(claim, colls) == ("not reproduced", "1/2 rows (fails: d/50: not ahead of a + b)")
    assert _claim_status({**claim, "loser": ["c"]}, colls) == ("reproduced", "1/1 rows")   # c ran in round 50 only
    assert _claim_status({**claim, "loser": ["x"]}, colls) == ("not run", "no row has both methods")
    # the list form of one loser is the plain claim
    assert _claim_status({**claim, "loser": ["a"]}, colls)[0] == _claim_status({**claim, "loser": "a"}, colls)[0]


def test_significant_claims_need_a_gap_beyond_two_standard_errors():
    def coll(w, lo):
        return {"t": {"summary": pd.DataFrame([
            {"dataset": "d", "method": "w", "n": 3, "mean": w[0], "std": w[1]},
            {"dataset": "d", "method": "l", "n": 3, "mean": lo[0], "std": lo[1]}]), "meta": {"rows": ["dataset"]}}}
    claim = {"collection": "t", "winner": "w", "loser": "l", "significant": True}
    # 2 * sqrt(0.3^2/3 + 0.3^2/3) = 0.49: a 0.3-point lead is noise, a 0.6-point lead is not
    assert _claim_status(claim, coll((98.3, 0.3), (98.0, 0.3)))[0] == "not reproduced"
    assert _claim_status({**claim, "significant": False}, coll((98.3, 0.3), (98.0, 0.3)))[0] == "reproduced"
    assert _claim_status(claim, coll((98.6, 0.3), (98.0, 0.3)))[0] == "reproduced"
    assert _claim_status(claim, coll((98.6, float("nan")), (98.0, float("nan"))))[0] == "reproduced"   # one seed: std 0


def _along(means, stds, n=10):
    return pd.DataFrame([{"dataset": "d", "width": w, "method": "m", "n": n, "mean": m, "std": sd}
                         for w, m, sd in zip((16, 64, 256, 1024), means, stds)])


def test_monotone_claims_forgive_only_steps_within_noise():
    claim = {"collection": "t", "method": "m", "along": "width", "direction": "decreasing"}
    meta = {"rows": ["dataset", "width"]}

    def status(means, stds, **kw):
        return _claim_status({**claim, **kw}, {"t": {"summary": _along(means, stds), "meta": meta}})

    assert status([4.0, 3.0, 2.0, 1.0], [0.1] * 4) == \
        ("reproduced", "1/1 rows; 4 values of width, n = 10–10, 3 of 3 steps decreasing")
    # a rise of 0.05 with 2 combined SE = 2 * sqrt(2 * 0.1² / 10) ≈ 0.089 is noise; a rise of 0.5 is not
    assert status([4.0, 3.0, 3.05, 1.0], [0.1] * 4)[0] == "reproduced"
    assert status([4.0, 3.0, 3.5, 1.0], [0.1] * 4) == \
        ("not reproduced", "0/1 rows (fails: d); 4 values of width, n = 10–10, 2 of 3 steps decreasing")
    # the means must end lower than they start, whatever the noise
    assert status([1.0, 1.01, 1.0, 1.02], [5.0] * 4)[0] == "not reproduced"
    assert status([1.0, 2.0, 3.0, 4.0], [0.1] * 4, direction="increasing")[0] == "reproduced"
    # widths are ordered as numbers, not as text ("1024" < "16")
    shuffled = _along([4.0, 3.0, 2.0, 1.0], [0.1] * 4).iloc[[3, 0, 2, 1]]
    assert _claim_status(claim, {"t": {"summary": shuffled, "meta": meta}})[0] == "reproduced"
    with pytest.raises(FedbenchError, match="direction must be one of"):
        status([4.0, 3.0, 2.0, 1.0], [0.1] * 4, direction="down")
    # a value with one seed has no standard error: it is left out of the shape, and said so
    one = _along([4.0, 3.0, 2.0, 1.0], [0.1] * 4)
    one.loc[3, ["mean", "n", "std"]] = [9.0, 1, float("nan")]
    assert _claim_status(claim, {"t": {"summary": one, "meta": meta}}) == \
        ("reproduced", "1/1 rows; 3 values of width, n = 10–10, 2 of 2 steps decreasing; 1 value(s) with one seed left out")
    # a group with a single value that ran 2+ seeds has no shape yet: left out, and with no other group, not run
    two = pd.concat([one, _along([5.0, 3.0, 2.0, 1.0], [0.1] * 4).assign(dataset="e").iloc[[0]]])
    assert _claim_status(claim, {"t": {"summary": two, "meta": meta}}) == \
        ("reproduced", "1/1 rows; 3 values of width, n = 10–10, 2 of 2 steps decreasing; 1 row(s) with one value of "
                       "width left out; 1 value(s) with one seed left out")
    assert _claim_status(claim, {"t": {"summary": two[two["dataset"] == "e"], "meta": meta}}) == \
        ("not run", "no group with 2 or more values of width that ran m with 2 or more seeds")


def test_monotone_claims_leave_out_values_still_running_their_seeds():
    # FedFisher Fig. 1a: widths 16-1024 at 50 seeds, the two widest at 10 while the campaign runs them; a mean
    # over 10 other draws (here far above, beyond noise) must not be read as a rise, nor hide a real one
    claim = {"collection": "t", "method": "m", "along": "width", "direction": "decreasing"}
    meta = {"rows": ["dataset", "width"]}
    s = _along([4.0, 3.0, 2.0, 5.0], [0.1] * 4, n=50)
    s.loc[3, "n"] = 10
    assert _claim_status(claim, {"t": {"summary": s, "meta": meta}}) == \
        ("reproduced", "1/1 rows; 3 values of width, n = 50–50, 2 of 2 steps decreasing; width 1024 (n = 10 of 50) "
                       "left out until it has its row's seeds")
    # the seeds the paper ran are judged on the values compared, not on the one left out
    detail = _claim_status({**claim, "paper_seeds": 50}, {"t": {"summary": s, "meta": meta}})[1]
    assert detail.endswith("left out until it has its row's seeds")
    # once it has them, it counts, and here it breaks the fall
    s.loc[3, "n"] = 50
    assert _claim_status(claim, {"t": {"summary": s, "meta": meta}})[0] == "not reproduced"
    # a real rise among the values with every seed is still caught while another value runs
    s = _along([4.0, 5.0, 2.0, 1.0], [0.1] * 4, n=50)
    s.loc[2, "n"] = 10
    assert _claim_status(claim, {"t": {"summary": s, "meta": meta}})[0] == "not reproduced"
    # two values still running are named together, in the plural
    s = _along([4.0, 3.0, 2.0, 1.0], [0.1] * 4, n=50)
    s.loc[[2, 3], "n"] = [10, 9]
    assert _claim_status(claim, {"t": {"summary": s, "meta": meta}})[1].endswith(
        "width 256 (n = 10 of 50), 1024 (n = 9 of 50) left out until they have their row's seeds")


def test_falls_then_rises_claims_need_an_interior_minimum_beyond_noise():
    claim = {"collection": "t", "method": "m", "along": "width", "direction": "falls_then_rises"}
    meta = {"rows": ["dataset", "width"]}

    def status(means, stds):
        return _claim_status(claim, {"t": {"summary": _along(means, stds), "meta": meta}})

    assert status([4.0, 1.0, 2.0, 3.0], [0.1] * 4) == \
        ("reproduced", "1/1 rows; 4 values of width, n = 10–10, lowest at width = 64")
    # monotone either way is not a U: the lowest point must be interior
    assert status([4.0, 3.0, 2.0, 1.0], [0.1] * 4)[0] == "not reproduced"
    assert status([1.0, 2.0, 3.0, 4.0], [0.1] * 4)[0] == "not reproduced"
    # both ends must sit above the minimum beyond 2 combined SE (here 2 * sqrt(2 * 1² / 10) ≈ 0.89)
    assert status([1.5, 1.0, 2.0, 3.0], [1.0] * 4)[0] == "not reproduced"
    assert status([3.0, 1.0, 2.0, 3.0], [1.0] * 4)[0] == "reproduced"
    # a fall after the minimum beyond noise breaks it (a second dip); one within noise does not
    assert status([4.0, 1.0, 3.0, 1.5], [0.1] * 4)[0] == "not reproduced"
    assert status([4.0, 1.0, 3.0, 2.95], [0.1] * 4)[0] == "reproduced"
    # as does a rise before it
    assert _claim_status(claim, {"t": {"summary": pd.DataFrame(
        [{"dataset": "d", "width": w, "method": "m", "n": 10, "mean": m, "std": 0.1}
         for w, m in zip((1, 2, 4, 8, 16), (3.0, 4.0, 1.0, 2.0, 3.0))]), "meta": meta}})[0] == "not reproduced"


def test_scoreboard_figure_marks_each_cell(tmp_path):
    cells = pd.DataFrame([
        {"paper": "p", "table": "table1", "collection": "p_table1", "cell": "a", "method": "x", "metric": "accuracy",
         "ours": 70.0, "n": 3, "never": 0, "paper_value": 71.0, "all_seeds": True, "within": True},
        {"paper": "p", "table": "table1", "collection": "p_table1", "cell": "b", "method": "x", "metric": "accuracy",
         "ours": 50.0, "n": 1, "never": 0, "paper_value": 60.0, "all_seeds": False, "within": False},
        {"paper": "p", "table": "table3", "collection": "p_table3", "cell": "a", "method": "x",
         "metric": "rounds_to_acc", "ours": None, "n": 0, "never": 2, "paper_value": 9.0, "all_seeds": False,
         "within": False}])
    png = plot_scoreboard(cells, tmp_path / "scoreboard.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    back = pd.read_csv(tmp_path / "scoreboard_data.csv")
    assert list(back["within"]) == [True, False, False] and back["ours"].isna().tolist() == [False, False, True]


def test_committed_tables_and_scoreboard_are_regenerated_from_committed_records(tmp_path, monkeypatch):
    """Each table listed in results/collections.yaml equals what collect makes from results/records alone, and
    results/REPRODUCTION.md is what `make tables` makes from them (regenerate it if this fails). One test, not two:
    the scoreboard reads the tables' sweeps again, and in one process it reuses their records (runs_read_once);
    pytest-xdist would otherwise put the two on different workers."""
    monkeypatch.setenv("FEDBENCH_RECORDS", str(ROOT / "results" / "records"))
    with runs_read_once():   # as `make tables`: the scoreboard reads the tables' sweeps again
        _check_committed_tables(tmp_path)


def _check_committed_tables(tmp_path):
    entries = read_collections(ROOT / "results" / COLLECTIONS)
    assert entries, "no committed collections"
    for e in entries:
        path = collect(e["overrides"], tmp_path / "no_outputs", tmp_path / "tables", e.get("metric"),
                       suffix=e.get("suffix"), publish=False)
        assert path.read_text() == (ROOT / "results" / "tables" / path.name).read_text(), path.name
    listed = {f"{e['name']}.md" for e in entries}
    on_disk = {p.name for p in (ROOT / "results" / "tables").glob("*.md")}
    assert on_disk <= listed, f"tables not made from committed records: {sorted(on_disk - listed)}"
    committed = (ROOT / "results" / "REPRODUCTION.md").read_text()
    colls = collection_summaries(ROOT / "results", tmp_path / "no_outputs")
    assert render(ROOT / "results", tmp_path / "no_outputs", colls) == committed
    # the figure's data, cell by cell, counts what the scoreboard counts
    cells = scoreboard_cells(colls, load_campaign(ROOT / "results").get("verdicts"))
    data = ROOT / "results" / FIGURE.replace(".png", "_data.csv")
    assert cells.to_csv(index=False) == data.read_text()
    total = committed.split("| **all** |")[1].split("\n")[0].split("|")
    run, full, within, outside = (int(total[k]) for k in (3, 4, 5, 6))   # paper, on data here, need a GPU, run, ...
    assert (len(cells), int(cells["all_seeds"].sum()), int(cells["within"].sum())) == (run, full, within)
    assert len(cells) - int(cells["within"].sum()) == outside
    # every claim names a committed collection and methods of its table: a misspelt label ("fedprox(mu=1.0)" for
    # "fedprox(mu=1)") would leave the claim "not run" for ever
    for claim in load_campaign(ROOT / "results")["claims"]:
        assert claim["collection"] in colls, claim
        methods = set(colls[claim["collection"]]["summary"]["method"])
        named = [claim["method"]] if "method" in claim else [claim["winner"]] + (
            [claim["loser"]] if isinstance(claim["loser"], str) else list(claim["loser"]))
        assert set(named) <= methods, (claim["text"], sorted(set(named) - methods), sorted(methods))


def test_scoreboard_columns_nest():
    """In every scoreboard row, cells with all seeds and cells within tolerance are among the cells run (cost
    columns, never scored, count nowhere), run cells and cells that need a GPU are among the cells on data here, and
    the line under the table counts the CPU-runnable cells as on data here less those that need a GPU."""
    lines = (ROOT / "results" / "REPRODUCTION.md").read_text().split("## 2. Scoreboard")[1].split("\n## ")[0]
    rows = [ln.split("|")[1:-1] for ln in lines.splitlines() if ln.startswith("| ") and "table |" not in ln]
    assert rows, "no scoreboard rows"
    for cells in rows:
        name, _, here, gpu, run, full, within, outside = (c.strip().strip("*") for c in cells[:8])
        here, gpu, run, full, within, outside = map(int, (here, gpu, run, full, within, outside))
        assert full <= run <= here and within + outside == run and gpu <= here, name
    # here, gpu, run now hold the last row's: **all**
    cpu, cpu_run = map(int, re.search(r"Runnable on this CPU[^*]*\*\*(\d+)\*\* cells, \*\*(\d+)\*\*", lines).groups())
    assert cpu == here - gpu and cpu_run <= min(cpu, run)


def test_cells_that_need_a_gpu_are_dense_and_long_local_training():
    """DENSE at any setting and 50+ local epochs need a GPU; 20 local epochs, a missing epoch count (FedLap's tables)
    or another method do not; FedProx's extra μ in a 50-epoch row count there, not among the CPU cells."""
    from fedbench.report.scoreboard import needs_gpu, paper_cells, setting_variants, table_local_epochs

    assert needs_gpu({"method": "dense", "local_epochs": 10})
    assert needs_gpu({"method": "fedprox(mu=0.1)", "local_epochs": 50})
    assert not needs_gpu({"method": "fedprox(mu=0.1)", "local_epochs": 20})
    assert not needs_gpu({"method": "fedlap_cov"})
    # Table 9's rows do not name the epochs: its one count (200) decides, a row's own count wins
    assert table_local_epochs("fedlpa", "table9") == 200 and table_local_epochs("fedlpa", "table10") is None
    assert needs_gpu({"method": "fedavg"}, 200) and not needs_gpu({"method": "fedavg", "local_epochs": 10}, 200)
    # MNIST, FMNIST here, 6 methods: every cell at 50, 100, 200 epochs (36) and DENSE at 10, 20 (4)
    assert paper_cells("fedlpa", "table10") == (120, 60, 40)
    assert paper_cells("fedlpa", "table5")[2] == 18            # DENSE only (10 local epochs), 9 rows x 2 data sets
    assert paper_cells("fedfisher", "table1") == (10, 0, 0)    # client times: printed, never scored, so never run
    summary = pd.DataFrame([
        {"dataset": "mnist", "partition": "b", "local_epochs": e, "method": m, "n": 0, "mean": None, "paper": 12.0}
        for e in (20, 50) for m in ("fedprox(mu=0.01)", "fedprox(mu=0.1)", "fedprox(mu=1.0)")])
    colls = {"t": {"summary": summary, "meta": {"rows": ["dataset", "partition", "local_epochs"]}}}
    assert setting_variants(["t"], colls) == 4
    assert setting_variants(["t"], colls, gpu=True) == 2 and setting_variants(["t"], colls, gpu=False) == 2


def _verdict_colls():
    """A paper table with two cells outside, and a reading of it whose own runs put one of them within."""
    meta = {"rows": ["dataset", "partition"], "profiles": {"paper": {"sweep": {"seed": [0, 1, 2]}}}}
    main = pd.DataFrame([
        {"dataset": "d", "partition": "a", "method": "fedprox", "n": 3, "mean": 80.0, "std": 0.5, "paper": 70.0},
        {"dataset": "d", "partition": "b", "method": "fedprox", "n": 3, "mean": 81.0, "std": 0.5, "paper": 70.0},
        {"dataset": "d", "partition": "b", "method": "x", "n": 3, "mean": 90.0, "std": 0.5, "paper": 70.0},
        {"dataset": "d", "partition": "c", "method": "x", "n": 3, "mean": 70.5, "std": 0.5, "paper": 70.0}])
    # the reading spells FedProx's parameters out in its label, as the raw-pixel collections do
    read = pd.DataFrame([
        {"dataset": "d", "partition": "a", "method": "fedprox(mu=0.01)", "n": 3, "mean": 71.0, "std": 0.5, "paper": 70.0},
        {"dataset": "d", "partition": "b", "method": "fedprox(mu=0.01)", "n": 3, "mean": 60.0, "std": 0.5, "paper": 70.0}])
    entry = {"suffix": None, "profile": "paper"}
    return {"p_table1": {"meta": {**meta, "paper": "p", "id": "table1"}, "summary": main, "entry": entry,
                         "metric": "accuracy"},
            "p_table1_read": {"meta": {**meta, "paper": "p", "id": "table1"}, "summary": read,
                              "entry": {**entry, "suffix": "read"}, "metric": "accuracy"}}


def test_a_tuned_reading_checks_every_setting_run_apart_against_its_chosen_one(monkeypatch):
    """FedLPA Table 6's FedProx: four mu run apart against the paper's one number; the reading (tuning=on) has one
    bare "fedprox" row per cell, its mu chosen on a hold-out. Every mu's cell is explained exactly where that row is
    within, and a reading that also spells a setting out is never mixed with it."""
    from fedbench.report import scoreboard as sb
    monkeypatch.setattr(sb, "has_reference", lambda paper, table: True)
    meta = {"rows": ["dataset", "partition"], "profiles": {"paper": {"sweep": {"seed": [0, 1, 2]}}}}
    main = pd.DataFrame([{"dataset": "d", "partition": p, "method": f"fedprox(mu={mu})", "n": 3, "mean": m,
                          "std": 0.5, "paper": 70.0}
                         for p, mu, m in (("a", 0.01, 60.0), ("a", 1.0, 20.0), ("b", 0.01, 50.0), ("b", 1.0, 20.0))])
    read = pd.DataFrame([{"dataset": "d", "partition": p, "method": "fedprox", "n": 3, "mean": m, "std": 0.5,
                          "paper": 70.0} for p, m in (("a", 69.0), ("b", 50.0))])
    entry = {"suffix": None, "profile": "paper"}
    colls = {"p_table1": {"meta": {**meta, "paper": "p", "id": "table1"}, "summary": main, "entry": entry,
                          "metric": "accuracy"},
             "p_table1_tuned": {"meta": {**meta, "paper": "p", "id": "table1"}, "summary": read,
                                "entry": {**entry, "suffix": "tuned"}, "metric": "accuracy"}}
    verdicts = [{"paper": "p", "table": "table1", "methods": ["fedprox(*"], "verdict": "reading",
                 "reading": "p_table1_tuned", "anchor": "p-table1"}]
    cells = scoreboard_cells(colls, verdicts).set_index(["cell", "method"])
    assert cells.loc[("d/a", "fedprox(mu=0.01)"), ["verdict", "explained"]].tolist() == ["reading", True]
    assert cells.loc[("d/a", "fedprox(mu=1.0)"), ["verdict", "explained"]].tolist() == ["reading", True]
    assert cells.loc[("d/b", "fedprox(mu=1.0)"), ["verdict", "explained"]].tolist() == ["reading", False]  # 50 vs 70
    assert sb._reading_cell(colls, "p_table1_tuned", "d/a", "fedprox(mu=1.0)") == (69.0, True)
    # a reading row that spells its own setting out is that setting's, not a stand-in for another
    colls["p_table1_tuned"]["summary"] = read.assign(method="fedprox(mu=0.5)")
    assert sb._reading_cell(colls, "p_table1_tuned", "d/a", "fedprox(mu=1.0)") is None


def test_verdicts_sort_cells_outside_and_a_reading_explains_only_where_it_is_within(monkeypatch):
    from fedbench.report import scoreboard as sb
    monkeypatch.setattr(sb, "has_reference", lambda paper, table: True)
    colls = _verdict_colls()
    verdicts = [{"paper": "p", "table": "table1", "cells": "d/b", "methods": ["x"], "verdict": "paper_vs_code",
                 "anchor": "p-table1"},
                {"paper": "p", "table": "table1", "methods": ["fedprox*"], "verdict": "reading",
                 "reading": "p_table1_read", "anchor": "p-table1"}]
    cells = scoreboard_cells(colls, verdicts).set_index(["cell", "method"])
    assert cells.loc[("d/c", "x"), "within"] and cells.loc[("d/c", "x"), "verdict"] == ""
    assert cells.loc[("d/b", "x"), ["verdict", "explained"]].tolist() == ["paper_vs_code", True]
    assert cells.loc[("d/a", "fedprox"), ["verdict", "explained"]].tolist() == ["reading", True]    # 71 vs 70
    assert cells.loc[("d/b", "fedprox"), ["verdict", "explained"]].tolist() == ["reading", False]   # 60 vs 70
    # the first matching entry wins; no entry: untested
    assert scoreboard_cells(colls, verdicts[:1]).set_index(["cell", "method"]).loc[("d/a", "fedprox"),
                                                                                   "verdict"] == "untested"
    lines = "\n".join(sb._gaps(scoreboard_cells(colls, verdicts), colls, verdicts, {"p-table1"}))
    assert "| Paper vs its released code |" in lines and "| **all** | | 3 | 2 |" in lines
    assert "read as [p_table1_read](tables/p_table1_read.md): 71.00 ✓ within" in lines
    assert "read as [p_table1_read](tables/p_table1_read.md): 60.00 ✗ outside" in lines


def test_a_noise_verdict_explains_only_within_the_measured_spread(monkeypatch):
    """The released code's measured spread replaces the paper's ± in the tolerance: Δ = 10 with s = 0.5, n = 3 is
    within 2·sqrt(0.25/3 + 9²/3) = 10.4, not within 2·sqrt(0.25/3 + 8²/3) = 9.3; Δ = 20 is within neither."""
    from fedbench.report import scoreboard as sb
    monkeypatch.setattr(sb, "has_reference", lambda paper, table: True)
    colls = _verdict_colls()
    for spread, explained in ((9.0, True), (8.0, False)):
        verdicts = [{"paper": "p", "table": "table1", "verdict": "noise", "spread": spread, "anchor": "p-table1"}]
        cells = scoreboard_cells(colls, verdicts).set_index(["cell", "method"])
        assert cells.loc[("d/a", "fedprox"), ["verdict", "explained"]].tolist() == ["noise", explained]
        assert cells.loc[("d/b", "x"), ["verdict", "explained"]].tolist() == ["noise", False]
        lines = "\n".join(sb._gaps(scoreboard_cells(colls, verdicts), colls, verdicts, {"p-table1"}))
        assert f"with the released code's spread ± {spread:.2f}: {'✓ within' if explained else '✗ outside'}" in lines


def test_a_threshold_verdict_recounts_each_run_at_the_shifted_threshold(tmp_path, monkeypatch):
    """Three runs whose curves reach 97.5 at round 3, sit at 97.6 until round 10 and reach 98.0 at round 11: the count
    (3 against the paper's 11) is outside; re-counted at 97.5 + 0.3 every run says 11 (explained), at 97.5 + 0.05
    4 (not explained), at 97.5 + 0.7 no run gets there (never: not explained)."""
    from fedbench.report import scoreboard as sb
    monkeypatch.setattr(sb, "has_reference", lambda paper, table: True)
    curve = [90.0, 95.0, 97.5] + [97.6] * 7 + [98.0] * 5
    runs = []
    for seed in range(3):
        d = tmp_path / f"run{seed}"
        write_csv_atomic(d / "history.csv", [{"round": i + 1, "accuracy": a + 0.01 * seed} for i, a in enumerate(curve)])
        runs.append({"dataset": "d", "partition": "a", "column": "97.5", "threshold": 97.5, "method": "fedlap",
                     "status": "ok", "record_dir": str(d), "seed": seed})
    runs.append({**runs[0], "status": "failed", "record_dir": str(tmp_path / "gone")})   # never read
    runs.append({**runs[0], "method": "fedavg", "record_dir": str(tmp_path / "gone")})   # another method's run
    summary = pd.DataFrame([{"dataset": "d", "partition": "a", "column": "97.5", "method": "fedlap", "n": 3,
                             "mean": 3.0, "std": 0.0, "paper": 11.0, "metric": "rounds_to_acc"}])
    meta = {"rows": ["dataset", "partition"], "profiles": {"paper": {"sweep": {"seed": [0, 1, 2]}}},
            "paper": "p", "id": "table3"}
    colls = {"p_table3": {"meta": meta, "summary": summary, "runs": pd.DataFrame(runs),
                          "entry": {"suffix": None, "profile": "paper"}, "metric": "rounds_to_acc"}}
    for shift, mean, explained in ((0.3, "11.00", True), (0.05, "4.00", False), (0.7, "—", False)):
        verdicts = [{"paper": "p", "table": "table3", "methods": ["fedlap"], "verdict": "threshold", "shift": shift,
                     "anchor": "p-table3"}]
        cells = scoreboard_cells(colls, verdicts)
        assert cells[["cell", "within", "verdict", "explained"]].values.tolist() == \
            [["d/a/97.5", False, "threshold", explained]]
        lines = "\n".join(sb._gaps(cells, colls, verdicts, {"p-table3"}))
        assert (f"re-counted at accuracy ≥ {97.5 + shift:g} (shift {shift:+g}): {mean} "
                f"{'✓ within' if explained else '✗ outside'}") in lines


def test_verdict_entries_are_checked_in_one_line():
    from fedbench.report.scoreboard import check_verdicts
    good = {"paper": "p", "table": "t", "verdict": "open", "anchor": "p-t"}
    check_verdicts([good])
    for bad, msg in (({**good, "verdict": "solved"}, "one of paper_vs_code"),
                     ({**good, "anchor": None}, "lacks anchor"),
                     ({**good, "verdict": "reading"}, "goes with verdict 'reading'"),
                     ({**good, "reading": "p_t_read"}, "goes with verdict 'reading'"),
                     ({**good, "verdict": "noise"}, "goes with verdict 'noise'"),
                     ({**good, "spread": 4.0}, "goes with verdict 'noise'"),
                     ({**good, "verdict": "noise", "spread": -1}, "positive number"),
                     ({**good, "verdict": "noise", "spread": "big"}, "positive number"),
                     ({**good, "verdict": "threshold"}, "goes with verdict 'threshold'"),
                     ({**good, "shift": 0.3}, "goes with verdict 'threshold'"),
                     ({**good, "verdict": "threshold", "shift": "up"}, "number of points"),
                     ({**good, "cell": "d/a"}, "unknown keys")):
        with pytest.raises(FedbenchError, match=msg):
            check_verdicts([good, bad])


def test_claim_entries_are_checked_in_one_line_and_their_note_is_printed_beside_the_status():
    from fedbench.report import scoreboard as sb
    good = {"paper": "p", "text": "w beats l", "collection": "t", "winner": "w", "loser": "l"}
    sb.check_claims([good, {**good, "note": "row b won on a technicality"}])
    for bad, msg in (({**good, "collection": None}, "claims\\[1\\] lacks collection"),
                     ({**good, "looser": "l"}, r"unknown keys \['looser'\]"),
                     ({**good, "note": "  "}, "non-empty text"),
                     ({**good, "note": 3}, "non-empty text")):
        with pytest.raises(FedbenchError, match=msg):
            sb.check_claims([good, bad])
    s = pd.DataFrame([{"dataset": "d", "partition": "a", "method": "w", "n": 3, "mean": 70.0},
                      {"dataset": "d", "partition": "a", "method": "l", "n": 3, "mean": 60.0}])
    colls = {"t": {"summary": s, "meta": {"rows": ["dataset", "partition"]}}}
    plain, noted = (sb._claims({"claims": [c]}, colls)[5] for c in (good, {**good, "note": "a | b"}))
    assert plain == "| p | w beats l | t | **reproduced** (1/1 rows) |"
    assert noted == "| p | w beats l | t | **reproduced** (1/1 rows); note: a \\| b |"   # the bar escaped


def test_committed_verdicts_link_to_gaps_and_name_committed_readings():
    """Every verdict's anchor is a section of gaps.md, its reading a committed collection, and every entry matches
    at least one committed cell outside tolerance (a stale entry is removed, not left to match a future cell)."""
    from fedbench.report.scoreboard import _gap_anchors, match_verdict
    plan = load_campaign(ROOT / "results")
    anchors = _gap_anchors(ROOT / "results")
    names = {e["name"] for e in read_collections(ROOT / "results" / COLLECTIONS)}
    data = pd.read_csv(ROOT / "results" / FIGURE.replace(".png", "_data.csv"), keep_default_na=False)
    outside = data[data["within"].astype(str) == "False"]
    for v in plan["verdicts"]:
        assert v["anchor"] in anchors, v
        assert v["verdict"] != "reading" or v["reading"] in names, v
        hits = [r for r in outside.to_dict("records")
                if match_verdict([v], r["paper"], r["table"], r["cell"], r["method"]) is not None]
        assert hits, f"verdict matches no cell outside tolerance: {v}"
    assert "explanation missing" not in (ROOT / "results" / "REPRODUCTION.md").read_text()


def test_setting_variants_count_each_setting_run_apart():
    """FedProx's four μ against one paper FedProx number are four runnable cells: three beyond the paper's one, on
    offline data only (an SVHN row adds none), and a method with one setting adds nothing."""
    from fedbench.report.scoreboard import setting_variants
    summary = pd.DataFrame([
        {"dataset": "mnist", "partition": "beta=0.1", "method": m, "n": 3, "mean": 50.0, "paper": 45.0}
        for m in ("fedavg", "fedprox(mu=0.001)", "fedprox(mu=0.01)", "fedprox(mu=0.1)", "fedprox(mu=1.0)")
    ] + [{"dataset": "svhn", "partition": "beta=0.1", "method": m, "n": 0, "mean": None, "paper": 40.0}
         for m in ("fedprox(mu=0.001)", "fedprox(mu=0.01)")]
      + [{"dataset": "mnist", "partition": "beta=0.5", "method": "fedprox(mu=0.01)", "n": 0, "mean": None, "paper": None}])
    colls = {"t": {"summary": summary, "meta": {"rows": ["dataset", "partition"]}}}
    assert setting_variants(["t"], colls) == 3


def test_setting_variants_count_once_per_column_of_a_multi_column_table():
    """App. D.2: FedDyn's three α against one paper number in each of two columns are 2 + 2 extra cells."""
    from fedbench.report.scoreboard import setting_variants
    summary = pd.DataFrame([
        {"dataset": "uci_credit", "map_delta": 0.0, "column": col, "method": f"feddyn(alpha={a})", "n": 1,
         "mean": 1.0, "paper": 2.0}
        for col in ("rounds to 1%", "MAP test NLL") for a in (1e-3, 1e-4, 1e-5)])
    colls = {"t": {"summary": summary, "meta": {"rows": ["dataset", "map_delta"]}}}
    assert setting_variants(["t"], colls) == 4


def test_best_on_test_over_compares_each_methods_best_cell_of_the_grid():
    # FOLA Fig. 3: per (alpha, N) the best first-round GA over (E, lr) of each method, chosen on the test set as the
    # paper does. w's best beats l's best at alpha = 0.01 though l wins the cell E = 1 / lr 0.1 there
    rows = []
    for alpha, w_cells, l_cells in (("alpha=0.01", (50.0, 70.0, 40.0), (60.0, 55.0, 45.0)),
                                    ("alpha=1", (90.0, 91.0, 92.0), (93.0, 85.0, 80.0))):
        for (e, lr), wm, lm in zip(((1, 0.1), (5, 0.1), (5, 0.01)), w_cells, l_cells):
            rows += [{"partition": alpha, "local_epochs": e, "local.lr": lr, "method": "w", "n": 3, "mean": wm,
                      "std": 0.5},
                     {"partition": alpha, "local_epochs": e, "local.lr": lr, "method": "l", "n": 3, "mean": lm,
                      "std": 0.5}]
    s = pd.DataFrame(rows)
    colls = {"t": {"summary": s, "meta": {"rows": ["partition", "local_epochs", "local.lr"]}}}
    best = {"collection": "t", "winner": "w", "loser": "l", "best_on_test_over": ["local_epochs", "local.lr"]}
    # without the selection every cell is a row of its own: l wins 3 of 6
    assert _claim_status({k: v for k, v in best.items() if k != "best_on_test_over"}, colls)[1].startswith("3/6 rows")
    # best: 70 against 60 at alpha = 0.01, 92 against 93 at alpha = 1
    assert _claim_status(best, colls) == ("not reproduced", "1/2 rows (fails: alpha=1)")
    assert _claim_status({**best, "where": {"partition": ["alpha=0.01"]}}, colls) == ("reproduced", "1/1 rows")
    # along a printed setting ("alpha=0.01" < "alpha=1" as numbers): w's best rises 70 -> 92, l's 60 -> 93
    rise = {"collection": "t", "method": "w", "along": "partition", "direction": "increasing",
            "best_on_test_over": ["local_epochs", "local.lr"]}
    assert _claim_status(rise, colls) == \
        ("reproduced", "1/1 rows; 2 values of partition, n = 3–3, 1 of 1 steps increasing")
    # a loss: the best cell is the lowest
    cells, keys = claim_cells(best, {**colls["t"], "metric": "nll"})
    assert keys == ["partition"]
    assert sorted(cells[cells["method"] == "w"]["mean"]) == [40.0, 90.0]
    with pytest.raises(FedbenchError, match="best_on_test_over names"):
        _claim_status({**best, "best_on_test_over": ["local.batch_size"]}, colls)


def test_best_on_test_over_leaves_out_rows_whose_grid_ran_in_part():
    # FOLA Fig. 3 at N = 20, alpha = 0.01 after 2 of the 3 settings: the best over the settings that ran first is not
    # the paper's selection, so the row counts for no claim until its grid is complete (here it would fail one:
    # w 50 / 40 against l 60 / 45, while w's third, not yet run setting may win)
    rows = []
    for alpha, w_cells, l_cells in (("alpha=0.01", (50.0, 70.0, 40.0), (60.0, 55.0, 45.0)),
                                    ("alpha=1", (90.0, 91.0, 92.0), (93.0, 85.0, 80.0))):
        for (e, lr), wm, lm in zip(((1, 0.1), (5, 0.1), (5, 0.01)), w_cells, l_cells):
            n = 0 if (alpha, e, lr) == ("alpha=0.01", 5, 0.1) else 3   # w and l: one cell not run at alpha = 0.01
            rows += [{"partition": alpha, "local_epochs": e, "local.lr": lr, "method": m, "n": n,
                      "mean": mean if n else float("nan"), "std": 0.5 if n else float("nan")}
                     for m, mean in (("w", wm), ("l", lm))]
    colls = {"t": {"summary": pd.DataFrame(rows), "meta": {"rows": ["partition", "local_epochs", "local.lr"]}}}
    best = {"collection": "t", "winner": "w", "loser": "l", "best_on_test_over": ["local_epochs", "local.lr"]}
    note = "1 row(s) left out until their grid of settings has run in full (alpha=0.01)"
    assert _claim_status(best, colls) == ("not reproduced", f"0/1 rows (fails: alpha=1); {note}")
    cells, _ = claim_cells(best, colls["t"])
    assert set(cells["partition"]) == {"alpha=1"}
    # only the partly run row asked for: not run, and the detail says why
    assert _claim_status({**best, "where": {"partition": ["alpha=0.01"]}}, colls) == \
        ("not run", f"no row has both methods; {note}")
    # a row the claim does not ask for is not named
    assert _claim_status({**best, "where": {"partition": ["alpha=1"]}}, colls) == \
        ("not reproduced", "0/1 rows (fails: alpha=1)")
    # a third method partly run there does not leave the row out of a claim on w and l once their grids are whole
    s = colls["t"]["summary"]
    s.loc[s["n"] == 0, "method"] = "x"
    s = pd.concat([s, pd.DataFrame([{"partition": "alpha=0.01", "local_epochs": 1, "local.lr": 0.1, "method": "x",
                                     "n": 3, "mean": 99.0, "std": 0.5}])], ignore_index=True)
    assert _claim_status(best, {"t": {**colls["t"], "summary": s}}) == \
        ("not reproduced", "0/2 rows (fails: alpha=0.01, alpha=1)")


def test_best_on_test_over_compares_means_over_the_same_seeds():
    # a sweep stopped half-way through seed 1: w's E = 1 cell has seeds 0-1 (50, 90), its E = 5 cell seed 0 (60).
    # The seed-1 draw alone would make E = 1 w's best (70 > l's 65); over seed 0, the complete seed, w's best is
    # 60 and l (65, over both of its complete seeds) wins
    runs = pd.DataFrame([{"partition": "alpha=0.01", "local_epochs": e, "method": m, "seed": sd, "status": "ok",
                          "accuracy": a}
                         for m, e, sd, a in (("w", 1, 0, 50.0), ("w", 5, 0, 60.0), ("w", 1, 1, 90.0),
                                             ("l", 1, 0, 65.0), ("l", 1, 1, 65.0), ("l", 5, 0, 62.0), ("l", 5, 1, 62.0))]
                        + [{"partition": "alpha=0.01", "local_epochs": 5, "method": "w", "seed": 1,
                            "status": "missing", "accuracy": None}])
    meta = {"rows": ["partition", "local_epochs"]}
    runs.attrs["table"] = meta
    summary = summarise(runs, "accuracy")
    claim = {"collection": "t", "winner": "w", "loser": "l", "best_on_test_over": ["local_epochs"]}
    # the summary alone compares the two-seed mean 70 with 65
    assert _claim_status(claim, {"t": {"summary": summary, "meta": meta}})[0] == "reproduced"
    cells, _ = claim_cells(claim, {"summary": summary, "meta": meta, "runs": runs})
    assert {(r["method"], r["mean"], r["n"]) for r in cells.to_dict("records")} == {("w", 60.0, 1), ("l", 65.0, 2)}
    assert _claim_status(claim, {"t": {"summary": summary, "meta": meta, "runs": runs}}) == \
        ("not reproduced", "0/1 rows (fails: alpha=0.01)")
