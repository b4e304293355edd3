"""Accuracy-over-rounds figures from synthetic run records (the same run selection as the tables)."""
from tests.conftest import ok_record
import pytest

from fedbench.errors import FedbenchError
from fedbench.launch.sweep import CONF_DIR, compose_run, expand_sweep
from fedbench.report.figures import curve_reference, plot_table, round_curves
from fedbench.results.records import compute_run_id, write_csv_atomic, write_json_atomic
from fedbench.results.reference import load_reference
from fedbench.config.aggregators import expand_aggregators

PRESET = ["experiment=fedlap/table1", "profile=paper", "dataset=uci_credit"]


def _fake(out, seeds=(0, 1)):
    for ovs in expand_sweep(PRESET + [f"seed={','.join(map(str, seeds))}"]):
        cfg = compose_run(ovs)
        for sub in expand_aggregators(cfg, CONF_DIR):
            if sub.algorithm.name not in ("fedavg", "fedlap"):
                continue
            rid = compute_run_id(sub)
            bump = 5.0 if sub.algorithm.name == "fedlap" else 0.0
            hist = [{"round": r, "accuracy": 50.0 + r * 0.5 + bump + sub.seed} for r in range(1, 51)]
            write_csv_atomic(out / "runs" / rid / "history.csv", hist, ["round", "accuracy"])
            write_json_atomic(out / "runs" / rid / "metrics.json", ok_record(rid, sub.algorithm.name, metrics={}))


def test_round_curves_read_histories_of_the_sweep_only(tmp_path):
    out = tmp_path / "out"
    _fake(out)
    (out / "runs" / "stray").mkdir()   # a run of another configuration is never picked up
    write_csv_atomic(out / "runs" / "stray" / "history.csv", [{"round": 1, "accuracy": 1.0}], ["round", "accuracy"])
    df = round_curves(PRESET + ["seed=0,1"], out)
    assert set(df["method"]) == {"fedavg", "fedlap"} and len(df) == 2 * 2 * 50
    r50 = df[(df["round"] == 50) & (df["method"] == "fedlap")]["value"]
    assert sorted(r50) == pytest.approx([80.0, 81.0])
    assert 1.0 not in set(df["value"])


def test_plot_table_writes_png(tmp_path):
    out = tmp_path / "out"
    _fake(out)
    path = plot_table(PRESET + ["seed=0,1"], out, tmp_path / "figs")
    assert path.name == "fedlap_table1_accuracy.png" and path.stat().st_size > 10_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a --name (or tuned) collection of the same preset gets its own figure, never the preset's
    named = plot_table(PRESET + ["seed=0"], out, tmp_path / "figs", suffix="rawpixels")
    assert named.name == "fedlap_table1_rawpixels_accuracy.png" and path.read_bytes() != named.read_bytes()


def test_plot_without_runs_is_one_clear_error(tmp_path):
    with pytest.raises(FedbenchError, match="no finished runs"):
        plot_table(PRESET, tmp_path / "none", tmp_path / "figs")


# --- sweep figures (table.figure.kind: sweep): a metric against a swept setting ----------------------------------
def _fake_final(out, preset, acc_for):
    for ovs in expand_sweep(preset):
        for sub in expand_aggregators(compose_run(ovs), CONF_DIR, allow_missing=True):
            acc = None if sub.algorithm.get("_missing") else acc_for(sub)
            if acc is not None:
                rid = compute_run_id(sub)
                write_json_atomic(out / "runs" / rid / "metrics.json",
                                  ok_record(rid, sub.algorithm.name, metrics={"accuracy": acc}))


def test_sweep_figure_draws_mean_and_std_per_x_with_paper_points(tmp_path):
    import math
    from fedbench.report.figures import plot_sweep_table
    out = tmp_path / "out"
    preset = ["experiment=fedbens/figure4", "profile=paper", "dataset=fmnist", "seed=0,1"]
    acc = lambda c: 80.0 - 5 * abs(math.log10(c.algorithm.temperature) + 1) + 2 * c.seed   # noqa: E731
    _fake_final(out, preset, lambda c: acc(c) - (20 if c.partition.alpha == 0.05 else 0))
    path, drawn = plot_sweep_table(preset, out, tmp_path / "figs")
    assert path.name == "fedbens_figure4_accuracy.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ours = drawn[drawn.source == "ours"]
    assert set(ours.panel) == {"dataset=fmnist, partition=alpha=0.05", "dataset=fmnist, partition=alpha=0.4"}
    assert len(ours) == 2 * 7 and set(ours.x) == {0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0} and (ours.n == 2).all()
    p = ours[(ours.panel.str.endswith("alpha=0.4")) & (ours.x == 10.0)].iloc[0]
    assert p.y == pytest.approx(80 - 10 + 1) and p["std"] == pytest.approx(2 ** 0.5)     # seeds 0, 1: +0 / +2
    p = ours[(ours.panel.str.endswith("alpha=0.05")) & (ours.x == 0.1)].iloc[0]
    assert p.y == pytest.approx(61.0)
    paper = drawn[drawn.source == "paper"].set_index("panel")
    assert paper.loc["dataset=fmnist, partition=alpha=0.05", "y"] == 60.08                # Table 5 at T = 0.1
    assert paper.loc["dataset=fmnist, partition=alpha=0.4", ["x", "y"]].tolist() == [0.1, 84.39]


def test_sweep_figure_lines_per_alpha_and_nested_m_reference(tmp_path):
    from fedbench.report.figures import plot_sweep_table
    out = tmp_path / "out"
    preset = ["experiment=fedbens/figure2", "profile=paper", "dataset=fmnist", "seed=0"]
    _fake_final(out, preset, lambda c: 50.0 + c.algorithm.members + 10 * c.partition.alpha)
    _, drawn = plot_sweep_table(preset, out, tmp_path / "figs")
    assert set(drawn.panel) == {"dataset=fmnist"}                                          # one panel, a line per alpha
    ours = drawn[drawn.source == "ours"]
    assert set(ours.line) == {f"fedbens, partition=alpha={a}" for a in ("0.05", "0.1", "0.2", "0.4")}
    line = ours[ours.line == "fedbens, partition=alpha=0.2"].sort_values("x")
    assert line.x.tolist() == [1, 2, 3, 4, 5] and line.y.tolist() == pytest.approx([53, 54, 55, 56, 57])
    paper = drawn[(drawn.source == "paper") & (drawn.line == "fedbens, partition=alpha=0.05")].sort_values("x")
    assert paper[["x", "y"]].values.tolist() == [[1.0, 57.02], [5.0, 59.89]]             # Table 7 M = 1, Table 1 M = 5
    assert len(drawn[(drawn.source == "paper") & (drawn.line == "fedbens, partition=alpha=0.1")]) == 1   # no Table 7 row


def test_figure_of_a_missing_method_names_it(tmp_path):
    with pytest.raises(FedbenchError, match="not implemented yet: fedmagic"):   # no preset lacks a method now
        plot_table(["experiment=fedfisher/figure1a", "profile=quick", "aggregators=[fedfisher_full,fedmagic]"],
                   tmp_path / "none", tmp_path / "figs")


def test_rounds_figure_tells_variants_apart_by_label_keys(tmp_path):
    out = tmp_path / "out"
    preset = ["experiment=fedlap/figure1", "profile=quick"]
    for ovs in expand_sweep(preset):
        for sub in expand_aggregators(compose_run(ovs), CONF_DIR):
            rid = compute_run_id(sub)
            wd = sub.algorithm.get("weight_decay", 0.0) or 0.0
            write_csv_atomic(out / "runs" / rid / "history.csv",
                             [{"round": r, "accuracy": 90.0 + r - 1e4 * wd} for r in range(1, 6)], ["round", "accuracy"])
            write_json_atomic(out / "runs" / rid / "metrics.json", ok_record(rid, sub.algorithm.name, metrics={}))
    df = round_curves(preset, out)
    assert set(df.method) == {"fedlap(delta=0.1)", "fedlap(delta=1)", "fedlap(delta=0.01)", "feddyn(weight_decay=1e-05)",
                              "feddyn(weight_decay=0.0001)", "feddyn(weight_decay=1e-06)", "feddyn(weight_decay=0)"}
    assert df[(df.method == "feddyn(weight_decay=0.0001)") & (df["round"] == 5)]["value"].tolist() == [94.0]
    assert plot_table(preset, out, tmp_path / "figs").name == "fedlap_figure1_quick_accuracy.png"


def test_figure_presets_share_runs_with_their_tables():
    from fedbench.results.records import compute_run_id

    def ids(preset, extra):
        out = set()
        for ovs in expand_sweep([f"experiment={preset}", "profile=paper", "seed=0"] + extra):
            out |= {compute_run_id(s) for s in expand_aggregators(compose_run(ovs), CONF_DIR, allow_missing=True)}
        return out

    fmnist = ["dataset=fmnist", "partition.alpha=0.05"]
    t1, t5 = ids("fedbens/table1", fmnist), ids("fedbens/table5", fmnist)
    assert len(ids("fedbens/figure2", fmnist) & t1) == 1          # M = 5 = Table 1's Kron run
    assert len(ids("fedbens/figure3", fmnist) & t1) == 2          # + Diag+Full M = 5
    assert len(ids("fedbens/figure4", fmnist) & t5) == 1 and len(ids("fedbens/figure5", fmnist) & t5) == 1
    assert len(ids("fedlap/figure1", []) & ids("fedlap/table1", ["dataset=mnist", "partition=homo"])) == 2


def test_bad_figure_declarations_fail_with_one_line():
    from fedbench.report.figures import figure_spec
    meta = {"paper": "x", "id": "f", "rows": ["dataset", "partition", "M"]}
    for fig, match in [({"kind": "bars"}, "kind"), ({"kind": "sweep", "x": "T"}, "row keys"),
                       ({"kind": "sweep", "x": "M", "lines": ["M"]}, "lines"), ({"kind": "sweep", "x": "M", "col": 1}, "unknown"),
                       ({"kind": "sweep", "x": "M", "reference": [{"table": "table7"}]}, "reference"),
                       ({"kind": "sweep", "x": "M", "log_y": "yes"}, "log_y")]:
        with pytest.raises(FedbenchError, match=match):
            figure_spec({**meta, "figure": fig})
    assert figure_spec({**meta, "figure": {"kind": "sweep", "x": "M", "log_y": True}})["log_y"] is True


def test_curve_reference_draws_one_statistic_per_round():
    # FedLap App. E.5 prints mean and max of the last 3 rounds at rounds 10/25/50, plus rounds-to-accuracy rows
    ref = curve_reference(load_reference("fedlap", "appE5"), "accuracy")
    assert set(ref["metric_variant"]) == {"mean_last3"}
    assert sorted(ref["rounds"].astype(int)) == [10, 10, 25, 25, 50, 50]   # homog and heterog
    assert sorted(ref["mean"])[-1] == 80.1                                 # the mean row, not the max row's 80.3
    # a table with a single statistic keeps every round-carrying row of the metric
    t2 = curve_reference(load_reference("fedlap", "table2"), "accuracy")
    full = load_reference("fedlap", "table2")
    assert len(t2) == len(full[(full["metric"] == "accuracy") & full["rounds"].notna()]) > 0
