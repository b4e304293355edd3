"""Fisher Merge and RegMean (notes/fedfisher.md §2, fedbens.md §2): closed forms, least squares,
fallbacks, α selection on the server validation set, and the five one-shot aggregators end to end
through run.py on one set of cached clients."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.base import Message
from fedbench.algorithms.fisher_merge import fisher_merge
from fedbench.algorithms.regmean import compute_grams, reduce_non_diag, regmean_linear
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup
from fedbench.fl.products import ProductStage
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# Fisher Merge
# ------------------------------------------------------------------------------------------------
def test_fisher_merge_closed_form_equal_fishers_and_floor():
    g = torch.Generator().manual_seed(0)
    p = [0.5, 0.3, 0.2]
    Ws = [{"a": torch.randn(4, 3, generator=g, dtype=torch.float64)} for _ in p]
    Fs = [{"a": torch.rand(4, 3, generator=g, dtype=torch.float64) + 0.1} for _ in p]
    out = fisher_merge(Ws, Fs, p)["a"]
    closed = sum(pi * F["a"] * W["a"] for pi, F, W in zip(p, Fs, Ws)) / sum(pi * F["a"] for pi, F in zip(p, Fs))
    assert torch.allclose(out, closed, atol=1e-12)
    fedavg = sum(pi * W["a"] for pi, W in zip(p, Ws))
    same = [{"a": Fs[0]["a"].clone()} for _ in p]
    assert torch.allclose(fisher_merge(Ws, same, p)["a"], fedavg, atol=1e-12)
    # Σ p F below the floor: the FedAvg value (the code); clamp mode: every F_i floored instead
    tiny = [{"a": F["a"].clone()} for F in Fs]
    for F in tiny:
        F["a"][0, 0] = 1e-9
    fm = fisher_merge(Ws, tiny, p, floor=1e-6)["a"]
    assert fm[0, 0] == pytest.approx(float(fedavg[0, 0]), abs=1e-12)
    assert torch.allclose(fm.flatten()[1:], closed.flatten()[1:], atol=1e-12)
    fc = fisher_merge(Ws, tiny, p, floor=1e-6, floor_mode="clamp")["a"]
    assert fc[0, 0] == pytest.approx(float(fedavg[0, 0]), abs=1e-12)   # all clamped to 1e-6: equal weights
    tiny[0]["a"][1, 1] = 1e-9
    fc = fisher_merge(Ws, tiny, p, floor=1e-6, floor_mode="clamp")["a"]
    F11 = [1e-6, float(tiny[1]["a"][1, 1]), float(tiny[2]["a"][1, 1])]
    expect = sum(pi * f * float(W["a"][1, 1]) for pi, f, W in zip(p, F11, Ws)) / sum(pi * f for pi, f in zip(p, F11))
    assert fc[1, 1] == pytest.approx(expect, rel=1e-10)


def _setup(model, x, y, sizes, server_val=True):
    idx, s = [], 0
    for k in sizes:
        idx.append(torch.arange(s, s + k))
        s += k
    train = TrainData(x, y)
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx,
                   local=LocalTrainConfig(optimizer="sgd", lr=0.1, batch_size=16, epochs=1), seed=0,
                   device=torch.device("cpu"), server_val=(x[:30], y[:30]) if server_val else None)


def _result(n):
    return SimpleNamespace(steps=[1] * n, mean_loss=[0.0] * n)


def test_fisher_merge_algorithm_on_raw_messages_and_bytes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3, 2))
    setup = _setup(model, torch.randn(40, 3), torch.randint(0, 2, (40,)), (10, 30))
    algo = ALGORITHMS.get("fisher_merge")({"compression": False}, setup)
    g = torch.Generator().manual_seed(1)
    Ws = [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(2)]
    Fs = [{n: torch.rand(p.shape, generator=g) + 0.1 for n, p in model.named_parameters()} for _ in range(2)]
    msgs = [Message(k, n, {"params": Ws[k], "fisher": Fs[k]}) for k, n in enumerate((10, 30))]
    out = algo.aggregate(msgs, algo.init_state({n: p.detach() for n, p in model.named_parameters()}), 1)["params"]
    ref = fisher_merge(Ws, Fs, [0.25, 0.75])
    for n in out:
        assert torch.allclose(out[n], ref[n], atol=1e-6)
    # a real client message: 16-bit weights and Fisher
    q = ALGORITHMS.get("fisher_merge")({}, setup)
    m = ProductStage(setup).message(q, 0, Ws[0], _result(2), 0, {}, 1)
    assert m.nbytes == 2 * (2 * 8 + 4 * 2)


# ------------------------------------------------------------------------------------------------
# RegMean
# ------------------------------------------------------------------------------------------------
def test_regmean_single_linear_is_least_squares_merge():
    g = torch.Generator().manual_seed(2)
    sizes, d_in, d_out = (20, 35, 15), 4, 3
    Xs = [torch.randn(n, d_in, generator=g, dtype=torch.float64) + k for k, n in enumerate(sizes)]
    Ws = [torch.randn(d_out, d_in, generator=g, dtype=torch.float64) for _ in sizes]
    Gs = [X.t() @ X / X.shape[0] for X in Xs]
    p = [n / sum(sizes) for n in sizes]
    merged = regmean_linear(Ws, Gs, p, alpha=1.0)
    X = torch.cat(Xs)
    Y = torch.cat([Xi @ Wi.t() for Xi, Wi in zip(Xs, Ws)])
    lstsq = (torch.linalg.pinv(X) @ Y).t()                   # argmin_W Σ_i ||X_i Wᵀ − X_i W_iᵀ||²
    assert torch.allclose(merged, lstsq, atol=1e-10)
    dense = sum(W @ (pi * G) for W, pi, G in zip(Ws, p, Gs)) @ torch.linalg.pinv(sum(pi * G for pi, G in zip(p, Gs)))
    assert torch.allclose(merged, dense, atol=1e-10)
    # α < 1 scales the off-diagonals of every p_i G_i
    Gr = [reduce_non_diag(pi * G, 0.1) for pi, G in zip(p, Gs)]
    assert torch.allclose(Gr[0].diagonal(), p[0] * Gs[0].diagonal()) and torch.allclose(Gr[0][0, 1], 0.1 * p[0] * Gs[0][0, 1])
    dense_a = sum(W @ G for W, G in zip(Ws, Gr)) @ torch.linalg.pinv(sum(Gr))
    assert torch.allclose(regmean_linear(Ws, Gs, p, alpha=0.1), dense_a, atol=1e-10)
    # identical clients: the client
    assert torch.allclose(regmean_linear([Ws[0]] * 3, Gs, p, alpha=0.5), Ws[0], atol=1e-10)


def test_regmean_grams_and_algorithm_merge():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 2, 2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))
    x = torch.randn(60, 1, 3, 3)
    y = torch.randint(0, 3, (60,))
    setup = _setup(model, x, y, (20, 40))
    # Grams of the Linear inputs: (1/N) Σ a aᵀ
    G = compute_grams(model, x[:20], {"3": "3.weight", "5": "5.weight"}, batch_size=7)
    h = model[2](model[1](model[0](x[:20])))
    assert torch.allclose(G["3"], h.t() @ h / 20, atol=1e-5)
    h2 = model[4](model[3](h))
    assert torch.allclose(G["5"], h2.t() @ h2 / 20, atol=1e-5)
    algo = ALGORITHMS.get("regmean")({"compression": False, "alphas": [0.9]}, setup)
    g = torch.Generator().manual_seed(4)
    Ws = [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(2)]
    msgs = [ProductStage(setup).message(algo, k, Ws[k], _result(2), k, {}, 1) for k in range(2)]
    out = algo.aggregate(msgs, algo.init_state({n: p.detach() for n, p in model.named_parameters()}), 1)["params"]
    p = [1 / 3, 2 / 3]
    for name in ("0.weight", "0.bias", "3.bias", "5.bias"):                 # conv and biases: unweighted mean
        assert torch.allclose(out[name], (Ws[0][name] + Ws[1][name]) / 2, atol=1e-6)
    Gs = [msgs[k].payload["grams"]["3"].double() for k in range(2)]
    ref = regmean_linear([W["3.weight"].double() for W in Ws], Gs, p, 0.9)
    assert torch.allclose(out["3.weight"].double(), ref, atol=1e-5)
    assert msgs[0].nbytes == 4 * sum(p.numel() for p in model.parameters()) + 4 * (8 * 8 + 4 * 4)
    # identical clients through the algorithm: the client's Linear weights come back
    same = [ProductStage(setup).message(algo, k, Ws[0], _result(2), k, {}, 1) for k in range(2)]
    out2 = algo.aggregate(same, {"params": {n: p.detach() for n, p in model.named_parameters()}}, 1)["params"]
    for n in Ws[0]:
        assert torch.allclose(out2[n], Ws[0][n], atol=1e-4), n


def test_regmean_alpha_selected_on_validation_and_compressed_bytes():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 5, bias=False), nn.ReLU(), nn.Linear(5, 3, bias=False))
    x = torch.randn(90, 6)
    y = torch.randint(0, 3, (90,))
    setup = _setup(model, x, y, (30, 60))
    algo = ALGORITHMS.get("regmean")({"alphas": [0.1, 0.5, 0.9]}, setup)
    g = torch.Generator().manual_seed(6)
    Ws = [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(2)]
    msgs = [ProductStage(setup).message(algo, k, Ws[k], _result(2), k, {}, 1) for k in range(2)]
    state = algo.aggregate(msgs, {"params": {n: p.detach() for n, p in model.named_parameters()}}, 1)
    accs = [a for _, a in state["alpha_trace"]]
    assert [a for a, _ in state["alpha_trace"]] == [0.1, 0.5, 0.9]
    k = accs.index(max(accs))
    from fedbench.algorithms.fedfisher import decode_any, decode_params
    cand = algo.merge([decode_params(m.payload["params"]) for m in msgs],
                      [{kk: decode_any(v) for kk, v in m.payload["grams"].items()} for m in msgs],
                      [1 / 3, 2 / 3], [0.1, 0.5, 0.9][k], [0.5, 0.5])
    for n in cand:
        assert torch.allclose(state["params"][n], cand[n])
    # compressed: 16-bit weights + rank-r SVD of each Gram at 9 bits (255 levels), one max per U, S, Vh
    import math
    d = 6 * 5 + 5 * 3
    r = max(1, (16 * d) // (8 * ((2 * 6 + 1) + (2 * 5 + 1))))
    fac = sum(3 * 4 + 2 * math.ceil(b * min(b, r) * 9 / 8) + math.ceil(min(b, r) * 9 / 8) for b in (6, 5))
    assert algo.rank == r and msgs[0].nbytes == 2 * d + 4 * 2 + fac
    with pytest.raises(FedbenchError, match="server validation set"):
        ALGORITHMS.get("regmean")({}, _setup(model, x, y, (30, 60), server_val=False))
    ALGORITHMS.get("regmean")({"alphas": [0.5]}, _setup(model, x, y, (30, 60), server_val=False))
    with pytest.raises(FedbenchError, match="alphas"):
        ALGORITHMS.get("regmean")({"alphas": [1.5]}, setup)


# ------------------------------------------------------------------------------------------------
# run.py: five one-shot aggregators on one set of cached clients
# ------------------------------------------------------------------------------------------------
def test_run_five_aggregators_share_clients(tmp_path):
    env = {**os.environ, "FEDBENCH_OUTPUTS": str(tmp_path / "out"), "FEDBENCH_DATA": str(tmp_path / "data"),
           "HYDRA_FULL_ERROR": "0"}
    args = ["dataset=synthetic", "dataset.kwargs.like=fmnist", "dataset.kwargs.train_size=240",
            "dataset.kwargs.test_size=60", "model=lenet", "num_clients=3", "local.epochs=1", "rounds=1",
            "hardware=cpu", "progress=false", "server_val.size=50",
            "aggregators=[fedavg,{name:fedfisher_diag,steps:300},{name:fedfisher_kfac,steps:300},fisher_merge,regmean]"]
    p = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = [json.loads(f.read_text()) for f in sorted((tmp_path / "out" / "runs").glob("*/metrics.json"))]
    by = {r["algorithm"]: r for r in recs}
    assert sorted(by) == ["fedavg", "fedfisher_diag", "fedfisher_kfac", "fisher_merge", "regmean"]
    assert all(r["status"] == "ok" and 0 <= r["metrics"]["accuracy"] <= 100 for r in recs)
    assert by["fedavg"]["cache"]["misses"] >= 1
    for name in ("fedfisher_diag", "fedfisher_kfac", "fisher_merge", "regmean"):
        assert by[name]["cache"]["hits"] >= 1, name            # trained clients reused
    assert by["fisher_merge"]["cache"]["hits"] >= 1 + 3         # ... and fedfisher_diag's cached Fisher
    P = by["fedavg"]["model"]["num_parameters"]
    assert by["fedavg"]["communication"]["uplink_bytes"] == 3 * 4 * P
    assert by["fedfisher_diag"]["communication"]["uplink_bytes"] == 3 * (2 * 2 * P + 2 * 4 * 5)   # 5 tensors
    assert by["fisher_merge"]["communication"]["uplink_bytes"] == by["fedfisher_diag"]["communication"]["uplink_bytes"]
    up = by["fedfisher_kfac"]["communication"]["uplink_bytes"] / (3 * 4 * P)
    assert 0.9 < up < 1.2                                        # matched to FedAvg's budget (§1.6)
