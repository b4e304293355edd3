"""End-to-end: run.py through Hydra on small synthetic data; records, skipping, bad input."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["dataset=synthetic", "dataset.kwargs.like=fmnist", "dataset.kwargs.train_size=600",
         "dataset.kwargs.test_size=200", "model=lenet", "num_clients=3", "rounds=2", "local.epochs=1",
         "hardware=cpu", "progress=false"]


def run(args, tmp_path, expect=0):
    env = {**os.environ, "FEDBENCH_OUTPUTS": str(tmp_path / "out"), "FEDBENCH_DATA": str(tmp_path / "data"),
           "HYDRA_FULL_ERROR": "0"}
    p = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == expect, p.stdout + p.stderr
    return p


def records(tmp_path):
    return sorted((tmp_path / "out" / "runs").glob("*/metrics.json"))


def test_end_to_end_record_history_and_skip(tmp_path):
    p = run(SMALL, tmp_path)
    assert "fedbench: fedavg on synthetic" in p.stdout and "accuracy=" in p.stdout
    (rec_path,) = records(tmp_path)
    rec = json.loads(rec_path.read_text())
    assert rec["status"] == "ok" and rec_path.parent.name == rec["run_id"]
    for key in ("accuracy", "nll", "ece"):
        assert isinstance(rec["metrics"][key], float)
    for key in ("total_s", "client_train_s", "server_s"):
        assert rec["timing"][key] >= 0
    assert rec["timing"]["curvature_s"] == 0.0     # FedAvg computes no curvature
    assert 0 < rec["timing"]["cpu_s"]              # the run's own CPU seconds (a paused or starved run: << total_s)
    assert sum(rec["partition"]["client_sizes"]) == 600 and len(rec["partition"]["client_sizes"]) == 3
    assert [sum(c) for c in rec["partition"]["client_label_counts"]] == rec["partition"]["client_sizes"]
    assert rec["communication"]["uplink_bytes"] == 2 * 3 * 4 * rec["model"]["num_parameters"]
    rows = list(csv.DictReader(open(rec_path.parent / "history.csv")))
    assert [r["round"] for r in rows] == ["1", "2"]
    assert float(rows[-1]["accuracy"]) == pytest.approx(rec["metrics"]["accuracy"])
    # same config again (other hardware/logger keys do not change the id): skipped
    p2 = run(SMALL + ["logger=csv"], tmp_path)
    assert "skipped" in p2.stdout and len(records(tmp_path)) == 1
    # force reruns; the record is rewritten
    run(SMALL + ["force=true"], tmp_path)
    assert len(records(tmp_path)) == 1


def test_zero_epochs_evaluates_initial_model(tmp_path):
    run(SMALL + ["local.epochs=0", "rounds=1"], tmp_path)
    (rec_path,) = records(tmp_path)
    rec = json.loads(rec_path.read_text())
    assert rec["status"] == "ok" and 0 <= rec["metrics"]["accuracy"] <= 100


@pytest.mark.parametrize("args,needle", [
    (["dataset=imagenet22k"], "unknown dataset 'imagenet22k'"),
    (["algorithm=fedmagic"], "unknown algorithm 'fedmagic'"),
    (["partition.beta=0"], "beta"),
    (["partition=noniid-label_k", "partition.k=11"], "k"),
    (["num_clients=100000"], "clients"),
    (["local.lr=-1"], "local.lr"),
    (["hardware.device=cuda:7"], "device"),
    (["hardware.num_threads=0"], "num_threads"),
    (["dataset.normalize={mean:[0.5],std:[0]}"], "dataset.normalize"),
    (["dataset.normalize={mean:[0.5,0.5,0.5],std:[0.5,0.5,0.5]}"], "channel"),   # FMNIST-like data: 1 channel
])
def test_bad_input_one_line_no_record(tmp_path, args, needle):
    p = run(SMALL + args, tmp_path, expect=2)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedbench: error:") and needle in lines[0], p.stderr
    assert records(tmp_path) == []


def test_aggregator_list_reuses_clients_one_record_each(tmp_path):
    run(SMALL + ["rounds=1", "aggregators=[fedavg,fednova,scaffold]"], tmp_path)
    recs = [json.loads(p.read_text()) for p in records(tmp_path)]
    assert sorted(r["algorithm"] for r in recs) == ["fedavg", "fednova", "scaffold"]
    by = {r["algorithm"]: r for r in recs}
    assert by["fedavg"]["cache"]["misses"] >= 1
    assert by["fednova"]["cache"]["hits"] >= 1 and by["scaffold"]["cache"]["hits"] >= 1
    # one-shot SCAFFOLD == FedAvg (zero control variates), reported from the same clients
    assert by["scaffold"]["metrics"]["accuracy"] == by["fedavg"]["metrics"]["accuracy"]
    # the record of a list entry is the record of the plain run: a plain run is skipped
    p = run(SMALL + ["rounds=1", "algorithm=fednova"], tmp_path)
    assert "skipped" in p.stdout
    p = run(SMALL + ["rounds=1", "aggregators=[fedavg,nosuchalg]"], tmp_path, expect=2)
    assert "not implemented yet" in p.stderr and "nosuchalg" in p.stderr
    p = run(SMALL + ["rounds=1", "aggregators=[fedavg,fednoav]"], tmp_path, expect=2)   # a typo gets a suggestion
    assert "did you mean 'fednova'?" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_curvature_time_is_recorded(tmp_path):
    run(SMALL + ["rounds=1", "algorithm=fedlap_cov", "cache=false"], tmp_path)
    (rec_path,) = records(tmp_path)
    rec = json.loads(rec_path.read_text())
    assert 0 < rec["timing"]["curvature_s"] <= rec["timing"]["client_post_s"]


def test_normalization_values():
    from fedbench.errors import FedbenchError
    from fedbench.run.setup import normalization
    stats = ((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))
    assert normalization(True, stats) == stats and normalization(False, stats) == (None, None)
    assert normalization({"mean": [0.5] * 3, "std": [0.5] * 3}, stats) == ((0.5,) * 3, (0.5,) * 3)   # FOLA Table I
    for bad in ("yes", {"mean": [0.5]}, {"mean": [0.5], "std": [0.5, 0.5]}, {"mean": ["a"], "std": [1]},
                {"mean": [0.5], "std": [-1]}):
        with pytest.raises(FedbenchError, match="dataset.normalize"):
            normalization(bad, stats)


def test_custom_normalization_is_recorded_and_changes_the_run_id(tmp_path):
    run(SMALL + ["rounds=1", "local.epochs=0"], tmp_path)
    run(SMALL + ["rounds=1", "local.epochs=0", "dataset.normalize={mean:[0.5],std:[0.5]}"], tmp_path)
    recs = [json.loads(r.read_text()) for r in records(tmp_path)]
    assert len({r["run_id"] for r in recs}) == 2
    assert {str(r["config"]["dataset"]["normalize"]) for r in recs} == {"True", "{'mean': [0.5], 'std': [0.5]}"}
