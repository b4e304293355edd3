"""DENSE (notes/fedlpa.md §2, fedfisher.md §2, reference-code.md §7): loss terms against hand computations,
BN hooks, pool growth and quantisation, ensemble weighting, selection, distillation progress, configs, run.py."""
import json
import math

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from fedbench.algorithms import dense as D
from fedbench.algorithms.base import ALGORITHMS, Message
from fedbench.algorithms.common import client_weights
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData
from tests.test_run import ROOT, SMALL, records, run

TINY = {"epochs": 2, "g_steps": 2, "synthesis_batch_size": 8, "kd_batch_size": 4, "nz": 4, "ngf": 2}


pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(server_val=True, n=60, mean=None, std=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(128, 3))
    train = TrainData(x, y, mean=mean, std=std)
    idx = [torch.arange(0, 15), torch.arange(15, 60)]
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx,
                   local=LocalTrainConfig(lr=0.1, batch_size=16, epochs=1), seed=0, device=torch.device("cpu"),
                   server_val=(train.inputs(torch.arange(10)), y[:10]) if server_val else None)


def _params(setup, seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(128, 3))
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _softmax(v):
    e = [math.exp(a) for a in v]
    return [a / sum(e) for a in e]


# ------------------------------------------------------------------------------------------------
# loss terms
# ------------------------------------------------------------------------------------------------
def test_kd_loss_matches_hand_kl_with_T_squared():
    s = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    t = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]])
    T = 2.5
    want = 0.0
    for si, ti in zip(s.tolist(), t.tolist()):
        p = _softmax([a / T for a in ti])
        q = _softmax([a / T for a in si])
        want += sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))
    want = want / 2 * T * T
    assert float(D.kd_loss(s, t, T)) == pytest.approx(want, rel=1e-5)
    assert float(D.kd_loss(t, t, T)) == pytest.approx(0.0, abs=1e-6)


def test_adv_loss_masks_agreeing_samples():
    s = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.3, 0.2, 0.1]])
    t = torch.tensor([[1.0, 0.5, 0.0], [3.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    # argmax: sample 0 agrees (0 vs 0); samples 1 and 2 disagree
    kl = []
    for si, ti in zip(s.tolist(), t.tolist()):
        p, q = _softmax(ti), _softmax(si)
        kl.append(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q)))
    want = -(kl[1] + kl[2]) / 3          # mean over the whole batch, masked sample counts as 0
    assert float(D.adv_loss(s, t)) == pytest.approx(want, rel=1e-5)
    assert float(D.adv_loss(t, t)) == 0.0   # student agrees everywhere: no adversarial signal


def test_oh_loss_random_and_teacher_argmax_targets():
    t = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    y = torch.tensor([0, 1])
    want = -(math.log(_softmax([1.0, 2.0, 0.0])[0]) + math.log(_softmax([0.0, 0.0, 3.0])[1])) / 2
    assert float(D.oh_loss(t, y)) == pytest.approx(want, rel=1e-6)
    want_am = -(math.log(_softmax([1.0, 2.0, 0.0])[1]) + math.log(_softmax([0.0, 0.0, 3.0])[2])) / 2
    assert float(D.oh_loss(t, t.argmax(1))) == pytest.approx(want_am, rel=1e-6)


def test_bn_term_hand_computation_and_member_buffers():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 9, 3)).eval()
    bn = model[1]
    bn.running_mean.copy_(torch.tensor([0.2, -0.1]))
    bn.running_var.copy_(torch.tensor([1.5, 0.7]))
    x = torch.randn(4, 1, 3, 3)
    h = model[0](x).detach()
    mean = [h[:, c].mean().item() for c in range(2)]
    var = [((h[:, c] - mean[c]) ** 2).mean().item() for c in range(2)]   # biased, as the code
    want = math.sqrt(sum((rv - v) ** 2 for rv, v in zip([1.5, 0.7], var))) + \
        math.sqrt(sum((rm - m) ** 2 for rm, m in zip([0.2, -0.1], mean)))
    hook = D.BNStatHook(model)
    assert hook.active
    model(x)
    assert float(hook.pop(x).detach()) == pytest.approx(want, rel=1e-5)
    # per-member buffers through functional_call: the hook reads the member's running statistics
    p = {n: t.detach() for n, t in model.named_parameters()}
    p["1.running_mean"], p["1.running_var"] = torch.zeros(2), torch.ones(2)
    torch.func.functional_call(model, p, (x,))
    want0 = math.sqrt(sum((1 - v) ** 2 for v in var)) + math.sqrt(sum(m ** 2 for m in mean))
    assert float(hook.pop(x).detach()) == pytest.approx(want0, rel=1e-5)
    # gradient reaches the input (it is what trains the generator)
    xg = x.clone().requires_grad_(True)
    model(xg)
    hook.pop(x).backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0
    hook.remove()
    model(x)
    assert float(hook.pop(x)) == 0.0
    assert not D.BNStatHook(nn.Linear(2, 2)).active   # fedbench's models: the term is inert


# ------------------------------------------------------------------------------------------------
# generator, pool, ensemble
# ------------------------------------------------------------------------------------------------
def test_generator_shapes_and_seeded_reset():
    for shape in [(1, 28, 28), (3, 32, 32)]:
        g = D.Generator(nz=8, ngf=4, shape=shape)
        out = g(torch.randn(5, 8)).detach()
        assert out.shape == (5, *shape) and 0 <= float(out.min()) and float(out.max()) <= 1
    g1, g2 = D.Generator(8, 4, (1, 8, 8)), D.Generator(8, 4, (1, 8, 8))
    g1.reset(torch.Generator().manual_seed(3))
    g2.reset(torch.Generator().manual_seed(3))
    for a, b in zip(g1.parameters(), g2.parameters()):
        assert torch.equal(a, b)
    assert abs(float(g1.l1.weight.detach().std()) - 0.02) < 0.005 and float(g1.l1.bias.detach().abs().max()) == 0.0


def test_pool_quantisation_on_the_255_grid():
    x = torch.tensor([[[[0.0, 0.5, 0.999, 1.2], [-0.1, 0.1, 0.2, 0.3]]]])
    pool = D.ImagePool(quantize=True)
    pool.add(x)
    got = pool.images()
    assert torch.equal(got * 255, torch.round(got * 255))
    assert torch.allclose(got, torch.floor(x.clamp(0, 1) * 255) / 255)   # the code's truncation
    pool.add(x)
    assert len(pool) == 2
    raw = D.ImagePool(quantize=False)
    raw.add(x)
    assert torch.equal(raw.images(), x)


def test_ensemble_weighting_uniform_vs_num_samples():
    assert client_weights([10, 30], "uniform") == [0.5, 0.5]
    assert client_weights([10, 30], "num_samples") == [0.25, 0.75]
    setup = _setup()
    a, b = _params(setup, 1), _params(setup, 2)
    x = setup.train.inputs(torch.arange(5))
    fa = torch.func.functional_call(setup.model, a, (x,))
    fb = torch.func.functional_call(setup.model, b, (x,))
    assert torch.allclose(D.teacher_logits(setup.model, [a, b], [0.5, 0.5], x), (fa + fb) / 2, atol=1e-6)
    assert torch.allclose(D.teacher_logits(setup.model, [a, b], [0.25, 0.75], x), 0.25 * fa + 0.75 * fb, atol=1e-6)
    # the algorithm uses the message sizes: 15 and 45 samples
    algo = ALGORITHMS.get("dense")({**TINY, "teacher_weighting": "num_samples", "epochs": 1}, setup)
    seen = {}
    algo.distill = lambda members, w, start, r: (seen.update(w=w), (start, [], start))[1]
    algo.init_state(a)
    msgs = [Message(0, 15, {"params": a}), Message(1, 45, {"params": b})]
    algo.aggregate(msgs, {"params": a}, 1)
    assert seen["w"] == [0.25, 0.75]


# ------------------------------------------------------------------------------------------------
# the server loop
# ------------------------------------------------------------------------------------------------
def test_pool_grows_by_synthesis_batch_and_run_is_seeded():
    setup = _setup()
    cfg = {**TINY, "epochs": 3}
    algo = ALGORITHMS.get("dense")(cfg, setup)
    members = [_params(setup, 1), _params(setup, 2)]
    best, trace, last = algo.distill(members, [0.5, 0.5], _params(setup, 0), 1)
    assert [r["pool"] for r in trace] == [8, 16, 24]
    best2, _, _ = ALGORITHMS.get("dense")(cfg, setup).distill(members, [0.5, 0.5], _params(setup, 0), 1)
    for n in best:
        assert torch.equal(best[n], best2[n])
    assert any(not torch.equal(best[n], _params(setup, 0)[n]) for n in best)   # the student moved


def test_validation_selection_picks_best_epoch():
    setup = _setup()
    algo = ALGORITHMS.get("dense")({**TINY, "epochs": 4, "select": "val_accuracy"}, setup)
    scores, seen = iter([30.0, 90.0, 90.0, 50.0]), []

    def fake_score(params):
        seen.append({n: t.clone() for n, t in params.items()})
        return next(scores)
    algo._score = fake_score
    best, trace, last = algo.distill([_params(setup, 1), _params(setup, 2)], [0.5, 0.5], _params(setup, 0), 1)
    assert [r["score"] for r in trace] == [30.0, 90.0, 90.0, 50.0]
    for n in best:   # epoch 2 (the first of the tie: strictly better wins), not the last
        assert torch.equal(best[n], seen[1][n]) and torch.equal(last[n], seen[3][n])
    assert not all(torch.equal(best[n], last[n]) for n in best)
    # real validation metric runs too (server_val present)
    a2 = ALGORITHMS.get("dense")({**TINY, "select": "val_accuracy"}, setup)
    _, tr, _ = a2.distill([_params(setup, 1)], [1.0], _params(setup, 0), 1)
    assert all(0.0 <= r["score"] <= 100.0 for r in tr)


def test_student_moves_toward_teacher():
    setup = _setup()
    algo = ALGORITHMS.get("dense")({**TINY, "kd_batch_size": 16, "lr": 0.05, "augment_kd": "none"}, setup)
    members = [_params(setup, 1), _params(setup, 2)]
    teacher = setup.model
    student = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(128, 3))
    with torch.no_grad():
        for n, p in student.named_parameters():
            p.copy_(_params(setup, 0)[n])
    pool = D.ImagePool(False)
    pool.add(torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(5)))
    x = pool.images()

    def kl():
        with torch.no_grad():
            return float(D.kd_loss(student(x), D.teacher_logits(teacher, members, [0.5, 0.5], x), algo.T))
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)
    k0 = kl()
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        algo.kd_epoch(student, teacher, members, [0.5, 0.5], opt, pool, None, g)
    assert kl() < 0.7 * k0


def test_synthesis_lowers_generator_objective():
    """More generator steps: the kept (lowest-loss) batch has a lower one-hot CE than the first step's."""
    setup = _setup()
    members = [_params(setup, 1)]

    def ce_of_kept(steps):
        algo = ALGORITHMS.get("dense")({**TINY, "g_steps": steps, "adv": 0.0, "augment_synthesis": "none",
                                        "oh_targets": "teacher_argmax", "lr_g": 0.05}, setup)
        gen = D.Generator(algo.nz, algo.ngf, algo.shape)
        hook = D.BNStatHook(setup.model)
        x = algo.synthesize(gen, setup.model, nn.Identity(), members, [1.0], hook, None,
                            torch.Generator().manual_seed(0))
        t = D.teacher_logits(setup.model, members, [1.0], x)
        return float(D.oh_loss(t, t.argmax(1)))
    assert ce_of_kept(15) < ce_of_kept(1)


def test_fedavg_student_init_and_one_shot_run_rounds():
    setup = _setup()
    algo = ALGORITHMS.get("dense")({**TINY, "student_init": "fedavg", "epochs": 1, "lr": 1e-12,
                                    "momentum": 0.0, "teacher_weighting": "num_samples"}, setup)
    a, b = _params(setup, 1), _params(setup, 2)
    algo.init_state(_params(setup, 0))
    out = algo.aggregate([Message(0, 15, {"params": a}), Message(1, 45, {"params": b})], {"params": a}, 1)
    for n in a:   # lr ~ 0: the student stays at the data-size weighted average
        assert torch.allclose(out["params"][n], 0.25 * a[n] + 0.75 * b[n], atol=1e-6)
    state, logs = run_rounds(setup, ALGORITHMS.get("dense")(TINY, setup), _params(setup, 0), 1, progress=False)
    nparams = sum(t.numel() for t in _params(setup, 0).values())
    assert logs[0].uplink_bytes == 2 * 4 * nparams and logs[0].server_s > 0
    assert 0 <= logs[0].metrics["accuracy"] <= 100


# ------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------
def test_published_configurations_load():
    fedlpa = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/algorithm/dense.yaml"))
    ff = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/algorithm/dense_fedfisher.yaml"))
    assert fedlpa["name"] == ff["name"] == "dense" and set(fedlpa) == set(ff)
    assert (fedlpa["epochs"], fedlpa["adv"], fedlpa["lr"], fedlpa["teacher_weighting"], fedlpa["student_init"]) == \
        (200, 1.0, 0.005, "uniform", "fresh")
    assert (ff["epochs"], ff["adv"], ff["lr"], ff["T"], ff["teacher_weighting"], ff["student_init"], ff["select"]) == \
        (20, 0.5, 0.01, 20.0, "num_samples", "fedavg", "val_accuracy")
    setup = _setup()
    for cfg in (fedlpa, ff):
        cfg = {k: v for k, v in cfg.items() if k != "name"}
        algo = ALGORITHMS.get("dense")(cfg, setup)
        assert algo.nz == 256 and algo.ngf == 64 and algo.g_steps == 30
    with pytest.raises(FedbenchError, match="server validation"):
        ALGORITHMS.get("dense")({k: v for k, v in ff.items() if k != "name"}, _setup(server_val=False))


def test_aggregator_entry_names_the_yaml_not_the_method():
    """{name: dense_fedfisher, lr: 0.001} = FedFisher's DENSE configuration with one value changed (Table 3's
    pretrained student lr); the method stays dense, and FedFisher/FedBEns presets use that configuration."""
    from fedbench.config.aggregators import expand_aggregators
    cfg = OmegaConf.create({"aggregators": ["dense", {"name": "dense_fedfisher", "lr": 0.001}], "algorithm": {}})
    plain, ff = expand_aggregators(cfg, ROOT / "conf")
    assert plain.algorithm.name == ff.algorithm.name == "dense"
    assert (plain.algorithm.teacher_weighting, ff.algorithm.teacher_weighting) == ("uniform", "num_samples")
    assert ff.algorithm.lr == 0.001 and ff.algorithm.epochs == 20
    for preset in ("fedfisher/table2", "fedfisher/table3", "fedbens/table1", "fedbens/table2"):
        aggs = OmegaConf.to_container(OmegaConf.load(ROOT / f"conf/experiment/{preset}.yaml"))["aggregators"]
        names = [a if isinstance(a, str) else a["name"] for a in aggs]
        assert "dense_fedfisher" in names and "dense" not in names, preset


@pytest.mark.parametrize("cfg,needle", [
    ({"select": "best_test"}, "select"),
    ({"epochs": 0}, "epochs"),
    ({"T": -1.0}, "T"),
    ({"adv": -0.5}, "adv"),
    ({"teacher_weighting": "softmax"}, "teacher_weighting"),
    ({"pool_quantize": "yes"}, "pool_quantize"),
    ({"lr_gen": 0.1}, "unknown"),
])
def test_bad_config_fails_in_init(cfg, needle):
    with pytest.raises(FedbenchError, match=needle):
        ALGORITHMS.get("dense")(cfg, _setup())


def test_rejects_non_image_inputs():
    s = _setup()
    s.train = TrainData(torch.randn(10, 6), torch.zeros(10, dtype=torch.long))
    with pytest.raises(FedbenchError, match="image"):
        ALGORITHMS.get("dense")({}, s)


# ------------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------------
def test_run_py_aggregators_fedavg_dense(tmp_path):
    tiny = "{name:dense,epochs:2,g_steps:2,synthesis_batch_size:16,kd_batch_size:8,nz:8,ngf:4,select:val_accuracy}"
    run(SMALL + ["rounds=1", "server_val.size=50", f"aggregators=[fedavg,{tiny}]"], tmp_path)
    recs = {json.loads(p.read_text())["algorithm"]: json.loads(p.read_text()) for p in records(tmp_path)}
    assert set(recs) == {"fedavg", "dense"}
    d = recs["dense"]
    assert d["status"] == "ok" and 0 <= d["metrics"]["accuracy"] <= 100
    assert d["cache"]["hits"] >= 1                               # the shared cached clients
    assert d["communication"]["uplink_bytes"] == recs["fedavg"]["communication"]["uplink_bytes"]
    assert d["timing"]["server_s"] > 0
    assert "dense_last_accuracy" in d["metrics"]
    # the per-epoch server trace lands beside the record (pool size grows by the synthesis batch each epoch)
    import csv
    rows = list(csv.DictReader(open(records(tmp_path)[0].parent.parent / d["run_id"] / "trace.csv")))
    assert [int(r["pool"]) for r in rows] == [16, 32] and all(float(r["synthesis_s"]) > 0 for r in rows)


def test_run_py_bad_config_one_line(tmp_path):
    p = run(SMALL + ["rounds=1", "algorithm=dense", "algorithm.select=best_test"], tmp_path, expect=2)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedbench: error:") and "select" in lines[0], p.stderr
    assert records(tmp_path) == []


def test_extrapolate_cost_from_a_reduced_trace():
    # synthesis 10 s per epoch; KD 0.01 s per pooled image, the pool growing by 100 images an epoch
    trace = [{"epoch": e, "pool": 100 * e, "synthesis_s": 10.0, "kd_s": 0.01 * 100 * e} for e in (1, 2, 3)]
    est = D.extrapolate_cost(trace, 200)
    assert est["measured_s"] == pytest.approx(30 + 6)
    assert est["synthesis_s"] == pytest.approx(2000) and est["kd_s_per_image"] == pytest.approx(0.01)
    assert est["kd_s"] == pytest.approx(0.01 * 100 * 200 * 201 / 2)
    assert est["total_s"] == pytest.approx(est["synthesis_s"] + est["kd_s"])
    # the reduced run itself is reproduced exactly
    assert D.extrapolate_cost(trace, 3)["total_s"] == pytest.approx(est["measured_s"])
    with pytest.raises(ValueError):
        D.extrapolate_cost([], 10)


def test_dense_cost_script(tmp_path, capsys):
    import csv

    from tests.script_loader import load_script
    main = load_script("dense_cost.py").main
    rows = [{"epoch": 1, "kd_loss": 0.1, "pool": 256, "synthesis_s": 50.0, "kd_s": 0.1},
            {"epoch": 2, "kd_loss": 0.1, "pool": 512, "synthesis_s": 52.0, "kd_s": 0.2}]
    with open(tmp_path / "trace.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main([str(tmp_path), "--epochs", "20"]) == 0
    out = capsys.readouterr().out
    assert "full:    20 epochs" in out and "reduced: 2 epochs" in out
    assert main([str(tmp_path / "missing"), "--epochs", "20"]) == 2
    assert main([str(tmp_path)]) == 2
    assert "--epochs" in capsys.readouterr().err
    (tmp_path / "trace.csv").write_text("epoch,kd_loss\n1,0.5\n")   # another method's trace
    assert main([str(tmp_path), "--epochs", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a DENSE trace" in err[0]
