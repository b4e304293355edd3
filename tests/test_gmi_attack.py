"""FedFisher Table 6 / Fig. 4: the privacy split, the K-FAC-matching loss against the curvature engine, the GMI
attack on a tiny problem, config checks, and the study preset (fedbench.papers.fedfisher.gmi_attack)."""
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from fedbench.errors import FedbenchError
from fedbench.launch.sweep import compose_run, expand_sweep
from fedbench.partition import make_partition
from fedbench.papers.fedfisher import gmi_attack as g
from tests.script_loader import load_script

QUICK = ["experiment=fedfisher/table6", "profile=quick"]
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the split -----------------------------------------------------------------------------------------------
def _mnist_like_labels(n=60000, seed=0):
    return np.random.default_rng(seed).integers(0, 10, size=n)


def test_split_counts_client1_has_every_3_plus_1000_others():
    y = _mnist_like_labels()
    parts = make_partition("fedfisher_attack", y, 10, 0, fixed_seed=3, target_label=3, num_others=1000, alpha=0.1)
    assert len(parts) == 10
    c1 = parts[0]
    assert len(np.unique(c1)) == len(c1)
    assert set(np.flatnonzero(y == 3)) <= set(c1.tolist())
    assert int((y[c1] != 3).sum()) == 1000
    assert len(c1) == int((y == 3).sum()) + 1000
    rest = np.concatenate(parts[1:])
    assert len(np.unique(rest)) == len(rest)                      # clients 2-10 do not overlap
    assert not (set(rest.tolist()) & set(c1.tolist()))
    assert not (y[rest] == 3).any()                               # no 3 outside client 1
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(y)))   # everything assigned
    again = make_partition("fedfisher_attack", y, 10, 5, fixed_seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))          # fixed split seed


def test_split_rejects_bad_settings():
    y = _mnist_like_labels(2000)
    for kw, msg in (({"num_others": 5000}, "num_others"), ({"target_label": 12}, "target_label"),
                    ({"alpha": 0.0}, "alpha")):
        with pytest.raises(FedbenchError, match=msg):
            make_partition("fedfisher_attack", y, 10, 0, **kw)
    with pytest.raises(FedbenchError, match="num_clients >= 2"):
        make_partition("fedfisher_attack", y, 1, 0)


# ---- K-FAC of a generated batch ------------------------------------------------------------------------------
class _Tiny(nn.Sequential):
    def __init__(self, bias):
        super().__init__(nn.Conv2d(1, 3, 5, stride=3, bias=bias), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 8 * 8, 6, bias=bias), nn.ReLU(), nn.Linear(6, 4, bias=bias))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("conv", ["nngeometry", "expand"])
def test_kfac_factors_equal_the_curvature_engine(bias, conv):
    from fedbench.curvature import compute_curvature

    torch.manual_seed(0)
    model = _Tiny(bias).double()
    x = torch.randn(7, 1, 28, 28, dtype=torch.float64)
    ref = compute_curvature(model, x, torch.zeros(7, dtype=torch.long), structure="kfac", fisher="true",
                            scale="mean", conv_convention=conv, bias_augment=True, batch_size=3)
    ours = g.kfac_factors(model, x, conv_convention=conv)
    assert set(ours) == set(ref.blocks)
    for name, blk in ref.blocks.items():
        torch.testing.assert_close(ours[name][0], blk.A, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ours[name][1], blk.G, rtol=1e-10, atol=1e-12)


def test_kfac_match_loss_is_zero_on_its_own_factors_and_has_a_z_gradient():
    torch.manual_seed(1)
    model = _Tiny(False)
    gen = g.Generator(z_dim=8, width=4)
    z = torch.rand(5, 8, requires_grad=True)
    img = gen(z)
    own = {k: (a.detach(), b.detach()) for k, (a, b) in g.kfac_factors(model, img).items()}
    assert float(g.kfac_match_loss(g.kfac_factors(model, img), own).detach()) == 0.0
    other = {k: (a * 1.1, b * 0.9) for k, (a, b) in own.items()}
    loss = g.kfac_match_loss(g.kfac_factors(model, gen(z)), other)
    # the literal definition: summed element-wise squared differences
    direct = sum(((a - 1.1 * a) ** 2).sum() + ((b - 0.9 * b) ** 2).sum() for a, b in own.values())
    torch.testing.assert_close(loss.detach(), direct, rtol=1e-4, atol=1e-8)
    (grad,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0


# ---- the attack ----------------------------------------------------------------------------------------------
class _LinearGen(nn.Module):
    """A tiny generator whose range is wide enough for the attack to move the classifier."""

    def __init__(self, z_dim=8):
        super().__init__()
        self.z_dim = z_dim
        self.fc = nn.Linear(z_dim, 784)
        with torch.no_grad():
            self.fc.weight.mul_(10.0)

    def forward(self, z):
        return torch.sigmoid(self.fc(z)).view(-1, 1, 28, 28)


def test_attack_increases_the_target_probability():
    torch.manual_seed(2)
    gen, critic = _LinearGen(), g.Critic(width=4)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    res = g.invert(gen, critic, model, label=3, num=6, steps=40, lr=0.05, momentum=0.9, lambda_id=100.0, seed=0)
    first, last = res["trace"][0]["target_prob"], res["trace"][-1]["target_prob"]
    assert last > first + 0.05
    assert res["images"].shape == (6, 1, 28, 28) and float(res["z"].abs().max()) <= 1.0
    # case (iii): the K-FAC term is part of the objective and is evaluated
    tgt = {k: (a.detach(), b.detach()) for k, (a, b) in g.kfac_factors(model, torch.rand(4, 1, 28, 28)).items()}
    res3 = g.invert(gen, critic, model, label=3, num=4, steps=5, lr=0.05, momentum=0.9, lambda_id=1.0,
                    kfac_target=tgt, lambda_kfac=1.0, seed=0)
    assert res3["trace"][-1]["kfac"] is not None


def test_gan_trains_a_few_steps():
    x = torch.rand(40, 1, 28, 28)
    G, D, trace = g.train_gan(x, z_dim=8, steps=2, critic_steps=1, batch_size=8, lr=1e-3, gp_weight=10.0, seed=0)
    assert G(torch.zeros(3, 8)).shape == (3, 1, 28, 28) and trace[-1]["step"] == 2


# ---- config and preset ---------------------------------------------------------------------------------------
def test_preset_composes_and_expands():
    from fedbench.report.studies import study_name

    assert study_name(QUICK) == "gmi_attack"
    assert len(expand_sweep(QUICK)) == 1
    assert len(expand_sweep(["experiment=fedfisher/table6", "profile=paper"])) == 3
    cfg = compose_run(expand_sweep(QUICK)[0])
    st = g.study_settings(cfg)
    assert st["aux_size"] == 5000 and st["target_label"] == 3 and cfg.partition.name == "fedfisher_attack"
    assert cfg.algorithm.name == "fedfisher_kfac" and cfg.num_clients == 10


@pytest.mark.parametrize("extra,msg", [(["+study.foo=1"], "no key"), (["study.attack_steps=0"], "attack_steps"),
                                       (["partition=dirichlet_clientwise"], "fedfisher_attack"),
                                       (["algorithm=fedavg"], "fedfisher_kfac"), (["study.cases=[nope]"], "cases"),
                                       (["study.target_label=4"], "target_label"), (["rounds=2"], "rounds"),
                                       (["study.aux_pool=public"], "aux_pool")])
def test_bad_config_gives_one_line_error(extra, msg):
    cfg = compose_run(expand_sweep(["experiment=fedfisher/table6", "profile=paper"])[0] + extra)
    with pytest.raises(FedbenchError, match=msg) as e:
        g.study_settings(cfg)
    assert "\n" not in str(e.value)


def test_table_joins_each_column_to_its_paper_row(tmp_path):
    from fedbench.results.records import compute_run_id
    from fedbench.report.studies import collect_study_table, study_runs

    (run,) = study_runs(QUICK, tmp_path)
    from fedbench.report.studies import study_name
    from tests.conftest import ok_record
    rec = {**ok_record(run["run_id"], f"study:{study_name(QUICK)}"), "metrics": {
        "attack_accuracy_local_model_client1": 70.0, "attack_accuracy_aggregate": 10.0,
        "attack_accuracy_aggregate_plus_client1_kfac": 20.0}}
    assert run["run_id"] == compute_run_id(run["config"])
    (tmp_path / "runs" / run["run_id"]).mkdir(parents=True)
    (tmp_path / "runs" / run["run_id"] / "metrics.json").write_text(json.dumps(rec))
    text = collect_study_table(QUICK, tmp_path, tmp_path / "tables").read_text()
    assert "70.00 ± 0.00 / 78.40 / Δ -8.40" in text
    assert "10.00 ± 0.00 / 5.00" in text and "20.00 ± 0.00 / 9.60" in text


# ---- the setup: the runner's builder, so dataset.normalize means the same as in a run -------------------------
_SMALL_DATA = ["dataset=synthetic", "dataset.kwargs.like=mnist", "dataset.kwargs.train_size=400",
               "dataset.kwargs.test_size=50", "partition.num_others=20", "num_clients=3", "hardware=cpu"]


@pytest.mark.parametrize("normalize,expect", [("{mean:[0.5],std:[0.25]}", ((0.5,), (0.25,))),
                                              ("false", (None, None)), ("true", "own")])
def test_setup_reads_dataset_normalize_as_a_run_does(tmp_path, monkeypatch, normalize, expect):
    """A {mean, std} mapping used to become the data set's own statistics (read as a bool)."""
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    cfg = compose_run(QUICK + _SMALL_DATA + [f"dataset.normalize={normalize}", f"paths.output_root={tmp_path}"])
    data, parts, setup, init = g._setup(cfg, str(tmp_path))
    own = (tuple(data.mean), tuple(data.std))
    assert own != ((0.5,), (0.25,))
    got = (None if setup.train.mean is None else tuple(setup.train.mean),
           None if setup.train.std is None else tuple(setup.train.std))
    assert got == (own if expect == "own" else expect)
    x = data.train_x[:4].float() / 255.0
    want = x if got[0] is None else (x - got[0][0]) / got[1][0]
    assert torch.allclose(setup.train.inputs(torch.arange(4)), want)
    assert sum(len(p) for p in parts) == 400 and set(init) == {n for n, _ in setup.model.named_parameters()}


def test_the_whole_study_runs_on_a_tiny_problem(tmp_path, monkeypatch):
    """End to end (clients, FedFisher's upload, GAN, evaluator, the three attacks): a signature change in the
    algorithm's upload once broke the study while every piece-wise test above still passed."""
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    tiny = ["local.epochs=1", "algorithm.steps=5", "study.gan_width=8", "study.gan_steps=2", "study.gan_critic_steps=1",
            "study.attack_steps=2", "study.num_reconstructions=4", "study.grid_per_case=2", "study.evaluator_epochs=1",
            "study.aux_size=40", "progress=false"]
    cfg = compose_run(QUICK + _SMALL_DATA + tiny + [f"paths.output_root={tmp_path}"])
    out = g.run_from_config(cfg, tmp_path / "run", launch_dir=str(tmp_path), log=None)
    m = out["metrics"]
    for case in ("local_model_client1", "aggregate", "aggregate_plus_client1_kfac"):
        assert 0.0 <= m[f"attack_accuracy_{case}"] <= 100.0
    assert sum(out["client_sizes"]) == 400 and out["uplink_bytes"] > 0
    assert (tmp_path / "run" / "attack.csv").exists()
    assert out["aux_label_counts"][3] == 0      # [P] the server's aux data come from clients 2..K: no 3s
    # every reconstruction and what the attack needs are kept for the evaluator/attack variants (gap script)
    saved = torch.load(tmp_path / "run" / out["files"]["attack_inputs"], weights_only=False)
    assert {k: v.shape[0] for k, v in saved["reconstructions"].items()} == {c: 4 for c in g.CASES}
    assert set(saved["targets"]) == set(g.CASES) and saved["aux_indices"].numel() == 40


def _tiny_study(tmp_path, monkeypatch, extra=()):
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    tiny = ["local.epochs=1", "algorithm.steps=5", "study.gan_width=8", "study.gan_steps=2", "study.gan_critic_steps=1",
            "study.attack_steps=2", "study.num_reconstructions=4", "study.grid_per_case=2", "study.evaluator_epochs=1",
            "progress=false", *extra]
    return compose_run(QUICK + _SMALL_DATA + tiny + [f"paths.output_root={tmp_path}"])


def test_aux_pool_all_clients_draws_client1s_3s_and_changes_the_run_id(tmp_path, monkeypatch):
    """The what-if of gaps.md#fedfisher-table6: the aux data drawn from every client hold 3s; the paper's
    setting stays out of the run id (records made before the switch keep their ids)."""
    from fedbench.results.records import compute_run_id

    paper = _tiny_study(tmp_path, monkeypatch, ["study.aux_size=300"])
    what_if = _tiny_study(tmp_path, monkeypatch, ["study.aux_size=300", "study.aux_pool=all_clients"])
    data, parts, setup, _ = g._setup(paper, str(tmp_path))
    st = g.study_settings(paper)
    st_all = g.study_settings(what_if)
    st, st_all = {**st, "gan_steps": 1}, {**st_all, "gan_steps": 1}
    _, counts, _ = g._server_gan(st, setup, data, parts, 0, None)
    idx, counts_all, _ = g._server_gan(st_all, setup, data, parts, 0, None)
    assert counts[3] == 0 and counts_all[3] > 0
    assert len(set(idx.tolist()) & set(np.asarray(parts[0]).tolist())) > 0
    with pytest.raises(FedbenchError, match="all clients"):
        g._server_gan({**st_all, "aux_size": 10_000}, setup, data, parts, 0, None)
    preset = compose_run(expand_sweep(["experiment=fedfisher/table6", "profile=paper"])[0])
    assert preset.study.aux_pool == "other_clients"
    no_key = OmegaConf.to_container(preset, resolve=True)
    del no_key["study"]["aux_pool"]
    assert compute_run_id(OmegaConf.create(no_key)) == compute_run_id(preset)
    assert compute_run_id(paper) != compute_run_id(what_if)


def test_gap_script_relabels_saved_reconstructions_as_the_record_did(tmp_path, monkeypatch, capsys):
    """scripts/gaps/fedfisher_table6_attack.py retrains the study's own evaluator: its labels of the saved
    reconstructions must reproduce the recorded attack accuracy; an attack variant runs from the saved GAN."""

    cfg = _tiny_study(tmp_path, monkeypatch, ["study.aux_size=40"])
    run = tmp_path / "run"
    out = g.run_from_config(cfg, run, launch_dir=str(tmp_path), log=None)
    (run / "metrics.json").write_text(json.dumps({"study": "gmi_attack", "metrics": out["metrics"],
                                                  "config": OmegaConf.to_container(cfg, resolve=True)}))
    mod = load_script("gaps/fedfisher_table6_attack.py")
    monkeypatch.chdir(tmp_path)
    assert mod.main([str(run), "--evaluators", "mlp", "--csv", str(tmp_path / "a.csv")]) == 0
    import pandas as pd

    rows = pd.read_csv(tmp_path / "a.csv")
    assert len(rows) == 3 and (rows["attack_accuracy"] - rows["recorded"]).abs().max() < 1e-6
    assert "differs from the record" not in capsys.readouterr().out
    assert mod.main([str(run), "--evaluators", "mlp", "--cases", "aggregate_plus_client1_kfac",
                     "--attack", "attack_steps=1", "lambda_kfac=0"]) == 0
    assert mod.main([str(run), "--attack", "lambda=1"]) == 2
    assert mod.main([str(tmp_path)]) == 2
    # a run from before attack_inputs.pt: its Fig. 4 grid can be relabelled, not attacked again
    (run / "attack_inputs.pt").unlink()
    capsys.readouterr()
    assert mod.main([str(run), "--evaluators", "mlp"]) == 0
    assert "the Fig. 4 grid only" in capsys.readouterr().out
    assert mod.main([str(run), "--attack", "attack_steps=1"]) == 2


def test_client1_kfac_is_the_factors_client1_uploads(tmp_path, monkeypatch):
    """Case (iii) matches the factors FedFisher(K-FAC) sent for client 1, as the server decodes them."""
    from fedbench.algorithms.fedfisher import FedFisherKFAC, decode_any

    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    cfg = compose_run(QUICK + _SMALL_DATA + ["local.epochs=1", "algorithm.steps=5", "progress=false",
                                             f"paths.output_root={tmp_path}"])
    data, parts, setup, init = g._setup(cfg, str(tmp_path))
    sent = {}
    orig = FedFisherKFAC.client_message

    def spy(self, client_id, *a, **k):
        msg = orig(self, client_id, *a, **k)
        sent[int(client_id)] = msg.payload["factors"]
        return msg

    monkeypatch.setattr(FedFisherKFAC, "client_message", spy)
    tg = g._targets(cfg, setup, init, [len(p) for p in parts])
    assert set(tg["kfac1"]) == set(sent[0])
    for mod, (A, G) in tg["kfac1"].items():
        assert torch.equal(A.cpu(), decode_any(sent[0][mod]["A"]).cpu())
        assert torch.equal(G.cpu(), decode_any(sent[0][mod]["G"]).cpu())
        assert torch.allclose(A, A.T) and torch.allclose(G, G.T)
    assert set(tg["models"]) == {"local_model_client1", "aggregate", "aggregate_plus_client1_kfac"}


def test_dry_run_of_the_study_preset_trains_nothing(tmp_path, monkeypatch, capsys):
    """`reproduce.py --dry-run` on a study preset used to run the study."""

    from fedbench.report import studies

    def refuse(*a, **k):
        raise AssertionError("a dry run ran the study")

    monkeypatch.setattr(studies, "run_study_preset", refuse)
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "out"))
    mod = load_script("reproduce.py")
    assert mod.main(["--dry-run", "experiment=fedfisher/table6", "profile=paper"]) == 0
    assert capsys.readouterr().out.strip() == "dry run: 0/3 study run(s) done, 3 to do"
    assert not (tmp_path / "out").exists()


def test_named_collection_of_the_study_leaves_the_presets_table_and_figure_alone(tmp_path, monkeypatch):
    """`reproduce.py --collect-only --name auxall <study preset> <other settings>` once wrote the preset's own
    table and replaced its collections.yaml entry with the what-if's overrides."""

    import yaml

    from fedbench.report.studies import study_runs, study_name
    from tests.conftest import ok_record

    what_if = QUICK + ["study.aux_pool=all_clients"]
    out = tmp_path / "out"
    (run,) = study_runs(what_if, out)
    rec = {**ok_record(run["run_id"], f"study:{study_name(what_if)}"), "metrics": {
        "attack_accuracy_local_model_client1": 70.0, "attack_accuracy_aggregate": 10.0,
        "attack_accuracy_aggregate_plus_client1_kfac": 20.0}}
    run["dir"].mkdir(parents=True)
    (run["dir"] / "metrics.json").write_text(json.dumps(rec))
    (run["dir"] / "figure4.png").write_bytes(b"png")
    tables = tmp_path / "results" / "tables"
    tables.mkdir(parents=True)
    own = tables / "fedfisher_table6_quick.md"
    own.write_text("the preset's own table")
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(out))
    monkeypatch.chdir(tmp_path)
    mod = load_script("reproduce.py")
    assert mod.main(["--collect-only", "--name", "auxall", *what_if]) == 0
    assert own.read_text() == "the preset's own table"
    assert "70.00 ± 0.00 / 78.40" in (tables / "fedfisher_table6_quick_auxall.md").read_text()
    assert (tmp_path / "results" / "figures" / "fedfisher_figure4_quick_auxall.png").exists()
    assert not (tmp_path / "results" / "figures" / "fedfisher_figure4_quick.png").exists()
    entries = yaml.safe_load((tmp_path / "results" / "collections.yaml").read_text())["collections"]
    assert [(e["name"], e["suffix"]) for e in entries] == [("fedfisher_table6_quick_auxall", "auxall")]
