"""FOLA's figure presets (Figs. 3-12): shared runs, the plots on synthetic run records (values checked against
hand computations from the same records), and the §IV-E study driven by a preset (Fig. 12's AE / LF)."""
from tests.conftest import ok_record
import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

import fedbench.papers.fola.laplace_study as fl
from fedbench.data import default_mirror
from fedbench.errors import FedbenchError
from fedbench.launch.sweep import CONF_DIR, compose_run, expand_sweep
from fedbench.papers.fola import figures as ff
from fedbench.report.figures import plot_preset_figures
from fedbench.report.runs import composed_runs
from fedbench.results.records import compute_run_id, write_csv_atomic, write_json_atomic
from fedbench.config.aggregators import expand_aggregators


def _ids(preset, extra=()):
    out = set()   # the figures' fast composition (checked against Hydra's below)
    for _, cfg in composed_runs([f"experiment={preset}", "profile=paper", "seed=0"] + list(extra)):
        out |= {compute_run_id(s) for s in expand_aggregators(cfg, CONF_DIR, allow_missing=True)}
    return out


def test_figure_presets_share_their_runs():
    fix = ["num_clients=5", "local.epochs=1", "local.batch_size=32", "local.lr=0.01"]
    f3 = _ids("fola/figure3", fix)
    assert len(f3) == 5 * 3 and _ids("fola/figure4", fix) == f3
    assert _ids("fola/figure8", ["local.epochs=1"]) == _ids("fola/figure6ab", ["local.epochs=1"])
    f6c = _ids("fola/figure6c")
    assert f6c == _ids("fola/figure7") and len(f6c) == 15
    t2 = _ids("fola/table2")
    assert len(t2 & f6c) == 3                      # alpha = 0.01: Table II's FOLA, FedAvg and FedCurv runs
    assert len(t2 & _ids("fola/figure9")) == 1     # the full method = Table II's FOLA run
    ids10 = {compute_run_id(compose_run(o)) for o in expand_sweep(["experiment=fola/figure10", "profile=paper"])}
    assert ids10 == {compute_run_id(compose_run(o)) for o in expand_sweep(["experiment=fola/figure11", "profile=paper"])}


def test_cifar_presets_use_table_one_augmentation():
    from fedbench.data.transforms import Augment

    for preset in ("fola/table2", "fola/figure6ab", "fola/figure6c", "fola/figure9"):
        cfg = compose_run(expand_sweep([f"experiment={preset}", "profile=quick"])[0])
        aug = Augment(**OmegaConf.to_container(cfg.dataset.augment))
        assert (aug.autoaugment, aug.autoaugment_fill, aug.cutout, aug.cutout_holes) == ("cifar10", 128, 16, 1)
        assert aug.pad_mode == "fill" and round(aug.fill * 255) == 128 and aug.flip and aug.crop_padding == 4


def test_fast_composition_equals_hydra_compose():
    ovs = ["experiment=fola/figure3", "profile=quick", "num_clients=5"]
    fast = list(composed_runs(ovs))
    assert len(fast) == 24
    for o, cfg in fast[:6]:
        assert OmegaConf.to_container(cfg, resolve=True) == OmegaConf.to_container(compose_run(o), resolve=True)


def test_method_labels_tell_fola_variants_apart():
    f = {"mode": "online"}
    assert ff.method_label({"name": "fola", "lambda_prior": 100.0, "fisher": f}) == "FOLA"
    assert ff.method_label({"name": "fola", "lambda_prior": 0.0, "fisher": f}) == "FOLA agg.-only"
    assert ff.method_label({"name": "fola", "lambda_prior": 0.0, "fisher": {"mode": "offline"}}) == "FOLA-offline"
    assert ff.method_label({"name": "fola", "lambda_prior": 1.0, "aggregation": "mean", "fisher": f}) == \
        "FOLA prior + FedAvg agg."
    assert ff.method_label({"name": "fedcurv"}) == "FedCurv"


# ---- synthetic records --------------------------------------------------------------------------------------
BUMP = {"FedAvg": 0.0, "FOLA agg.-only": 3.0, "FOLA-offline": -2.0, "FOLA": 5.0, "FedCurv": 1.0,
        "FOLA prior + FedAvg agg.": 2.0}


def _acc(sub, label, r):
    """A known function of the settings (so selections can be checked by hand)."""
    a = float(sub.partition.get("alpha") or 1.0)
    lam = float(sub.algorithm.get("lambda_prior") or 0.0)
    return (40 + 2 * math.log10(a) + BUMP[label] - 0.5 * abs(math.log10(sub.local.lr) + 1.5)
            + 0.1 * sub.local.epochs - 0.01 * sub.local.batch_size + 0.3 * sub.num_clients / 10
            + 0.2 * math.log10(1 + lam) + 0.7 * sub.seed + 0.1 * r)


def _fake(ovs_preset, out):
    n = 0
    for _, cfg in composed_runs(ovs_preset):   # = Hydra's compose (test_fast_composition_equals_hydra_compose)
        for sub in expand_aggregators(cfg, CONF_DIR):
            label = ff.method_label(OmegaConf.to_container(sub.algorithm))
            rid = compute_run_id(sub)
            hist = [{"round": r, "accuracy": _acc(sub, label, r), "local_accuracy": _acc(sub, label, r) / 3}
                    for r in range(1, int(sub.rounds) + 1)]
            write_csv_atomic(out / "runs" / rid / "history.csv", hist, ["round", "accuracy", "local_accuracy"])
            write_json_atomic(out / "runs" / rid / "metrics.json", {
                **ok_record(rid, sub.algorithm.name),
                "metrics": {"accuracy": hist[-1]["accuracy"], "local_accuracy": hist[-1]["local_accuracy"]}})
            n += 1
    return n


def _png(path):
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    return pd.read_csv(path.with_name(path.stem + "_data.csv"))


def test_fig3_and_fig4_best_over_hyperparameters(tmp_path):
    out = tmp_path / "out"
    ovs3 = ["experiment=fola/figure3", "profile=quick", "num_clients=5", "seed=0,1"]
    assert _fake(ovs3, out) == 48 * 3
    (p3,) = plot_preset_figures(ovs3, out, tmp_path / "figs")
    assert p3.name == "fola_figure3_quick.png"
    d3 = _png(p3)
    assert len(d3) == 3 * 1 * 3 and set(d3["seeds"]) == {2} and set(d3["settings"]) == {8}   # methods x N x alpha
    for _, r in d3.iterrows():   # by hand: the best seed-mean over E in {1, 2}, lr in {0.1, 0.01}, B in {32, 128}
        want = max(40 + 2 * math.log10(r["alpha"]) + BUMP[r["method"]] - 0.5 * abs(math.log10(lr) + 1.5)
                   + 0.1 * e - 0.01 * b + 0.3 * 5 / 10 + 0.35 + 0.1 for e in (1, 2) for lr in (0.1, 0.01) for b in (32, 128))
        want += 0.2 * math.log10(2) if r["method"] == "FOLA-offline" else 0.0   # fola_offline.yaml's lambda 1
        assert r["accuracy"] == pytest.approx(want)
    assert set(d3["best_batch_size"]) == {32} and set(d3["best_epochs"]) == {2}
    (p4,) = plot_preset_figures(["experiment=fola/figure4", "profile=quick", "num_clients=5", "seed=0,1"], out,
                                   tmp_path / "figs")
    d4 = _png(p4)
    assert len(d4) == 3 * (3 * 3 * 2)      # x in {B, E, lr} x methods x alpha x two values
    r = d4[(d4["x"] == "batch_size") & (d4["batch_size"] == 128) & (d4["method"] == "FedAvg") & (d4["alpha"] == 1)]
    assert float(r["accuracy"].iloc[0]) == pytest.approx(40 - 0.5 * 0.5 + 0.2 - 1.28 + 0.15 + 0.35 + 0.1)
    # the alternative without test-set selection averages over the other hyperparameters
    df = ff.fola_records(ovs3, out)
    m = ff.select_over(df, ["method", "num_clients", "alpha"], "accuracy", "mean")
    assert float(m["accuracy"].max()) < float(d3["accuracy"].max())
    with pytest.raises(FedbenchError, match="table.select"):
        ff.select_over(df, ["method"], "accuracy", "best_on_val")


def test_best_of_selection_uses_only_seeds_that_ran_every_setting():
    def rows(*cells):   # (seed, epochs, accuracy) of FedAvg at alpha 0.1, N = 10
        return pd.DataFrame([{"method": "FedAvg", "alpha": 0.1, "num_clients": 10, "epochs": e, "lr": 0.1,
                              "batch_size": 32, "seed": s, "accuracy": a} for s, e, a in cells])
    keep = ["method", "num_clients", "alpha"]
    half = rows((0, 1, 50.0), (0, 5, 60.0), (1, 1, 90.0))        # seed 1 stopped after its first setting
    r = ff.select_over(half, keep, "accuracy", "best_on_test").iloc[0]
    assert (r["accuracy"], r["best_epochs"], r["seeds"], r["settings"]) == (60.0, 5, 1, 2)   # not (50 + 90) / 2
    full = pd.concat([half, rows((1, 5, 62.0))])
    r = ff.select_over(full, keep, "accuracy", "best_on_test").iloc[0]
    assert (r["accuracy"], r["best_epochs"], r["seeds"]) == (70.0, 1, 2)
    scattered = rows((0, 1, 50.0), (1, 5, 60.0))                   # no seed complete: every run enters
    assert ff.select_over(scattered, keep, "accuracy", "mean").iloc[0]["accuracy"] == 55.0


def test_cifar_figures_from_synthetic_records(tmp_path):
    out, figs = tmp_path / "out", tmp_path / "figs"
    assert _fake(["experiment=fola/figure6ab", "profile=quick", "seed=0,1"], out) == 16
    d6 = _png(plot_preset_figures(["experiment=fola/figure6ab", "profile=quick", "seed=0,1"], out, figs)[0])
    assert set(d6["series"]) == {"FOLA agg.-only λ=0", "FOLA λ=100", "FedCurv λ=100", "FedAvg"}
    r = d6[(d6["series"] == "FOLA λ=100") & (d6["epochs"] == 2)].iloc[0]
    want = 40 - 2 * 2 + 5 - 0.25 + 0.1 * 2 - 0.32 + 0.6 + 0.2 * math.log10(101) + 0.35 + 0.3
    assert r["accuracy_mean"] == pytest.approx(want) and r["accuracy_std"] == pytest.approx(0.7 / math.sqrt(2))
    assert r["local_accuracy_mean"] == pytest.approx(want / 3)
    d8 = _png(plot_preset_figures(["experiment=fola/figure8", "profile=quick", "seed=0,1"], out, figs)[0])
    assert len(d8) == 16 and (d8["local_accuracy"] * 3 - d8["accuracy"]).abs().max() < 1e-9

    assert _fake(["experiment=fola/figure6c", "profile=quick"], out) == 6
    d6c = _png(plot_preset_figures(["experiment=fola/figure6c", "profile=quick"], out, figs)[0])
    assert len(d6c) == 3 * 2 and set(d6c["count"]) == {1}
    d7 = _png(plot_preset_figures(["experiment=fola/figure7", "profile=quick"], out, figs)[0])
    assert len(d7) == 3 * 2 * 3                  # methods x alpha x rounds
    last = d7[d7["round"] == 3].set_index(["method", "alpha"])["mean"]
    first = d6c.set_index(["method", "alpha"])["mean"]
    assert (last - first.reindex(last.index)).abs().max() < 1e-9   # Fig. 6(c) is Fig. 7's last round
    ref = ff._reference("accuracy")
    assert dict(zip(ref["method"], ref["mean"])) == {"FOLA": 48.57, "FedAvg": 42.16, "FedCurv": 41.31}
    assert sorted(ff._reference("rounds_to_acc", 40)["mean"]) == [21.0, 73.0, 74.0]

    assert _fake(["experiment=fola/figure9", "profile=quick"], out) == 5
    d9 = _png(plot_preset_figures(["experiment=fola/figure9", "profile=quick"], out, figs)[0])
    assert set(d9.loc[d9["panel"] == "(a)", "method"]) == {"FOLA agg.-only", "FOLA-offline"}
    assert set(d9.loc[d9["panel"] == "(b)", "method"]) == {"FOLA", "FOLA prior + FedAvg agg.", "FOLA agg.-only", "FedAvg"}
    c = d9[(d9["panel"] == "(c)") & (d9["method"] == "FedAvg") & (d9["round"] == 3)]
    assert float(c["mean"].iloc[0]) == pytest.approx((40 - 4 + 0 - 0.25 + 0.1 - 0.32 + 0.6 + 0.3) / 3)   # E 1, seed 0


def test_plots_without_records_or_with_unknown_names_fail_clearly(tmp_path):
    with pytest.raises(FedbenchError, match="no finished runs"):
        plot_preset_figures(["experiment=fola/figure9", "profile=quick"], tmp_path / "none", tmp_path / "f")
    assert plot_preset_figures(["experiment=fola/table2", "profile=quick"], tmp_path / "none", tmp_path / "f") == []
    with pytest.raises(FedbenchError, match="table.plots"):
        plot_preset_figures(["experiment=fola/figure9", "profile=quick", "+table.plots=[fig99]"],
                               tmp_path / "none", tmp_path / "f")


# ---- the §IV-E study: Fig. 12 and presets ------------------------------------------------------------------
def _tiny_clients(seed=0):
    g = torch.Generator().manual_seed(seed)
    c, d = 4, 5
    centers = torch.randn(c, d, generator=g, dtype=torch.float64) * 2

    def data(n):
        y = torch.randint(0, c, (n,), generator=g)
        return centers[y] + torch.randn(n, d, generator=g, dtype=torch.float64), y
    x, y = data(150)
    m1 = y < 2
    return [(x[m1], y[m1]), (x[~m1], y[~m1])], data(200)


def test_correlation_study_ae_and_lf_against_the_reference():
    clients, test = _tiny_clients()
    cfg = fl.StudyConfig(rounds=4, batch_size=16, lr=0.1, sweep_rounds=(), prior_precision=1e-3,
                         methods=("full_online", "diag_online", "fedavg"))
    res = fl.run_correlation(clients, test, cfg, lf_epochs=(1, 3), num_classes=4)
    ae = pd.DataFrame([r for r in res.correlation if r["kind"] == "ae"])
    lf = pd.DataFrame([r for r in res.correlation if r["kind"] == "lf"])
    assert len(ae) == 3 * 4 and len(lf) == 3 * 2 and set(lf["round"]) == {5}
    star, prec = res.states["full_online"]["mean"], res.states["full_online"]["precision"]
    assert prec[0] == "dense"
    assert float(ae[(ae["method"] == "full_online") & (ae["round"] == 4)]["distance"].iloc[0]) == 0.0
    mu3 = res.means["fedavg"][2]
    d = mu3 - star
    want = 0.5 * float(d @ prec[1] @ d)                         # D = ½ (θ − θ*)ᵀ Λ* (θ − θ*)
    got = ae[(ae["method"] == "fedavg") & (ae["round"] == 3)].iloc[0]
    assert got["distance"] == pytest.approx(want) and got["distance"] > 0
    assert got["accuracy"] == pytest.approx(fl.evaluate(mu3, fl.augment(test[0]), test[1])["accuracy"])
    # FedAvg's round-5 clients: plain SGD from θ*, so one epoch forgets less than three
    fa = lf[lf["method"] == "fedavg"].set_index("epochs")["distance"]
    assert 0 < fa[1] < fa[3]
    with pytest.raises(FedbenchError, match="reference"):
        fl.run_correlation(clients, test, cfg, reference="diag_online")
    with pytest.raises(FedbenchError, match="lf_epochs"):
        fl.run_correlation(clients, test, cfg, lf_epochs=(0,))


def test_a_stopped_study_resumes_at_its_next_method_with_the_same_results(tmp_path):
    """The MethodStore keeps each finished method; a run stopped inside the second method restores the first and
    recomputes the rest, bitwise the same as one uninterrupted run. A file with another stamp is recomputed over."""
    clients, test = _tiny_clients()
    cfg = fl.StudyConfig(rounds=3, batch_size=16, lr=0.1, sweep_rounds=(1,), sweep_points=3, prior_precision=1e-3,
                         methods=("full_online", "diag_online", "fedavg"), heatmap_size=6)
    whole = fl.run_study(clients, test, cfg, num_classes=4)

    class Stop(Exception):
        pass

    def stop_in_diag(row):
        if row["method"] == "diag_online" and row["round"] == 2:
            raise Stop

    stamp = {"numerics": {"core": 1, "method": 1}, "client_sizes": [1, 2]}
    with pytest.raises(Stop):
        fl.run_study(clients, test, cfg, num_classes=4, log=stop_in_diag,
                     store=fl.MethodStore(tmp_path / "resume", stamp))
    assert sorted(p.name for p in (tmp_path / "resume").iterdir()) == ["full_online.pt"]
    said, ran = [], []
    res = fl.run_study(clients, test, cfg, num_classes=4, log=ran.append,
                       store=fl.MethodStore(tmp_path / "resume", stamp, log=said.append))
    assert {r["method"] for r in ran} == {"diag_online", "fedavg"} and len(said) == 1 and "full_online" in said[0]
    assert res.rounds == whole.rounds and res.sweep == whole.sweep
    assert torch.equal(res.heatmaps["full_online"], whole.heatmaps["full_online"])
    for m in cfg.methods:
        assert all(torch.equal(a, b) for a, b in zip(res.means[m], whole.means[m]))
        assert torch.equal(res.states[m]["mean"], whole.states[m]["mean"])
        assert res.states[m]["precision"][0] == whole.states[m]["precision"][0]
    assert torch.equal(res.states["full_online"]["precision"][1], whole.states["full_online"]["precision"][1])
    # another stamp (newer numerics, other data): every method is recomputed, and the store is cleared on demand
    ran.clear()
    fl.run_study(clients, test, cfg, num_classes=4, log=ran.append,
                 store=fl.MethodStore(tmp_path / "resume", {**stamp, "client_sizes": [2, 1]}))
    assert {r["method"] for r in ran} == set(cfg.methods)
    fl.MethodStore(tmp_path / "resume", stamp).clear()
    assert not (tmp_path / "resume").exists()


def test_study_settings_are_checked_before_any_data():
    from fedbench.report.studies import study_name

    assert study_name(["experiment=fola/figure12", "profile=quick"]) == "fola_laplace"
    assert study_name(["experiment=fola/figure9", "profile=quick"]) is None
    base = expand_sweep(["experiment=fola/figure12", "profile=quick", "partition.alpha=0.1"])[0]   # + the profile's set
    st, cfg = fl.study_settings(compose_run(base))
    assert st["kind"] == "correlation" and cfg.rounds == 5 and cfg.sweep_rounds == () and st["lf_epochs"] == [1, 5]
    for bad, msg in ((["study.kind=other"], "study.kind"), (["+study.foo=1"], "no key"), (["num_clients=3"], "two clients"),
                     (["local.momentum=0.9"], "plain SGD"), (["study.input_pool=0"], "input_pool"),
                     (["study.reference=fedavg", "study.methods=[diag_online]"], "reference"),
                     (["+study.efull_reading=eigenvalues"], "efull_reading")):
        with pytest.raises(FedbenchError, match=msg):
            fl.study_settings(compose_run(base + bad))
    with pytest.raises(FedbenchError, match="table.study"):
        study_name(base + ["table.study=nope"])


@pytest.mark.skipif(default_mirror() is None or not (default_mirror() / "MNIST" / "raw").is_dir(),
                    reason="no offline mirror with MNIST (set FEDBENCH_DATA_MIRROR)")
def test_study_preset_end_to_end_on_mnist(tmp_path, monkeypatch):
    """A tiny Fig. 10/11 and Fig. 12 study on real MNIST (7x7 pooled inputs, 60 images per client): records,
    skip on rerun, figures."""
    from fedbench.report.studies import reproduce_study, study_runs

    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "out"))
    tiny = ["rounds=2", "study.max_per_client=60", "study.input_pool=4", f"paths.data_root={tmp_path / 'data'}"]
    ovs = ["experiment=fola/figure10", "profile=quick", "study.sweep_rounds=[1,2]", "study.sweep_points=5",
           "study.heatmap_size=20"] + tiny
    (p10,) = reproduce_study(ovs, str(tmp_path))
    (run,) = study_runs(ovs, tmp_path / "out")
    rec = run["record"]
    assert rec["status"] == "ok" and rec["study"] == "fola_laplace" and rec["num_parameters"] == 10 * 50
    assert rec["client_sizes"] == [60, 60]
    rounds = pd.read_csv(run["dir"] / "rounds.csv")
    assert len(rounds) == 2 * 7 and rounds["global_accuracy"].between(0, 1).all()
    assert len(pd.read_csv(run["dir"] / "sweep.csv")) == 2 * 5 * 7
    assert torch.load(run["dir"] / "heatmap_full_online.pt", weights_only=True).shape == (20, 20)
    assert not (run["dir"] / "study_resume").exists()   # the finished methods' partial results are removed
    assert p10.name == "fola_figure10_quick.png" and len(_png(p10)) == 70
    # published: the record and the study's tables (not the heat maps) in the committed store
    stored = Path(os.environ["FEDBENCH_RECORDS"]) / run["run_id"]
    assert sorted(p.name for p in stored.iterdir()) == ["correlation.csv", "metrics.json", "rounds.csv", "sweep.csv"]
    ovs11 = ["experiment=fola/figure11"] + ovs[1:]
    (p11,) = reproduce_study(ovs11, str(tmp_path))          # the same run: skipped, only plotted
    assert study_runs(ovs11, tmp_path / "out")[0]["run_id"] == run["run_id"] and len(_png(p11)) == 14
    ovs12 = ["experiment=fola/figure12", "profile=quick", "study.lf_epochs=[1,2]"] + tiny[1:] + ["rounds=3"]
    (p12,) = reproduce_study(ovs12, str(tmp_path))
    d12 = _png(p12)
    assert set(d12["alpha"]) == {0.1, 10} and len(d12) == 2 * (3 * 3 + 3 * 2)
    # a fresh clone (no outputs): the studies come from the committed store, nothing reruns, the figures redraw
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "fresh"))
    assert study_runs(ovs, tmp_path / "fresh")[0]["dir"] == stored
    (again,) = reproduce_study(ovs, str(tmp_path))
    assert len(_png(again)) == 70 and not (tmp_path / "fresh" / "runs").exists()
    # make tables on a fresh clone: the paper study's committed record (here the tiny run's, under the paper id)
    # redraws Figs. 10 and 11; nothing else has a record, so nothing else is drawn
    from fedbench.report.studies import redraw_committed_studies
    assert redraw_committed_studies(tmp_path / "fresh", tmp_path / "figs") == []
    (paper,) = study_runs(["experiment=fola/figure10", "profile=paper"], tmp_path / "fresh")
    target = Path(os.environ["FEDBENCH_RECORDS"]) / paper["run_id"]
    target.mkdir()
    for f in stored.iterdir():
        target.joinpath(f.name).write_bytes(f.read_bytes())
    rec = json.loads((target / "metrics.json").read_text())
    (target / "metrics.json").write_text(json.dumps({**rec, "run_id": paper["run_id"]}))
    drawn = redraw_committed_studies(tmp_path / "fresh", tmp_path / "figs")
    assert [p.name for p in drawn] == ["fola_figure10.png", "fola_figure11.png"]


def test_fig3_and_fig4_draw_all_five_alphas(tmp_path):
    # the paper's five alphas: line styles 5 and 6 are dash tuples, which matplotlib reads as data when passed
    # positionally ("Input could not be cast to an at-least-1D NumPy array" on the first reduced-grid collection)
    rows = [{"method": m, "alpha": a, "num_clients": 10, "epochs": e, "lr": lr, "batch_size": b, "seed": 0,
             "status": "ok", "accuracy": 50.0 + 5 * math.log10(a) + (3.0 if m == "FOLA" else 0.0) + e / 10}
            for m in ("FOLA", "FedAvg") for a in (0.01, 0.1, 1, 10, 100) for e in (1, 5) for lr in (0.1, 0.01)
            for b in (32, 128)]
    meta = {"paper": "fola", "id": "figure4", "title": "t"}
    d4 = _png(ff.plot_fig4(pd.DataFrame(rows), meta, tmp_path / "f4.png", "reduced"))
    assert len(d4) == 3 * 2 * 5 * 2   # x in {B, E, lr} x methods x alpha x two values
    d3 = _png(ff.plot_fig3(pd.DataFrame(rows), {**meta, "id": "figure3"}, tmp_path / "f3.png", "reduced"))
    assert len(d3) == 2 * 5 and set(d3["best_epochs"]) == {5}
