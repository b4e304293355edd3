from tests.conftest import ok_record
import json

from omegaconf import OmegaConf

from fedbench.results.records import compute_run_id, is_complete, read_record, write_csv_atomic, write_json_atomic


def _cfg(**over):
    base = {"seed": 0, "num_clients": 5, "dataset": {"name": "fmnist"}, "local": {"lr": 0.01},
            "hardware": {"device": "cpu"}, "logger": {"name": "none"}, "paths": {"data_root": "data"},
            "force": False, "progress": True}
    base.update(over)
    return OmegaConf.create(base)


def test_run_id_ignores_where_and_how():
    a = compute_run_id(_cfg())
    assert a == compute_run_id(_cfg(hardware={"device": "cuda"}, logger={"name": "wandb"},
                                    paths={"data_root": "/elsewhere"}, force=True, progress=False))
    assert a != compute_run_id(_cfg(seed=1))
    assert a != compute_run_id(_cfg(local={"lr": 0.1}))
    assert len(a) == 12 and int(a, 16) >= 0


def test_run_id_resolves_interpolations():
    assert compute_run_id(_cfg(lr2="${local.lr}")) == compute_run_id(_cfg(lr2=0.01))


def test_atomic_writes_and_corrupt_records(tmp_path):
    p = tmp_path / "r" / "metrics.json"
    write_json_atomic(p, ok_record("x", "fedavg"))
    assert is_complete(p, "x") and not is_complete(p, "y")
    assert [f.name for f in p.parent.iterdir()] == ["metrics.json"]  # no temp files left
    p.write_text('{"run_id": "x", "stat')  # torn file
    assert read_record(p) is None and not is_complete(p)
    write_csv_atomic(tmp_path / "h.csv", [{"round": 1, "accuracy": 50.0}], ["round", "accuracy", "nll"])
    assert (tmp_path / "h.csv").read_text().splitlines() == ["round,accuracy,nll", "1,50.0,"]
    write_json_atomic(p, {"status": "failed"})
    assert json.loads(p.read_text())["status"] == "failed" and not is_complete(p)
