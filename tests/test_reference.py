"""The papers' reported numbers (results/reference/*.csv), checked against the notes' tables (§4 of each note)."""
import math

import pandas as pd
import pytest

from fedbench.errors import FedbenchError
from fedbench.results.reference import (FLOAT_COLUMNS, REFERENCE_DIR, REQUIRED_COLUMNS, available_tables,
                                        load_reference)

# (paper, table): (row keys, column keys, rows in the note's table, value columns in the note's table)
SHAPES = {
    **{("fedlpa", t): (["dataset", "partition"], ["method"], 36, 6)
       for t in ("table1", "table5", "table6", "table7", "table8")},
    ("fedlpa", "table2"): (["num_clients", "partition"], ["method"], 18, 6),
    ("fedlpa", "table3"): (["partition"], ["lambda"], 9, 3),
    ("fedlpa", "table4"): (["method"], ["metric"], 6, 2),
    ("fedlpa", "table9"): (["dataset", "partition"], ["method"], 6, 6),
    ("fedlpa", "table10"): (["dataset", "local_epochs"], ["method"], 20, 6),
    ("fedlpa", "table11"): (["method"], ["local_epochs"], 2, 5),
    ("fedlpa", "table12"): (["dataset"], ["method"], 1, 7),
    ("fola", "table1"): (["step"], ["metric"], 5, 1),
    ("fola", "table2"): (["method"], ["metric", "threshold"], 6, 4),
    ("fedfisher", "table1"): (["method"], ["dataset", "metric"], 3, 4),
    ("fedfisher", "table2"): (["dataset", "partition"], ["method"], 12, 8),
    ("fedfisher", "table3"): (["dataset"], ["method"], 4, 7),
    ("fedfisher", "table4"): (["dataset", "s_q"], ["metric"], 4, 1),
    ("fedfisher", "table5"): (["dataset", "s_q", "s_v"], ["metric"], 8, 1),
    ("fedfisher", "table6"): (["server_access"], ["metric"], 3, 1),
    ("fedbens", "table1"): (["partition", "dataset"], ["method"], 16, 7),
    ("fedbens", "table2"): (["num_clients", "dataset"], ["method"], 12, 7),
    ("fedbens", "table3"): (["partition"], ["dataset"], 2, 3),
    ("fedbens", "table4"): (["method"], ["metric_variant"], 6, 3),
    ("fedbens", "table5"): (["partition", "dataset"], ["method"], 6, 2),
    ("fedbens", "table6"): (["partition", "dataset"], ["method"], 6, 2),
    ("fedbens", "table7"): (["partition", "dataset"], ["M"], 6, 2),
    ("fedbens", "table8"): (["partition", "dataset"], ["component"], 6, 3),
    ("fedbens", "table9"): (["partition", "metric_variant"], ["method"], 5, 6),
    ("fedlap", "table1"): (["dataset", "partition", "num_clients", "rounds"], ["method"], 22, 6),
    ("fedlap", "table2"): (["dataset", "partition", "rounds"], ["method"], 14, 6),
    ("fedlap", "table3"): (["dataset", "partition", "threshold"], ["method"], 9, 6),
    ("fedlap", "table4"): (["rounds"], ["method"], 4, 5),
    ("fedlap", "table5"): (["dataset", "partition", "num_clients"], ["method"], 6, 6),
    ("fedlap", "appE5"): (["partition", "metric_variant", "metric"], ["rounds", "threshold"], 6, 5),  # 4 blanks
    ("fedlap", "appD2"): (["map_delta", "method"], ["metric"], 4, 2),   # text only: 6 numbers, 2 blanks
}
# tables whose grid has blanks the paper never printed (not lost cells): their row count
SPARSE = {("fedlap", "appE5"): 16,   # 4 rows x 5 columns; rounds-to-accuracy only on the mean-of-last-3 rows
          ("fedlap", "appD2"): 6}    # rounds to 1 % for FedLap (3 delta) and FedDyn; the MAP's test NLL at delta 1, 0
# Cells that hold no number (lost in the source, "-"/"—", or not applicable), per file.
MISSING = {("fola", "table1"): 5, ("fola", "table2"): 4, ("fedfisher", "table1"): 2, ("fedfisher", "table2"): 9,
           ("fedfisher", "table3"): 3, ("fedbens", "table5"): 6, ("fedlap", "table1"): 2, ("fedlap", "table3"): 9}
VALUE_COLUMNS = {"method_label", "mean", "std", "raw", "note", "delta_vs_feddyn", "scales_with"}

TABLES = available_tables()


def test_every_note_table_has_a_file():
    assert sorted(TABLES) == sorted(SHAPES)
    assert sorted(p.stem for p in REFERENCE_DIR.glob("*.csv")) == sorted(f"{p}_{t}" for p, t in SHAPES)


@pytest.mark.parametrize("paper,table", TABLES)
def test_file_format(paper, table):
    raw = pd.read_csv(REFERENCE_DIR / f"{paper}_{table}.csv", dtype=str, keep_default_na=False)
    cols = list(raw.columns)
    assert cols[:2] == ["paper", "table"]
    for c in REQUIRED_COLUMNS:
        assert c in cols, c
    order = [c for c in cols if c in ("method", "metric", "threshold", "mean", "std", "raw", "note")]
    assert order == [c for c in ("method", "metric", "threshold", "mean", "std", "raw", "note") if c in cols]
    assert (raw["paper"] == paper).all() and (raw["table"] == table).all()
    assert (raw["raw"].str.strip() != "").all(), "raw is never empty"
    assert (raw["method"] != "").all() and (raw["metric"] != "").all()
    for c in FLOAT_COLUMNS:
        if c in raw:
            for v in raw[c]:
                assert v == "" or math.isfinite(float(v)), (c, v)
    # a std is only given together with a mean
    assert not ((raw["mean"] == "") & (raw["std"] != "")).any()
    df = load_reference(paper, table)
    assert df["mean"].dtype == float and df["std"].dtype == float
    assert len(df) == len(raw)


@pytest.mark.parametrize("paper,table", TABLES)
def test_no_duplicate_keys(paper, table):
    df = load_reference(paper, table)
    keys = [c for c in df.columns if c not in VALUE_COLUMNS]
    dup = df[df.duplicated(subset=keys, keep=False)]
    assert dup.empty, dup[keys]


@pytest.mark.parametrize("paper,table", sorted(SHAPES))
def test_shape_matches_the_notes(paper, table):
    row_keys, col_keys, n_rows, n_cols = SHAPES[(paper, table)]
    df = load_reference(paper, table)
    assert df.groupby(row_keys, dropna=False).ngroups == n_rows
    assert df.groupby(col_keys, dropna=False).ngroups == n_cols
    if (paper, table) in SPARSE:
        assert len(df) == SPARSE[(paper, table)]
    else:
        assert len(df) == n_rows * n_cols


@pytest.mark.parametrize("paper,table", TABLES)
def test_missing_cells_are_marked_not_invented(paper, table):
    df = load_reference(paper, table)
    miss = df[df["mean"].isna()]
    assert len(miss) == MISSING.get((paper, table), 0), miss[["raw", "note"]]
    assert miss["note"].notna().all()  # each says why
    assert miss["std"].isna().all()


def cell(paper, table, **keys):
    df = load_reference(paper, table)
    for k, v in keys.items():
        df = df[df[k].astype(str) == str(v)]
    assert len(df) == 1, (paper, table, keys, len(df))
    return df.iloc[0]


def check(paper, table, mean, std=None, raw=None, **keys):
    r = cell(paper, table, **keys)
    if mean is None:
        assert pd.isna(r["mean"])
    else:
        assert r["mean"] == pytest.approx(mean)
    if std is None:
        assert pd.isna(r["std"])
    else:
        assert r["std"] == pytest.approx(std)
    if raw is not None:
        assert r["raw"] == raw
    return r


def test_fedlpa_cells():
    check("fedlpa", "table1", 54.27, 0.38, "54.27±0.38", dataset="fmnist", partition="beta=0.05", method="fedlpa")
    check("fedlpa", "table1", 18.67, 0.41, dataset="fmnist", partition="beta=0.05", method="scaffold")
    r = check("fedlpa", "table1", 47.13, 7.14, "47.13+7.14", dataset="svhn", partition="beta=0.3", method="dense")
    assert "a+b" in r["note"]
    check("fedlpa", "table1", 67.6, 0.40, dataset="mnist", partition="beta=0.3", method="fednova")
    check("fedlpa", "table2", 15.91, 0.01, num_clients=50, partition="beta=0.01", method="fedlpa")
    check("fedlpa", "table2", 74.10, 0.04, num_clients=20, partition="beta=0.5", method="dense")
    check("fedlpa", "table5", 44.33, 0.01, dataset="svhn", partition="beta=1.0", method="fedlpa", local_epochs=10)
    check("fedlpa", "table7", 47.80, 8.91, dataset="svhn", partition="beta=1.0", method="dense", local_epochs=50)
    check("fedlpa", "table8", 29.2, 2.22, dataset="mnist", partition="#C=3", method="fedprox", local_epochs=100)
    check("fedlpa", "table9", 75.30, 0.0, dataset="fmnist", partition="beta=1.0", method="fedlpa", num_clients=5)
    check("fedlpa", "table10", 13.90, 0.11, dataset="svhn", local_epochs=200, method="fednova")
    check("fedlpa", "table4", 2.77, method="fedlpa", metric="mb")
    check("fedlpa", "table4", 4.94, method="scaffold", metric="mb")
    check("fedlpa", "table4", 400, method="dense", metric="minutes")
    check("fedlpa", "table12", 150, raw="150mins", method="fedov")
    check("fedlpa", "table11", 71.0, 0.25, method="fedov", local_epochs=10)


def test_fedlpa_cross_table_identities():
    t1 = load_reference("fedlpa", "table1")
    t1 = t1[(t1.dataset == "fmnist") & (t1.method == "fedlpa")].set_index("partition")
    t3 = load_reference("fedlpa", "table3")
    t3 = t3[t3["lambda"] == "0.001"].set_index("partition")
    assert list(t3.index) == list(t1.index)
    assert (t3["mean"] == t1["mean"]).all() and (t3["std"] == t1["std"]).all()
    # Table 11's FedLPA row = MNIST #C=2 FedLPA of Tables 5/6/7/8/1 (10/20/50/100/200 epochs)
    t11 = load_reference("fedlpa", "table11")
    for t, ep in (("table5", 10), ("table6", 20), ("table7", 50), ("table8", 100), ("table1", 200)):
        a = cell("fedlpa", t, dataset="mnist", partition="#C=2", method="fedlpa")
        b = t11[(t11.method == "fedlpa") & (t11.local_epochs == ep)].iloc[0]
        assert (a["mean"], a["std"]) == (b["mean"], b["std"])


def test_fola_cells():
    check("fola", "table2", 48.57, raw="48.57%", method="fola", metric="accuracy")
    check("fola", "table2", 14.04, method="fedbe", metric="local_accuracy")
    check("fola", "table2", 90, method="fedbe", metric="rounds_to_acc", threshold=40)
    check("fola", "table2", 4, method="fola", metric="rounds_to_acc", threshold=30)
    r = check("fola", "table2", None, raw="-", method="fednova", metric="rounds_to_acc", threshold=30)
    assert "never reached" in r["note"]
    assert cell("fola", "table2", method="scaffold", metric="accuracy")["local_epochs"] == 1
    assert cell("fola", "table1", step=4)["raw"] == "Cutout (n_holes=1, length=16)"


def test_fedfisher_cells():
    r = check("fedfisher", "table2", None, raw="(garbled)", dataset="fmnist", partition="alpha=0.2", method="fedavg")
    assert "garbled" in r["note"]
    check("fedfisher", "table2", 27.03, 0.71, dataset="svhn", partition="alpha=0.05", method="fedavg")
    check("fedfisher", "table2", 76.28, 2.56, dataset="fmnist", partition="alpha=0.2", method="fedfisher_kfac")
    check("fedfisher", "table2", 29.77, 1.05, dataset="cinic10", partition="alpha=0.05", method="fisher_merge")
    check("fedfisher", "table3", 30.54, 0.46, dataset="cifar100", method="fedavg")
    check("fedfisher", "table3", None, dataset="gtsrb", method="fedavg")
    check("fedfisher", "table3", 69.29, 1.72, dataset="gtsrb", method="fedfisher_kfac")
    check("fedfisher", "table1", 23.7, dataset="cifar10", method="fedfisher_diag", metric="seconds")
    check("fedfisher", "table1", 10.3, raw="+10.3%", dataset="fmnist", method="fedfisher_kfac", metric="overhead_pct")
    check("fedfisher", "table4", 56.56, 5.57, dataset="fmnist", s_q=2)
    check("fedfisher", "table5", 47.60, 0.84, dataset="cifar10", s_q=4)
    check("fedfisher", "table5", 68.96, 2.71, dataset="fmnist", s_v="1.5")
    check("fedfisher", "table6", 9.6, 2.9, method="fedfisher_kfac")


def test_fedbens_cells():
    check("fedbens", "table1", 51.43, 0.79, dataset="cifar10", partition="alpha=0.05", method="fedbens")
    r = check("fedbens", "table1", 52.66, 4.04, dataset="svhn", partition="alpha=0.1", method="fisher_merge")
    assert "52,66" in r["note"]
    r = check("fedbens", "table1", 58.13, dataset="average", partition="alpha=0.1", method="regmean")
    assert "56.09" in r["note"]
    check("fedbens", "table2", 59.68, dataset="average", num_clients=40, method="fedbens_diag_full")
    check("fedbens", "table2", 64.99, 5.75, dataset="svhn", num_clients=10, method="dense")
    check("fedbens", "table3", 60.00, 0.75, dataset="cifar10", partition="alpha=0.4")
    r = check("fedbens", "table4", 7.2, method="fedbens", metric_variant="server_runtime")
    assert r["scales_with"] == "M^2" and r["metric"] == "seconds"
    check("fedbens", "table4", 3.65, method="dense", metric_variant="communication")
    check("fedbens", "table5", None, dataset="svhn", partition="alpha=0.4", method="fedfisher_kfac")
    check("fedbens", "table7", 82.75, 1.41, dataset="svhn", partition="alpha=0.4", M="custom")
    check("fedbens", "table8", 68.99, 1.4, dataset="svhn", partition="alpha=0.05", component="max_component")
    check("fedbens", "table9", 716, method="fedbens", metric_variant="communication")
    check("fedbens", "table9", 13.92, 0.54, method="dense", partition="alpha=0.4")
    assert cell("fedbens", "table9", method="fedbens", partition="alpha=0.05")["M"] == 2


def test_fedbens_cross_table_identities():
    t1 = load_reference("fedbens", "table1")
    t6 = load_reference("fedbens", "table6")
    t5 = load_reference("fedbens", "table5")
    t8 = load_reference("fedbens", "table8")
    k = ["dataset", "partition"]
    a = t6[t6.method == "fedfisher_kfac"].set_index(k)[["mean", "std"]].sort_index()
    b = t1[t1.method == "fedfisher_kfac"].set_index(k)[["mean", "std"]].loc[a.index]
    pd.testing.assert_frame_equal(a, b)
    a = t8[t8.component == "ensemble"].set_index(k)[["mean", "std"]].sort_index()
    b = t5[t5.method == "fedbens"].set_index(k)[["mean", "std"]].sort_index()
    pd.testing.assert_frame_equal(a, b)


def test_fedlap_cells():
    r = check("fedlap", "table1", 79.2, 1.8, "79.2(1.8) (↑2.3)", dataset="flamby_heart", rounds=10,
              method="fedlap_cov")
    assert r["delta_vs_feddyn"] == pytest.approx(2.3) and r["num_clients"] == 4
    r = check("fedlap", "table1", 81.3, 0.2, dataset="fmnist", num_clients=100, rounds=25, method="fedlap_cov")
    assert r["delta_vs_feddyn"] == pytest.approx(-0.1)
    check("fedlap", "table1", None, raw="—", dataset="flamby_heart", rounds=20, method="fedlap_func")
    check("fedlap", "table1", 73.5, 1.0, dataset="uci_credit", rounds=10, method="feddyn")
    check("fedlap", "table2", 76.6, 1.5, dataset="cifar10", rounds=10, method="fedlap_func")
    check("fedlap", "table3", 22, 6, "22(6)*", dataset="fmnist", partition="heterog", threshold="78",
          method="fedlap_cov")
    check("fedlap", "table3", None, dataset="cifar10", threshold="75", method="fedavg")
    check("fedlap", "table3", 6, 1, dataset="mnist", partition="homog", threshold="97.5", method="fedavg")
    check("fedlap", "table4", 89.1, 0.7, rounds=100, method="fedlap_cov")
    r = check("fedlap", "table5", 1.5, 0.1, dataset="cifar10", method="fedavg")
    assert r["metric"] == "nll"
    check("fedlap", "appE5", 37, 5, partition="heterog", metric="rounds_to_acc", threshold="78")
    check("fedlap", "appE5", 78.8, 0.2, partition="heterog", metric_variant="max_last3", rounds=50)
    # App. D.2 (text only): the ideal optimum's test NLL at delta = 1 / 0, and FedDyn's 78 rounds to 1 %
    check("fedlap", "appD2", 0.337, None, map_delta=1, metric="map_test_nll", method="fedlap")
    check("fedlap", "appD2", 0.420, None, map_delta=0, metric="map_test_nll", method="feddyn")
    check("fedlap", "appD2", 78, None, map_delta=0, metric="rounds_to_1pct", method="feddyn")


def test_unknown_table_is_one_line_error():
    with pytest.raises(FedbenchError) as e:
        load_reference("fedlpa", "table13")
    msg = str(e.value)
    assert "\n" not in msg and "fedlpa/table1" in msg and "fedlap/appE5" in msg
    with pytest.raises(FedbenchError):
        load_reference("nopaper", "table1")
    assert len(load_reference("fedlpa", "1")) == 216  # "1" is short for "table1"


def test_readme_lists_every_file_with_its_row_count():
    text = (REFERENCE_DIR / "README.md").read_text()
    for paper, table in TABLES:
        n = len(load_reference(paper, table))
        assert f"| `{paper}_{table}.csv` | {n} |" in text, (paper, table)
