"""fedfisher_full (notes/fedfisher.md §1.8, Figure 1): the client Fisher against a dense Jacobian, the server's
closed form against the normal equations / converged GD, GD against the closed form, one run.py run, bad config."""
import json
import math

import pytest
import torch

from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.base import Message
from fedbench.algorithms.fedfisher_full import closed_form, laplace_objective, server_gd
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup
from fedbench.fl.products import ProductStage
from fedbench.models import build_model
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData
from tests.test_run import records, run


def _setup(width=3, task="regression", sizes=(7, 5)):
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    x = torch.randn(n, 2, generator=g)
    x = x / x.norm(dim=1, keepdim=True)
    y = torch.randn(n, generator=g)
    torch.manual_seed(0)
    model = build_model("two_layer_relu", input_shape=(2,), num_classes=None, width=width)
    train = TrainData(x, y, task="regression")
    idx, s = [], 0
    for k in sizes:
        idx.append(torch.arange(s, s + k))
        s += k
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx,
                   local=LocalTrainConfig(optimizer="sgd", lr=0.1, momentum=0.0, batch_size=100, epochs=3), seed=0,
                   device=torch.device("cpu"), task=task)


def test_client_fisher_is_dense_jacobian_gram():
    setup = _setup(width=4)
    algo = ALGORITHMS.get("fedfisher_full")({}, setup)
    g = torch.Generator().manual_seed(1)
    params = {"fc1.weight": torch.randn(4, 2, generator=g)}
    a = setup.model.a.double()
    assert [n for n, _ in setup.model.named_parameters()] == ["fc1.weight"]     # a_r is a fixed buffer
    for cid in range(2):
        x, _ = setup.client_data(cid)
        x = x.double()

        def f(w):
            return torch.relu(x @ w.T) @ a                                        # f(x) = sum_r a_r ReLU(w_r . x)

        J = torch.func.jacrev(f)(params["fc1.weight"].double()).reshape(len(x), -1)   # [n, m p], row-major W
        F = ProductStage(setup).compute(algo, cid, params, {}, 1)["fisher"]["F"]
        assert F.dtype == torch.float64 and F.shape == (8, 8)
        assert torch.allclose(F, J.T @ J / len(x), atol=1e-10, rtol=0)


def _rand_system(d, rows, g):
    """Per-client F_i = A_iᵀ A_i / r_i and weights W_i; returns F, b, w̄ and the parts (p = (1/2, 1/2))."""
    As = [torch.randn(r, d, generator=g, dtype=torch.float64) for r in rows]
    Fs = [A.T @ A / A.shape[0] for A in As]
    Ws = [torch.randn(d, generator=g, dtype=torch.float64) for _ in rows]
    p = [0.5, 0.5]
    F = sum(pi * Fi for pi, Fi in zip(p, Fs))
    b = sum(pi * Fi @ Wi for pi, Fi, Wi in zip(p, Fs, Ws))
    return F, b, sum(pi * Wi for pi, Wi in zip(p, Ws)), Fs, Ws, p


def test_closed_form_normal_equations_and_min_distance_limit():
    g = torch.Generator().manual_seed(2)
    F, b, wb, Fs, Ws, p = _rand_system(5, (4, 6), g)                        # full rank
    w, rank = closed_form(F, b, wb)
    assert rank == 5 and torch.allclose(w, torch.linalg.solve(F, b), atol=1e-10)
    F, b, wb, Fs, Ws, p = _rand_system(8, (2, 3), g)                        # rank 5 < d = 8
    w, rank = closed_form(F, b, wb)
    assert rank == 5
    assert torch.allclose(F @ w, b, atol=1e-10)                             # a minimiser ...
    lam, V = torch.linalg.eigh(F)
    null = V[:, lam < 1e-10 * lam.max()]
    assert null.shape[1] == 3 and (null.T @ (w - wb)).abs().max() < 1e-10   # ... that moved only within range(F)
    lr = 1.0 / float(lam.max())
    assert torch.allclose(server_gd(F, b, wb, lr, 20000), w, atol=1e-8)     # = GD's limit from w̄ (Lemma 1)
    assert laplace_objective(w, Fs, Ws, p) < laplace_objective(wb, Fs, Ws, p)


def _messages(setup, Ws, Fs):
    return [Message(k, len(setup.client_indices[k]), {"params": {"fc1.weight": W.float().reshape(3, 2)}, "fisher": F})
            for k, (W, F) in enumerate(zip(Ws, Fs))]


def test_server_gd_approaches_closed_form():
    setup = _setup(width=3, sizes=(6, 6))
    g = torch.Generator().manual_seed(3)
    F, b, wb, Fs, Ws, p = _rand_system(6, (3, 2), g)
    msgs = _messages(setup, Ws, Fs)
    state = {"params": {"fc1.weight": torch.zeros(3, 2)}}
    exact = ALGORITHMS.get("fedfisher_full")({"server": "closed_form"}, setup).aggregate(msgs, state, 1)
    lr = 0.5 / float(torch.linalg.eigvalsh(F).max())                         # gd steps on 2 x the mean (M p_i = 1)
    gaps = []
    for steps in (10, 100, 20000):
        algo = ALGORITHMS.get("fedfisher_full")({"server": "gd", "server_lr": lr, "server_steps": steps}, setup)
        out = algo.aggregate(msgs, state, 1)
        gaps.append(float((out["params"]["fc1.weight"] - exact["params"]["fc1.weight"]).abs().max()))
        em = out["extra_metrics"]
        assert em["laplace_objective"] <= em["fedavg_laplace_objective"] + 1e-12
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-6, gaps
    # one step = Algorithm 1's sum over clients: w̄ − η_S Σ_i F_i (w̄ − W_i) (equal sizes: M p_i = 1)
    Wm = [m.payload["params"]["fc1.weight"].double().reshape(-1) for m in msgs]
    w1 = ALGORITHMS.get("fedfisher_full")({"server": "gd", "server_lr": lr, "server_steps": 1}, setup)
    one = w1.aggregate(msgs, state, 1)["params"]["fc1.weight"].double().reshape(-1)
    w_bar = (Wm[0] + Wm[1]) / 2
    assert torch.allclose(one, w_bar - lr * sum(Fi @ (w_bar - Wi) for Fi, Wi in zip(Fs, Wm)), atol=1e-6)
    assert exact["extra_metrics"]["fisher_rank"] == 5
    assert set(exact["extra_metrics"]) >= {"global_train_loss", "fedavg_train_loss"}


def test_run_records_global_train_loss(tmp_path):
    args = ["dataset=fedfisher_synthetic", "partition=natural", "model=two_layer_relu", "model.width=4",
            "num_clients=2", "rounds=1", "local.epochs=20", "local.batch_size=100", "local.lr=0.1",
            "local.momentum=0.0", "hardware=cpu", "progress=false",
            "aggregators=[fedfisher_full,{name:fedfisher_full,server:closed_form}]"]
    p = run(args, tmp_path)
    assert p.stdout.count("fedbench: fedfisher_full on fedfisher_synthetic") == 2
    recs = [json.loads(r.read_text()) for r in records(tmp_path)]
    assert sorted(r["config"]["algorithm"]["server"] for r in recs) == ["closed_form", "gd"]
    d = 2 * 4
    for rec in recs:
        m = rec["metrics"]
        assert rec["status"] == "ok" and rec["model"]["num_parameters"] == d
        for k in ("global_train_loss", "fedavg_train_loss", "laplace_objective", "fedavg_laplace_objective"):
            assert math.isfinite(m[k]), k
        # the server minimises the Laplace objective from the average: never above the average's
        assert m["laplace_objective"] <= m["fedavg_laplace_objective"] + 1e-12
        assert rec["communication"]["uplink_bytes"] == 2 * (4 * d + 8 * d * d)   # float32 W_i + float64 d x d F_i
    assert recs[0]["metrics"]["fedavg_train_loss"] == pytest.approx(recs[1]["metrics"]["fedavg_train_loss"])


def test_bad_config_one_line(tmp_path):
    setup = _setup()
    for cfg, needle in (({"sever": "gd"}, "unknown algorithm key"), ({"server": "adam"}, "algorithm.server"),
                        ({"server_lr": 0}, "server_lr"), ({"max_params": 4}, "max_params")):
        with pytest.raises(FedbenchError, match=needle):
            ALGORITHMS.get("fedfisher_full")(cfg, setup)
    with pytest.raises(FedbenchError, match="regression"):
        ALGORITHMS.get("fedfisher_full")({}, _setup(task="classification"))
    p = run(["dataset=synthetic", "dataset.kwargs.train_size=60", "dataset.kwargs.test_size=20", "model=mlp",
             "num_clients=2", "rounds=1", "algorithm=fedfisher_full", "hardware=cpu", "progress=false"],
            tmp_path, expect=2)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedbench: error:") and "regression" in lines[0], p.stderr
