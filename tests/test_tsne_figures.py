"""save_model (final / client weights beside the record, not part of the run id) and FedLPA's t-SNE figures
(Figs. 1, 4, 5) drawn from them on tiny synthetic runs."""
from tests.conftest import ok_record
import json
import shutil

import pandas as pd
import pytest
import torch

from fedbench.errors import FedbenchError
from fedbench.launch.sweep import compose_run
from fedbench.models import build_model
from fedbench.papers.fedlpa import tsne
from fedbench.results.records import compute_run_id, is_complete

SMALL = ["dataset=synthetic", "dataset.kwargs.like=mnist", "dataset.kwargs.train_size=300",
         "dataset.kwargs.test_size=100", "model=simple_cnn", "partition=noniid-labeldir", "num_clients=3", "rounds=1",
         "local.epochs=1", "local.batch_size=32", "hardware=cpu", "progress=false"]


def _cfg(tmp, *extra):
    return compose_run(SMALL + [f"paths.output_root={tmp}", f"paths.data_root={tmp}/data", *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """Two saved one-shot runs on the same cached clients (FedAvg, SCAFFOLD) and one without saved weights."""
    from fedbench.runner import execute

    tmp = tmp_path_factory.mktemp("tsne")
    out = {}
    for algo, save in (("fedavg", True), ("scaffold", True), ("fednova", False)):
        cfg = _cfg(tmp, f"algorithm={algo}", f"save_model={str(save).lower()}")
        rec = execute(cfg, tmp / "runs" / compute_run_id(cfg))
        out[algo] = (cfg, rec)
    return tmp, out


def test_save_model_is_not_part_of_the_run_id(tmp_path):
    assert compute_run_id(_cfg(tmp_path, "save_model=true")) == compute_run_id(_cfg(tmp_path))


def test_saved_weights_reproduce_the_recorded_accuracy(runs):
    from fedbench.data import load_dataset
    from fedbench.eval.metrics import evaluate
    from fedbench.train.engine import TrainData

    tmp, out = runs
    cfg, rec = out["fedavg"]
    folder = tmp / "runs" / rec["run_id"]
    assert rec["saved"] == {"model": "model.pt", "clients": "clients.pt"}
    assert json.loads((folder / "metrics.json").read_text())["saved"] == rec["saved"]
    blob = torch.load(folder / "model.pt", weights_only=True)
    model = build_model(blob["model"], input_shape=tuple(blob["input_shape"]), num_classes=blob["num_classes"],
                        **blob["model_kwargs"])
    data = load_dataset("synthetic", tmp / "data", **cfg.dataset.kwargs)
    test = TrainData(data.test_x, data.test_y, data.mean, data.std)
    acc = evaluate(model, blob["params"], test.inputs, data.test_y)["accuracy"]
    assert acc == pytest.approx(rec["metrics"]["accuracy"], abs=1e-9)
    clients = torch.load(folder / "clients.pt", weights_only=True)["params"]
    assert len(clients) == 3 and set(clients[0]) == set(blob["params"])
    # FedAvg's global model is the data-weighted mean of the saved clients
    sizes = rec["partition"]["client_sizes"]
    mean = sum(n * c["fc3.weight"].double() for n, c in zip(sizes, clients)) / sum(sizes)
    assert torch.allclose(mean.float(), blob["params"]["fc3.weight"], atol=1e-5)
    # a record without saved weights is complete, but not for a save_model run (which reruns it)
    _, nosave = out["fednova"]
    path = tmp / "runs" / nosave["run_id"] / "metrics.json"
    assert nosave["saved"] == {} and is_complete(path, nosave["run_id"])
    assert not is_complete(path, nosave["run_id"], need_model=True)
    assert is_complete(folder / "metrics.json", rec["run_id"], need_model=True)


def test_a_predictor_without_weights_counts_as_saved(tmp_path):
    # FedOV without distillation predicts with its vote: nothing to save, and the run must not be redone for it
    from fedbench.results.records import write_json_atomic
    path = tmp_path / "metrics.json"
    write_json_atomic(path, {**ok_record("abc", "fedavg"), "saved": {"model": None}})
    assert is_complete(path, "abc", need_model=True)
    write_json_atomic(path, {**ok_record("abc", "fedavg"), "saved": {"model": "model.pt"}})
    assert not is_complete(path, "abc", need_model=True)   # the file is named but missing


def test_penultimate_features_are_the_input_of_the_last_linear():
    torch.manual_seed(0)
    model = build_model("simple_cnn", input_shape=(1, 28, 28), num_classes=10)
    other = build_model("simple_cnn", input_shape=(1, 28, 28), num_classes=10)   # other weights in the module
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.rand(37, 1, 28, 28)
    feats = tsne.penultimate_features(other, params, x, batch_size=16)
    assert feats.shape == (37, 84)
    with torch.no_grad():
        manual = torch.nn.Sequential(*list(model.children())[:-1])(x)   # up to fc2 + its ReLU
        assert torch.allclose(feats, manual, atol=1e-6)
        assert torch.allclose(model[-1](feats), model(x), atol=1e-5)


def _frame(out, names):
    return pd.DataFrame([{"run_id": out[n][1]["run_id"], "status": "ok", "seed": 0, "algorithm": n, "method": n}
                         for n in names] + [{"run_id": "000000000000", "status": "missing", "seed": 0,
                                             "algorithm": "dense", "method": "dense"}])


def test_tsne_figures_write_png_and_coordinates(runs, tmp_path):
    tmp, out = runs
    meta = {"paper": "fedlpa", "id": "figure1", "title": "t", "tsne": {"points": 40}}
    df = _frame(out, ["fedavg", "scaffold"])
    g = tsne.plot_tsne("tsne_global", df, meta, tmp_path / "g.png", "quick", tmp)
    assert g.is_file() and g.stat().st_size > 0
    data = pd.read_csv(tmp_path / "g_data.csv")
    assert list(data.groupby("panel", sort=False).size()) == [40, 40]
    assert set(data["method"]) == {"FedAvg", "SCAFFOLD"} and data[["x", "y"]].notna().all().all()
    assert data["train_index"].nunique() == 40 and (data["label"] >= 0).all()
    loc = tsne.plot_tsne("tsne_local", df, meta, tmp_path / "l.png", "quick", tmp)
    assert loc.is_file()
    data = pd.read_csv(tmp_path / "l_data.csv")
    assert sorted(data["client"].unique()) == [1, 2, 3] and len(data) == 3 * 40


def test_runs_without_saved_weights_give_one_clear_error(runs, tmp_path):
    tmp, out = runs
    meta = {"paper": "fedlpa", "id": "figure1", "tsne": {"points": 20}}
    with pytest.raises(FedbenchError, match="save_model=true") as e:
        tsne.plot_tsne("tsne_global", _frame(out, ["fedavg", "fednova"]), meta, tmp_path / "g.png", "paper", tmp)
    assert "\n" not in str(e.value) and "(FedNova)" in str(e.value)
    assert not (tmp_path / "g.png").exists()


def test_preset_draws_both_plots_and_asks_for_saved_weights(tmp_path):
    """The preset's records without weights (e.g. Table 1's older runs): plot_preset_figures says what to do."""
    from fedbench.report.figures import plot_preset_figures

    ovs = ["experiment=fedlpa/figure1", "profile=quick"]
    cfg = compose_run(ovs + ["seed=0"])
    assert cfg.save_model is True and list(cfg.table.plots) == ["tsne_global", "tsne_local"]
    df = tsne.preset_runs(ovs, tmp_path)
    assert len(df) == 5
    for rid, algo in zip(df["run_id"], ["fedlpa", "fedavg", "fednova", "scaffold", "fedprox"]):
        (tmp_path / "runs" / rid).mkdir(parents=True)
        (tmp_path / "runs" / rid / "metrics.json").write_text(json.dumps(
            {**ok_record(rid, algo), "config": {"algorithm": {"name": algo}}, "metrics": {}}))
    with pytest.raises(FedbenchError, match="rerun the preset with save_model=true"):
        plot_preset_figures(ovs, tmp_path, tmp_path / "figures")
    shutil.rmtree(tmp_path / "runs")
