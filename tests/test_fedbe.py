"""FedBE (notes/fola.md §2): the Gaussian / Dirichlet over client models against hand computations, sampling
statistics, ensemble members and pseudo-labels, SWA, distillation progress, configs, and run.py end to end."""
import csv
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from fedbench.algorithms import fedbe as FB
from fedbench.algorithms.base import ALGORITHMS, Message
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData
from tests.test_run import ROOT, SMALL, records, run

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = {"num_samples": 2, "epochs": 1, "batch_size": 8, "swa_start": 0, "swa_freq": 1}


def _net():
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(128, 3))


def _setup(unlabeled=True, n=60, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(0)
    dev = torch.device(device)
    train = TrainData(x.to(dev), y.to(dev))
    idx = [torch.arange(0, 15, device=dev), torch.arange(15, 60, device=dev)]
    return FLSetup(model=_net().to(dev), train=train, test_inputs=train.inputs, test_y=y.to(dev), client_indices=idx,
                   local=LocalTrainConfig(lr=0.1, batch_size=16, epochs=1), seed=0, device=dev,
                   server_unlabeled=train.inputs(torch.arange(40, device=dev)) if unlabeled else None)


def _params(seed):
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in _net().named_parameters()}


def _softmax(v):
    e = [math.exp(a) for a in v]
    return [a / sum(e) for a in e]


# ------------------------------------------------------------------------------------------------
# the distribution over global models
# ------------------------------------------------------------------------------------------------
def test_gaussian_fit_matches_hand_computation():
    a = {"w": torch.tensor([1.0, -2.0, 0.5]), "b": torch.tensor([3.0])}
    b = {"w": torch.tensor([3.0, 2.0, 0.5]), "b": torch.tensor([-1.0])}
    c = {"w": torch.tensor([0.0, 1.0, 0.5]), "b": torch.tensor([0.0])}
    sizes = [10, 30, 60]
    mean, var = FB.fit_gaussian([a, b, c], sizes)
    pi = [0.1, 0.3, 0.6]
    for name in ("w", "b"):
        for j in range(a[name].numel()):
            vals = [float(p[name][j]) for p in (a, b, c)]
            mu = sum(p * v for p, v in zip(pi, vals))
            s2 = sum(p * (v - mu) ** 2 for p, v in zip(pi, vals))
            assert float(mean[name][j]) == pytest.approx(mu, abs=1e-6)
            assert float(var[name][j]) == pytest.approx(s2, abs=1e-6)
    assert float(var["w"][2]) == 0.0   # all clients agree on this coordinate
    assert mean["w"].dtype == torch.float32 and var["b"].shape == (1,)


def test_gaussian_sampling_statistics_and_identical_clients():
    members = [_params(1), _params(2), _params(3)]
    sizes = [5, 10, 25]
    mean, var = FB.fit_gaussian(members, sizes)
    n = 4000
    draws = FB.sample_gaussian(mean, var, n, torch.Generator().manual_seed(0))
    for name in ("0.bias", "3.bias"):
        s = torch.stack([d[name] for d in draws]).double()
        sd = var[name].double().sqrt()
        assert torch.all((s.mean(0) - mean[name].double()).abs() <= 5 * sd / math.sqrt(n) + 1e-7)
        assert torch.allclose(s.var(0), var[name].double(), rtol=0.15, atol=1e-9)
    # std_scale scales the spread
    half = FB.sample_gaussian(mean, var, n, torch.Generator().manual_seed(0), std_scale=0.5)
    s = torch.stack([d["3.bias"] for d in half]).double()
    assert torch.allclose(s.var(0), 0.25 * var["3.bias"].double(), rtol=0.15)
    # the draws are seeded: same generator seed, same models
    again = FB.sample_gaussian(mean, var, 2, torch.Generator().manual_seed(0))
    assert all(torch.equal(again[0][k], draws[0][k]) for k in mean)
    # identical clients: zero variance, every sample is the mean
    same = [_params(4)] * 3
    m2, v2 = FB.fit_gaussian(same, sizes)
    assert all(float(v2[k].abs().max()) == 0.0 for k in v2)
    for d in FB.sample_gaussian(m2, v2, 5, torch.Generator().manual_seed(1)):
        for k in d:
            assert torch.allclose(d[k], same[0][k], rtol=0, atol=1e-7)


def test_released_fit_normalised_updates_by_hand():
    start = {"w": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])}
    c1 = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([2.0])}     # update (3, 4), norm 5; b: +1
    c2 = {"w": torch.tensor([0.0, 2.0]), "b": torch.tensor([1.0])}     # update (0, 2), norm 2; b: 0 (did not move)
    mean_u, var_u, norm = FB.fit_gaussian_released([c1, c2], start)
    u = [[0.6, 0.8], [0.0, 1.0]]                                       # unweighted, whatever the data sizes
    for j in range(2):
        m = (u[0][j] + u[1][j]) / 2
        v = (u[0][j] ** 2 + u[1][j] ** 2) / 2 - m ** 2
        assert float(mean_u["w"][j]) == pytest.approx(m, abs=1e-6)
        assert float(var_u["w"][j]) == pytest.approx(max(v, 1e-5), abs=1e-6)
    assert norm["w"] == pytest.approx(3.5) and norm["b"] == pytest.approx(0.5)
    assert float(mean_u["b"]) == pytest.approx(0.5) and float(var_u["b"]) == pytest.approx(0.25)  # u = 1 and 0
    # std_scale 0: start + mean norm x mean direction
    (s,) = FB.sample_gaussian_released(start, mean_u, var_u, norm, 1, torch.Generator().manual_seed(0), std_scale=0.0)
    assert torch.allclose(s["w"], torch.tensor([3.5 * 0.3, 3.5 * 0.9]))
    assert torch.allclose(s["b"], torch.tensor([1.0 + 0.5 * 0.5]))


def test_dirichlet_concentration_and_convex_samples():
    conc = FB.dirichlet_concentration([10, 30, 60], 2.0)
    assert np.allclose(conc, [2.0 * 3 * 0.1, 2.0 * 3 * 0.3, 2.0 * 3 * 0.6])
    assert np.allclose(FB.dirichlet_concentration([7, 7], 1.0), [1.0, 1.0])
    members = [_params(1), _params(2), _params(3)]
    samples, gammas = FB.sample_dirichlet(members, conc, 3000, np.random.default_rng(0))
    assert gammas.shape == (3000, 3) and np.allclose(gammas.sum(1), 1.0) and (gammas >= 0).all()
    assert np.allclose(gammas.mean(0), [0.1, 0.3, 0.6], atol=0.02)   # E[γ] = π: the mean model is FedAvg's
    for s, g in zip(samples[:3], gammas[:3]):
        for k in s:
            want = sum(float(gi) * m[k].double() for gi, m in zip(g, members))
            assert torch.allclose(s[k].double(), want, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# ensemble and pseudo-labels
# ------------------------------------------------------------------------------------------------
def test_ensemble_members_and_pseudo_labels_by_hand():
    lin = nn.Linear(2, 3)
    ws = [{"weight": torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), "bias": torch.tensor([0.0, 0.5, -1.0])},
          {"weight": torch.tensor([[-1.0, 2.0], [0.5, 0.0], [0.0, 0.0]]), "bias": torch.tensor([1.0, 0.0, 0.0])},
          {"weight": torch.zeros(3, 2), "bias": torch.tensor([0.0, 0.0, 2.0])}]
    mean, samples, clients = ws[0], [ws[1]], [ws[2], ws[1]]
    ens = FB.build_ensemble(["mean", "samples", "clients"], mean, samples, clients)
    assert [id(p) for p in ens] == [id(ws[0]), id(ws[1]), id(ws[2]), id(ws[1])]
    assert FB.build_ensemble(["mean", "samples"], mean, samples, clients) == [mean, samples[0]]
    assert FB.build_ensemble(["clients"], mean, samples, clients) == clients
    x = torch.tensor([[0.5, -1.0], [2.0, 1.0]])

    def probs(w, xi):
        logits = [sum(float(w["weight"][c, j]) * xi[j] for j in range(2)) + float(w["bias"][c]) for c in range(3)]
        return _softmax(logits)
    got = FB.pseudo_labels(lin, ens, x, batch_size=1)
    got_sharp = FB.pseudo_labels(lin, ens, x, temperature=0.5)
    for i, xi in enumerate(x.tolist()):
        avg = [sum(probs(w, xi)[c] for w in ens) / 4 for c in range(3)]
        assert got[i].tolist() == pytest.approx(avg, abs=1e-6)
        sq = [a * a for a in avg]
        assert got_sharp[i].tolist() == pytest.approx([s / sum(sq) for s in sq], abs=1e-6)   # [code] temp 0.5


def test_aggregate_uses_exactly_the_configured_members():
    setup = _setup()
    a, b, start = _params(1), _params(2), _params(0)
    msgs = [Message(0, 15, {"params": a}), Message(1, 45, {"params": b})]
    algo = ALGORITHMS.get("fedbe")({**TINY, "num_samples": 3, "epochs": 0}, setup)
    out = algo.aggregate(msgs, {"params": start}, 1)
    ens = out["extra_eval"]["ensemble"]
    assert len(ens) == 1 + 3 + 2
    for k in a:
        assert torch.allclose(ens[0][k], 0.25 * a[k] + 0.75 * b[k], atol=1e-6)       # the data-size weighted mean
        assert torch.equal(ens[4][k], a[k]) and torch.equal(ens[5][k], b[k])           # the clients
        assert torch.allclose(out["extra_eval"]["fedavg"][k], ens[0][k])
        assert torch.allclose(out["params"][k], ens[0][k])                            # 0 epochs: the student = mean
    again = algo.sample_models([a, b], [15, 45], start, ens[0], 1)                      # samples: seeded per round
    assert all(torch.equal(again[m][k], ens[1 + m][k]) for m in range(3) for k in a)
    other = algo.sample_models([a, b], [15, 45], start, ens[0], 2)
    assert not all(torch.equal(other[0][k], ens[1][k]) for k in a)
    only = ALGORITHMS.get("fedbe")({**TINY, "ensemble": ["clients"], "epochs": 0}, setup)
    assert len(only.aggregate(msgs, {"params": start}, 1)["extra_eval"]["ensemble"]) == 2
    # the pseudo-labels handed to distillation are the average softmax of exactly those members
    seen = {}
    algo.distill = lambda s, x, t, r: (seen.update(t=t), (s, s, []))[1]
    algo.aggregate(msgs, {"params": start}, 1)
    want = FB.pseudo_labels(setup.model, ens, setup.server_unlabeled)
    assert torch.allclose(seen["t"], want, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# SWA and distillation
# ------------------------------------------------------------------------------------------------
def test_weight_average_is_the_mean_of_its_snapshots():
    avg = FB.WeightAverage()
    snaps = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, -2.0])}, {"w": torch.tensor([5.0, 3.0])}]
    for s in snaps:
        avg.update(s)
    assert avg.n == 3 and torch.allclose(avg.avg["w"], torch.tensor([3.0, 1.0]))
    snaps[0]["w"].add_(100.0)   # snapshots are copied, not aliased
    assert torch.allclose(avg.avg["w"], torch.tensor([3.0, 1.0]))


def test_distill_swa_averages_the_scheduled_snapshots(monkeypatch):
    setup = _setup()
    taken = []

    class Recording(FB.WeightAverage):
        def update(self, params):
            taken.append({k: v.detach().clone() for k, v in params.items()})
            super().update(params)
    monkeypatch.setattr(FB, "WeightAverage", Recording)
    algo = ALGORITHMS.get("fedbe")({"epochs": 3, "batch_size": 8, "swa_start": 4, "swa_freq": 3, "lr": 0.05}, setup)
    x = setup.server_unlabeled                                      # 40 samples / 8 = 5 steps per epoch, 15 in all
    t = FB.pseudo_labels(setup.model, [_params(1), _params(2)], x)
    final, last, trace = algo.distill(_params(0), x, t, 1)
    assert len(taken) == len([s for s in range(1, 16) if s > 4 and s % 3 == 0]) == 4   # steps 6, 9, 12, 15
    assert [r["swa_snapshots"] for r in trace] == [0, 2, 4] and trace[-1]["steps"] == 15
    for k in final:
        assert torch.allclose(final[k], torch.stack([s[k] for s in taken]).mean(0), atol=1e-6)
        assert torch.equal(last[k], taken[-1][k])                   # step 15 is the last step and a snapshot
    assert not all(torch.allclose(final[k], last[k]) for k in final)
    # SWA off, or not reached: the last iterate
    off = ALGORITHMS.get("fedbe")({"epochs": 3, "batch_size": 8, "swa": False, "lr": 0.05}, setup)
    f2, l2, _ = off.distill(_params(0), x, t, 1)
    late = ALGORITHMS.get("fedbe")({"epochs": 3, "batch_size": 8, "swa_start": 500, "lr": 0.05}, setup)
    f3, _, tr3 = late.distill(_params(0), x, t, 1)
    for k in f2:
        assert torch.equal(f2[k], l2[k]) and torch.allclose(l2[k], last[k], atol=1e-6)   # the same SGD path
        assert torch.allclose(f3[k], last[k], atol=1e-6)
    assert tr3[-1]["swa_snapshots"] == 0


def test_kl_reductions():
    s = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    p = torch.tensor([[0.2, 0.5, 0.3], [0.0, 0.9, 0.1]])
    kl = []
    for si, pi in zip(s.tolist(), p.tolist()):
        q = _softmax(si)
        kl.append(sum(a * (math.log(a) - math.log(b)) for a, b in zip(pi, q) if a > 0))
    assert float(FB.kl_to_targets(s, p, "batchmean")) == pytest.approx(sum(kl) / 2, rel=1e-5)
    assert float(FB.kl_to_targets(s, p, "mean_as_released")) == pytest.approx(sum(kl) / 6, rel=1e-5)


def test_distillation_lowers_kl_to_pseudo_labels():
    setup = _setup()
    x = setup.server_unlabeled
    t = FB.pseudo_labels(setup.model, [_params(1), _params(2), _params(3)], x)
    start = _params(0)

    def kl(p):
        with torch.no_grad():
            return float(FB.kl_to_targets(torch.func.functional_call(setup.model, p, (x,)), t, "batchmean"))
    algo = ALGORITHMS.get("fedbe")({"epochs": 10, "batch_size": 8, "lr": 0.05, "kl_reduction": "batchmean",
                                    "swa_start": 20, "swa_freq": 5}, setup)
    final, last, trace = algo.distill(start, x, t, 1)
    assert kl(final) < 0.6 * kl(start) and kl(last) < 0.6 * kl(start)
    assert trace[-1]["kd_loss"] < trace[0]["kd_loss"] and len(trace) == 10


def test_two_rounds_with_run_rounds():
    setup = _setup()
    algo = ALGORITHMS.get("fedbe")(TINY, setup)
    state, logs = run_rounds(setup, algo, _params(0), 2, progress=False)
    nparams = sum(t.numel() for t in _params(0).values())
    assert [l.uplink_bytes for l in logs] == [2 * 4 * nparams] * 2 and all(l.server_s > 0 for l in logs)
    for l in logs:
        for key in ("accuracy", "fedavg_accuracy", "ensemble_accuracy", "fedbe_last_accuracy"):
            assert 0 <= l.metrics[key] <= 100
    assert algo.client_stage_key(1) == {} and algo.client_stage_key(2) is None
    assert state["trace"][0]["round"] == 2


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------
def test_yaml_defaults_load_and_match_the_code():
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/algorithm/fedbe.yaml"))
    assert cfg.pop("name") == "fedbe"
    assert set(cfg) == {f.name for f in dataclasses.fields(FB.FedBE.Options)}
    algo = ALGORITHMS.get("fedbe")(cfg, _setup())
    assert (algo.num_samples, algo.ensemble, algo.epochs, algo.batch_size, algo.lr, algo.swa, algo.temperature) == \
        (10, ["mean", "samples", "clients"], 20, 128, 1e-3, True, 1.0)
    default = ALGORITHMS.get("fedbe")({}, _setup())   # the YAML and the code's defaults agree
    assert all(getattr(default, a) == getattr(algo, a) for a in
               ("distribution", "gaussian_fit", "std_scale", "kl_reduction", "swa_start", "swa_freq", "swa_lr",
                "momentum", "weight_decay", "dirichlet_alpha"))


@pytest.mark.parametrize("cfg,needle", [
    ({"distribution": "laplace"}, "distribution"),
    ({"gaussian_fit": "swag"}, "gaussian_fit"),
    ({"ensemble": "mean"}, "ensemble"),
    ({"ensemble": []}, "ensemble"),
    ({"ensemble": ["mean", "teachers"]}, "ensemble"),
    ({"ensemble": ["mean", "mean"]}, "ensemble"),
    ({"num_samples": 0}, "num_samples"),
    ({"num_samples": -1}, "num_samples"),
    ({"temperature": 0.0}, "temperature"),
    ({"std_scale": -1.0}, "std_scale"),
    ({"swa_freq": 0}, "swa_freq"),
    ({"swa": "yes"}, "swa"),
    ({"swa_lr": 0.0}, "swa_lr"),
    ({"kl_reduction": "sum"}, "kl_reduction"),
    ({"lr": -1}, "lr"),
    ({"server_lr": 0.01}, "unknown"),
])
def test_bad_config_fails_in_init(cfg, needle):
    with pytest.raises(FedbenchError, match=needle):
        ALGORITHMS.get("fedbe")(cfg, _setup())


def test_missing_server_data_is_refused():
    with pytest.raises(FedbenchError, match="unlabelled server data"):
        ALGORITHMS.get("fedbe")({}, _setup(unlabeled=False))
    assert ALGORITHMS.get("fedbe")({"num_samples": 0, "ensemble": ["mean", "clients"]}, _setup()).num_samples == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    outs = []
    for dev in ("cpu", "cuda"):
        setup = _setup(device=dev)
        algo = ALGORITHMS.get("fedbe")({**TINY, "epochs": 2}, setup)
        msgs = [Message(0, 15, {"params": {k: v.to(dev) for k, v in _params(1).items()}}),
                Message(1, 45, {"params": {k: v.to(dev) for k, v in _params(2).items()}})]
        outs.append(algo.aggregate(msgs, {"params": {k: v.to(dev) for k, v in _params(0).items()}}, 1))
    cpu, gpu = outs
    for k in cpu["params"]:
        assert gpu["params"][k].is_cuda
        assert torch.allclose(cpu["extra_eval"]["ensemble"][1][k], gpu["extra_eval"]["ensemble"][1][k].cpu(),
                              atol=1e-6)   # samples drawn on the CPU: the same models on every device
        assert torch.allclose(cpu["params"][k], gpu["params"][k].cpu(), atol=1e-4)


# ------------------------------------------------------------------------------------------------
# end to end through run.py
# ------------------------------------------------------------------------------------------------
def test_run_py_aggregators_fedavg_fedbe_shared_clients(tmp_path):
    tiny = "{name:fedbe,num_samples:2,epochs:1,batch_size:16,swa_start:0,swa_freq:2}"
    run(SMALL + ["rounds=1", "server_unlabeled.size=60", "server_unlabeled.mode=sampled_from_train",
                 f"aggregators=[fedavg,{tiny}]"], tmp_path)
    recs = {json.loads(p.read_text())["algorithm"]: (p, json.loads(p.read_text())) for p in records(tmp_path)}
    assert set(recs) == {"fedavg", "fedbe"}
    path, rec = recs["fedbe"]
    avg = recs["fedavg"][1]
    assert rec["status"] == "ok" and 0 <= rec["metrics"]["accuracy"] <= 100
    assert rec["cache"]["hits"] >= 1                               # the clients fedavg trained, from the cache
    assert sum(rec["partition"]["client_sizes"]) == 600            # sampled_from_train leaves the clients' data
    assert rec["communication"]["uplink_bytes"] == 3 * 4 * rec["model"]["num_parameters"] \
        == avg["communication"]["uplink_bytes"]
    assert rec["timing"]["server_s"] > 0
    # the FedAvg mean kept in FedBE's record is the FedAvg run's model
    assert rec["metrics"]["fedavg_accuracy"] == pytest.approx(avg["metrics"]["accuracy"], abs=1e-9)
    for key in ("ensemble_accuracy", "fedbe_last_accuracy", "ensemble_nll"):
        assert key in rec["metrics"]
    rows = list(csv.DictReader(open(path.parent / "trace.csv")))
    assert [r["epoch"] for r in rows] == ["1"]


def test_run_py_two_rounds_holdout(tmp_path):
    run(SMALL + ["rounds=2", "algorithm=fedbe", "algorithm.num_samples=2", "algorithm.epochs=1",
                 "algorithm.swa_start=0", "server_unlabeled.size=60"], tmp_path)
    (path,) = records(tmp_path)
    rec = json.loads(path.read_text())
    assert rec["status"] == "ok" and rec["rounds_completed"] == 2
    assert sum(rec["partition"]["client_sizes"]) == 600 - 60       # holdout: FedBE's protocol
    hist = list(csv.DictReader(open(path.parent / "history.csv")))
    assert [h["round"] for h in hist] == ["1", "2"] and all(float(h["ensemble_accuracy"]) >= 0 for h in hist)
    assert rec["communication"]["uplink_bytes"] == 2 * 3 * 4 * rec["model"]["num_parameters"]


def test_run_py_one_line_errors_before_training(tmp_path):
    out = tmp_path / "bad"
    for args, needle in ((["algorithm=fedbe"], "unlabelled server data"),
                         (["algorithm=fedbe", "server_unlabeled.size=60", "algorithm.ensemble=[mean,teachers]"],
                          "ensemble")):
        p = run(SMALL + ["rounds=1"] + args, out, expect=2)
        lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("fedbench: error:") and needle in lines[0], p.stderr
    assert records(out) == []
