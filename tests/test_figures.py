"""Accuracy-over-rounds figures from synthetic run records (the same run selection as the tables)."""
import pytest

from fedbench.errors import FedbenchError
from fedbench.launch.sweep import CONF_DIR, compose_run, expand_sweep
from fedbench.results.figures import plot_table, round_curves
from fedbench.results.records import compute_run_id, write_csv_atomic, write_json_atomic
from fedbench.runner import expand_aggregators

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
            write_json_atomic(out / "runs" / rid / "metrics.json", {"run_id": rid, "status": "ok", "metrics": {}})


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


def test_plot_without_runs_is_one_clear_error(tmp_path):
    with pytest.raises(FedbenchError, match="no finished runs"):
        plot_table(PRESET, tmp_path / "none", tmp_path / "figs")
