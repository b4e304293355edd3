"""FedLap / FedLap-Cov / FedLap-Func (notes/fedlap.md §1.4–1.6): fixed points, one-round exactness,
dual-update signs and scales, bytes, ρ rules, config errors, memory points and the server problem."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fedbench.algorithms import fedlap as fl  # importing registers fedlap, fedlap_cov, fedlap_func
from fedbench.algorithms.base import ALGORITHMS
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.fl.products import ProductStage
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, train_clients


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# problems
# ------------------------------------------------------------------------------------------------
def _split(sizes):
    idx, s = [], 0
    for k in sizes:
        idx.append(torch.arange(s, s + k))
        s += k
    return idx


def _logreg_setup(sizes=(40, 70, 25), epochs=15, lr=1.0):
    """Binary logistic regression, heterogeneous clients (shifted features), full-batch GD locally."""
    g = torch.Generator().manual_seed(0)
    d, n = 4, sum(sizes)
    x = torch.randn(n, d, generator=g)
    x[: sizes[0], 0] += 1.0
    x[sizes[0]: sizes[0] + sizes[1], 1] -= 1.0
    p = torch.sigmoid(x @ torch.tensor([1.5, -1.0, 0.5, 0.0]) + 0.3)
    y = (torch.rand(n, generator=g) < p).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(d, 1))
    train = TrainData(x, y)
    local = LocalTrainConfig(optimizer="sgd", lr=lr, batch_size=max(sizes), epochs=epochs)
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=_split(sizes),
                   local=local, seed=0, device=torch.device("cpu"))


def _orthogonal_regression_setup(sizes=(20, 30, 25), epochs=100):
    """Linear regression with ½ squared error; each client's design has orthogonal columns that are
    also orthogonal to the bias column, so its Hessian XᵀX (with bias) is exactly diagonal and the
    diagonal GGN is the exact Hessian."""
    g = torch.Generator().manual_seed(1)
    d = 3
    xs, ys = [], []
    for nk in sizes:
        z = torch.randn(nk, d, generator=g, dtype=torch.float64)
        z = z - z.mean(0)
        q, _ = torch.linalg.qr(z)                                   # orthonormal, orthogonal to 1
        scale = torch.sqrt(nk * (0.5 + torch.rand(d, generator=g, dtype=torch.float64)))
        xk = q * scale                                              # X_kᵀX_k = diag(scale²), X_kᵀ1 = 0
        yk = xk @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.7 \
            + 0.3 * torch.randn(nk, generator=g, dtype=torch.float64)
        xs.append(xk)
        ys.append(yk)
    x, y = torch.cat(xs).float(), torch.cat(ys).float()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(d, 1))
    train = TrainData(x, y, task="regression")
    local = LocalTrainConfig(optimizer="sgd", lr=0.8, batch_size=max(sizes), epochs=epochs)
    setup = FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=_split(sizes),
                    local=local, seed=0, device=torch.device("cpu"), task="regression")
    return setup, torch.cat(xs), torch.cat(ys)


def _mlp_setup(sizes=(30, 45, 25), backend="serial", epochs=2):
    """3-class toy problem with a small MLP; client 2 holds no class-2 point."""
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    last = slice(n - sizes[-1], n)
    y[last] = y[last].clamp(max=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    train = TrainData(x, y)
    local = LocalTrainConfig(optimizer="sgd", lr=0.1, batch_size=10, epochs=epochs)
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=_split(sizes),
                   local=local, seed=0, device=torch.device("cpu"), backend=backend)


def _init(setup):
    return {n: p.detach().clone() for n, p in setup.model.named_parameters()}


def _algo(setup, cfg):
    cfg = dict(cfg)
    return ALGORITHMS.get(cfg.pop("name"))(cfg, setup)


def _run(setup, cfg, rounds):
    return run_rounds(setup, _algo(setup, cfg), _init(setup), rounds, progress=False)


def _flat(params):
    return torch.cat([params[n].reshape(-1) for n in sorted(params)]).double()


def _nparams(setup):
    return sum(p.numel() for p in setup.model.parameters())


def _logreg_map(setup, delta):
    """Centralised MAP: argmin Σ_i BCE + (δ/2)||w||² over weights and bias, float64 L-BFGS."""
    x, y = setup.train.x.double(), setup.train.y.double()
    d = x.shape[1]
    w = torch.zeros(d + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1, max_iter=1000, tolerance_grad=1e-13, tolerance_change=1e-16,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w[:d] + w[d], y, reduction="sum") + 0.5 * delta * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def _as_vec(params):   # [weight..., bias] for the Flatten+Linear(d, 1) models
    return torch.cat([params["1.weight"].reshape(-1), params["1.bias"]]).double()


# ------------------------------------------------------------------------------------------------
# 1. FedLap's fixed point = centralised MAP with weight decay δ
# ------------------------------------------------------------------------------------------------
def test_fedlap_fixed_point_is_the_map_with_weight_decay_delta():
    delta = 10.0
    setup = _logreg_setup()
    want = _logreg_map(setup, delta)
    algo = _algo(setup, {"name": "fedlap", "delta": delta})          # rho = N_k/N (App. E default)
    state = algo.init_state(_init(setup))
    ids = [0, 1, 2]
    errs = {}
    for r in range(1, 51):
        res = train_clients(setup.model, setup.train, setup.client_indices, algo.start_params(state, ids),
                            setup.local, objective=algo.local_objective(state, ids, r), seed=0, round_idx=r,
                            client_ids=ids)
        msgs = [algo.client_message(c, res.params[c], res, c, state, r, {}) for c in ids]
        state = algo.aggregate(msgs, state, r)
        errs[r] = float((_as_vec(state["params"]) - want).abs().max())
    # tolerance: float32 local training; the iteration contracts by ~0.85 per round here
    assert errs[50] < 2e-4, errs
    assert errs[50] < errs[10] / 20
    # consensus at the fixed point: every client's w_k equals w_g
    for m in msgs:
        assert float((_as_vec(m.info["params"]) - _as_vec(state["params"])).abs().max()) < 2e-4
    # the tolerance is meaningful: the MAP with another δ, and the δ = 0 limit, are far away
    assert float((_logreg_map(setup, 5.0) - want).abs().max()) > 2e-2
    # duals at the fixed point: δ v_k = −∇ℓ_k(w_g) (sum loss), float64 check
    wg = _as_vec(state["params"]).requires_grad_(True)
    for c, idx in enumerate(setup.client_indices):
        x, y = setup.train.x[idx].double(), setup.train.y[idx].double()
        loss = F.binary_cross_entropy_with_logits(x @ wg[:-1] + wg[-1], y, reduction="sum")
        (grad,) = torch.autograd.grad(loss, wg)
        torch.testing.assert_close(delta * _as_vec(state["v"][c]), -grad, atol=5e-3, rtol=0)


# ------------------------------------------------------------------------------------------------
# 2. FedLap-Cov with exact Hessians on a quadratic problem: global optimum in one round
# ------------------------------------------------------------------------------------------------
def test_fedlap_cov_exact_hessian_reaches_global_optimum_in_one_round():
    delta = 1.0
    setup, x, y = _orthogonal_regression_setup()
    xb = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1)
    want = torch.linalg.solve(xb.T @ xb + delta * torch.eye(4, dtype=torch.float64), xb.T @ y)  # global MAP
    # ρ = 1: the undamped PVI update, exact for Gaussian likelihoods (§1.3); the diag-GGN is exact here
    state, _ = _run(setup, {"name": "fedlap_cov", "delta": delta, "rho": 1.0}, rounds=1)
    got = _as_vec(state["params"])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    # S_g = δ + Σ_k H_k = diag(XᵀX) + δ
    torch.testing.assert_close(_as_vec(state["precision"]), torch.diag(xb.T @ xb) + delta, rtol=1e-4, atol=1e-3)
    # and the test can fail: damped Cov (ρ = 1/K) and plain FedLap are not exact after one round
    damped, _ = _run(_orthogonal_regression_setup()[0], {"name": "fedlap_cov", "delta": delta}, rounds=1)
    lap, _ = _run(_orthogonal_regression_setup()[0], {"name": "fedlap", "delta": delta, "rho": 1.0}, rounds=1)
    assert float((_as_vec(damped["params"]) - want).abs().max()) > 1e-2
    assert float((_as_vec(lap["params"]) - want).abs().max()) > 1e-2


def test_fedlap_cov_curvature_is_the_sum_scale_logistic_hessian_diagonal():
    setup = _logreg_setup()
    algo = _algo(setup, {"name": "fedlap_cov"})
    w = {"1.weight": torch.tensor([[0.3, -0.2, 0.1, 0.4]]), "1.bias": torch.tensor([0.1])}
    H = ProductStage(setup).compute(algo, 1, w, {}, 1)["H"]["H"]
    idx = setup.client_indices[1]
    x = setup.train.x[idx]
    p = torch.sigmoid(x @ w["1.weight"][0] + w["1.bias"])
    torch.testing.assert_close(H["1.weight"][0], (p * (1 - p))[:, None].mul(x * x).sum(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(H["1.bias"], (p * (1 - p)).sum().reshape(1), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# 3. signs and scales of the updates, bytes, ρ rules, config errors
# ------------------------------------------------------------------------------------------------
def test_dual_update_formulas():
    g = torch.Generator().manual_seed(3)
    r = lambda: {"a": torch.randn(2, 3, generator=g), "b": torch.randn(3, generator=g)}  # noqa: E731
    pos = lambda: {n: t.abs() + 0.1 for n, t in r().items()}  # noqa: E731
    v, wk, wg = r(), r(), r()
    out = fl.fedlap_dual_update(v, wk, wg, 0.25)
    for n in v:
        torch.testing.assert_close(out[n], v[n] + 0.25 * (wk[n] - wg[n]))
    V, H, S = pos(), pos(), pos()
    S = {n: S[n] + V[n] for n in S}                      # S_g ⪰ V_k (cavity precision ⪰ 0)
    v2, V2 = fl.cov_dual_update(v, V, H, wk, wg, S, 0.3)
    for n in v:
        Sk = H[n] - V[n] + S[n]
        torch.testing.assert_close(v2[n], v[n] + 0.3 * (Sk * wk[n] - S[n] * wg[n]))
        torch.testing.assert_close(V2[n], V[n] + 0.3 * (Sk - S[n]))          # = (1 − ρ)V + ρH
        torch.testing.assert_close(V2[n], 0.7 * V[n] + 0.3 * H[n])
        assert bool((V2[n] >= 0).all())
    w_g, S_g = fl.cov_server([v, v2], [V, V2], 2.0)
    for n in v:
        torch.testing.assert_close(S_g[n], 2.0 + V[n] + V2[n])
        torch.testing.assert_close(w_g[n], (v[n] + v2[n]) / S_g[n])


def test_local_terms_are_the_sum_scale_terms_divided_by_n_k():
    g = torch.Generator().manual_seed(4)
    w = {"a": torch.randn(4, generator=g, requires_grad=True)}
    v, wg = {"a": torch.randn(4, generator=g)}, {"a": torch.randn(4, generator=g)}
    delta, nk = 3.0, 50
    t = fl.fedlap_term(w, {"coef": torch.tensor(delta / nk), "v": v, "w_g": wg})
    (gr,) = torch.autograd.grad(t, w["a"])
    torch.testing.assert_close(gr, (delta / nk) * (v["a"] + w["a"].detach() - wg["a"]))
    V, S = {"a": torch.rand(4, generator=g)}, {"a": 1 + torch.rand(4, generator=g)}
    t = fl.fedlap_cov_term(w, {"inv_n": torch.tensor(1.0 / nk), "v": v, "V": V, "w_g": wg, "S_g": S})
    (gr,) = torch.autograd.grad(t, w["a"])
    wa = w["a"].detach()
    torch.testing.assert_close(gr, (v["a"] - V["a"] * wa + S["a"] * (wa - wg["a"])) / nk)


def test_fedlap_local_stationarity_on_the_sum_scale_and_round_one():
    """After converged local training: ∇ℓ_k(w_k) + δ v_k + δ (w_k − w_g) = 0 with the SUM loss ℓ_k
    (Eq. 9), in round 1 (v = 0, w_g = 0: local MAP) and round 2 (v ≠ 0); round 1 gives
    v_k = ρ_k w_k and w_g = Σ_k ρ_k w_k (N_k-weighted FedAvg of the local MAP models)."""
    delta = 2.0
    setup = _logreg_setup(epochs=300)
    algo = _algo(setup, {"name": "fedlap", "delta": delta})
    state = algo.init_state(_init(setup))
    assert all(float(t.abs().max()) == 0 for t in state["params"].values())        # prior mean w_g⁽⁰⁾ = 0
    ids = [0, 1, 2]
    sizes = [len(i) for i in setup.client_indices]
    for r in (1, 2):
        res = train_clients(setup.model, setup.train, setup.client_indices, algo.start_params(state, ids),
                            setup.local, objective=algo.local_objective(state, ids, r), seed=0, round_idx=r,
                            client_ids=ids)
        msgs = [algo.client_message(c, res.params[c], res, c, state, r, {}) for c in ids]
        for c, idx in enumerate(setup.client_indices):
            wk = _as_vec(res.params[c]).requires_grad_(True)
            x, y = setup.train.x[idx].double(), setup.train.y[idx].double()
            loss = F.binary_cross_entropy_with_logits(x @ wk[:-1] + wk[-1], y, reduction="sum")
            (grad,) = torch.autograd.grad(loss, wk)
            resid = grad + delta * _as_vec(state["v"][c]) + delta * (wk.detach() - _as_vec(state["params"]))
            assert float(resid.abs().max()) < 1e-3 * sizes[c], (r, c, resid)
            rho = sizes[c] / sum(sizes)
            torch.testing.assert_close(_as_vec(msgs[c].payload["v"]),
                                       _as_vec(state["v"][c]) + rho * (wk.detach() - _as_vec(state["params"])))
        if r == 1:
            fedavg = sum(sizes[c] / sum(sizes) * _as_vec(res.params[c]) for c in ids)
        state = algo.aggregate(msgs, state, r)
        if r == 1:
            torch.testing.assert_close(_as_vec(state["params"]), fedavg)
            assert any(float(v.abs().max()) > 0.1 for vk in state["v"] for v in vk.values())


def test_duals_from_init_starts_the_server_rule_at_the_initial_weights():
    setup = _logreg_setup()
    init = _init(setup)
    for name in ("fedlap", "fedlap_cov", "fedlap_func"):
        st = _algo(setup, {"name": name, "init": "duals_from_init", "delta": 3.0}).init_state(init)
        torch.testing.assert_close(_as_vec(st["params"]), _as_vec(init), rtol=1e-6, atol=1e-6)
        st0 = _algo(setup, {"name": name}).init_state(init)
        assert float(_as_vec(st0["params"]).abs().max()) == 0
        assert _algo(setup, {"name": name}).start_params(st0, [0, 1, 2]) is st0["start"]   # random init


def test_uplink_and_downlink_bytes():
    setup = _mlp_setup()
    P, K = _nparams(setup), setup.num_clients
    _, logs = _run(setup, {"name": "fedlap"}, 1)
    assert logs[0].uplink_bytes == K * P * 4 and logs[0].downlink_bytes == K * P * 4
    _, logs = _run(_mlp_setup(), {"name": "fedlap_cov"}, 1)
    assert logs[0].uplink_bytes == 2 * K * P * 4 and logs[0].downlink_bytes == 2 * K * P * 4
    setup = _mlp_setup()
    algo = _algo(setup, {"name": "fedlap_func", "memory_per_class": 1, "server_iters": 5})
    _, logs = run_rounds(setup, algo, _init(setup), 1, progress=False)
    M = len(algo.mem_owner)
    assert M == 3 + 3 + 2                                     # client 2 has no class-2 point
    assert logs[0].uplink_bytes == K * P * 4 + M * 3 * 4      # P + |M_k| × C soft labels per client
    assert logs[0].downlink_bytes == K * P * 4


def test_rho_rules():
    assert fl.rho_value("nk_over_n", 30, 120, 4, 1) == pytest.approx(0.25)
    assert fl.rho_value("one_over_k", 30, 120, 5, 1) == pytest.approx(0.2)
    assert fl.rho_value(0.7, 30, 120, 5, 3) == pytest.approx(0.7)
    for r in range(1, 11):                                    # CIFAR: N_k/N for the first 10 rounds
        assert fl.rho_value("schedule", 30, 120, 5, r) == pytest.approx(0.25)
    for r in (11, 12, 50):                                    # ... then 1/K
        assert fl.rho_value("schedule", 30, 120, 5, r) == pytest.approx(0.2)
    assert fl.rho_value("schedule", 30, 120, 5, 4, schedule_rounds=3) == pytest.approx(0.2)
    setup = _mlp_setup()
    assert _algo(setup, {"name": "fedlap"}).rho == "nk_over_n"
    assert _algo(setup, {"name": "fedlap_cov"}).rho == "one_over_k"
    assert _algo(setup, {"name": "fedlap_func"}).rho == "nk_over_n"
    a = _algo(setup, {"name": "fedlap", "rho": "schedule", "rho_schedule_rounds": 2})
    assert a.rho_k(0, 2) == pytest.approx(30 / 100) and a.rho_k(0, 3) == pytest.approx(1 / 3)


@pytest.mark.parametrize("cfg", [
    {"name": "fedlap", "delta": 0.0},
    {"name": "fedlap", "delta": -1.0},
    {"name": "fedlap", "delta": "big"},
    {"name": "fedlap", "delta": float("nan")},
    {"name": "fedlap", "rho": 0.0},
    {"name": "fedlap", "rho": 1.5},
    {"name": "fedlap", "rho": "n_k/n"},
    {"name": "fedlap", "rho_schedule_rounds": -1},
    {"name": "fedlap", "init": "random"},
    {"name": "fedlap", "local_start": "zero"},
    {"name": "fedlap", "alpha": 0.1},
    {"name": "fedlap_cov", "fisher": "kfac"},
    {"name": "fedlap_cov", "hessian_at": "start"},
    {"name": "fedlap_cov", "mc_samples": 0},
    {"name": "fedlap_func", "tau": -1.0},
    {"name": "fedlap_func", "memory_per_class": 1.5},
    {"name": "fedlap_func", "client_sign": "minus_a"},
    {"name": "fedlap_func", "server_iters": -5},
    {"name": "fedlap_func", "server_lr": 0.0},
    {"name": "fedlap_func", "server_init": "zero"},
    {"name": "fedlap_func", "tau_weighting": "per_point"},
])
def test_bad_config_raises_one_line_error(cfg):
    with pytest.raises(FedbenchError) as e:
        _algo(_mlp_setup(), cfg)
    msg = str(e.value)
    assert "\n" not in msg and "algorithm" in msg


def test_fedlap_func_rejects_regression():
    setup, _, _ = _orthogonal_regression_setup()
    with pytest.raises(FedbenchError, match="classification"):
        _algo(setup, {"name": "fedlap_func"})


# ------------------------------------------------------------------------------------------------
# 4. FedLap-Func
# ------------------------------------------------------------------------------------------------
def test_fedlap_func_memory_points_per_class_and_tau():
    setup = _mlp_setup()
    algo = _algo(setup, {"name": "fedlap_func", "memory_per_class": 2, "tau": 0.5})
    y = setup.train.y
    for k, idx in enumerate(setup.client_indices):
        own = algo.mem_owner == k
        picked = algo.mem_index[own]
        assert set(picked.tolist()) <= set(idx.tolist())                    # the client's own data
        assert torch.equal(y[picked], algo.mem_class[own])                  # class = true label
        counts = torch.bincount(y[idx], minlength=3)
        for c in range(3):
            sel = algo.mem_class[own] == c
            assert int(sel.sum()) == min(2, int(counts[c]))                 # 2 per class, none if absent
            if counts[c] > 0:                                               # τ_i = τ_f N_kc / M_kc
                torch.testing.assert_close(algo.mem_tau[own][sel],
                                           torch.full((int(sel.sum()),), 0.5 * int(counts[c]) / 2))
    assert int((algo.mem_owner == 2).sum()) == 4                            # client 2 lacks class 2
    again = _algo(_mlp_setup(), {"name": "fedlap_func", "memory_per_class": 2, "tau": 0.5})
    assert torch.equal(again.mem_index, algo.mem_index)                     # fixed per seed
    uni = _algo(_mlp_setup(), {"name": "fedlap_func", "memory_per_class": 2, "tau_weighting": "uniform"})
    assert torch.all(uni.mem_tau == 1.0)


def test_fedlap_func_runs_and_server_objective_decreases():
    setup = _mlp_setup()
    algo = _algo(setup, {"name": "fedlap_func", "delta": 0.5, "tau": 1.0, "server_iters": 300, "server_lr": 0.01})
    seen = []

    def on_round(log):
        seen.append(log.metrics["accuracy"])

    state, logs = run_rounds(setup, algo, _init(setup), 3, progress=False, on_round=on_round)
    tr = state["server_objective"]
    assert len(tr) > 10 and tr[-1] < tr[0] - 1e-3                            # Adam decreased it
    assert all(math.isfinite(a) for a in seen)
    # the server's answer beats its initialisation Σ v_k on the server objective (and differs from it)
    v_sum = {n: sum(vk[n] for vk in state["v"]) for n in state["params"]}
    with torch.no_grad():
        f_opt = float(algo.server_objective(state["params"], state["soft"], v_sum))
        f_init = float(algo.server_objective(v_sum, state["soft"], v_sum))
    assert f_opt < f_init
    assert state["soft"].shape == (len(algo.mem_owner), 3)
    torch.testing.assert_close(state["soft"].sum(1), torch.ones(len(algo.mem_owner)))


def test_fedlap_func_without_memory_is_fedlap():
    a, _ = _run(_mlp_setup(), {"name": "fedlap_func", "memory_per_class": 0}, 2)
    b, _ = _run(_mlp_setup(), {"name": "fedlap"}, 2)
    for n in b["params"]:
        torch.testing.assert_close(a["params"][n], b["params"][n])


def test_fedlap_func_sign_minus_a_plus_b():
    """−A + B (§1.6): when one client owns every memory point and its previous soft labels equal the
    global model's, removing its own site (A) exactly cancels the distillation to the global model
    (B): the function-space part is identically zero. The literal −(A + B) instead pushes the
    model away from those labels (a nonzero gradient)."""
    setup = _mlp_setup()
    algo = _algo(setup, {"name": "fedlap_func", "memory_per_class": 1})
    w = {n: p.detach().clone().requires_grad_(True) for n, p in setup.model.named_parameters()}
    q = torch.softmax(torch.randn(len(algo.mem_owner), 3, generator=torch.Generator().manual_seed(5)), -1)
    base = {"coef": torch.tensor(0.0), "v": {n: torch.zeros_like(t) for n, t in w.items()},
            "w_g": {n: t.detach() for n, t in w.items()}}
    ctx = {**base, "mem_x": algo.mem_x, "tau": algo.mem_tau, "soft_prev": q, "soft_g": q,
           "own": torch.ones(len(algo.mem_owner)), "inv_n": torch.tensor(1.0 / 45)}
    for sign, zero in ((1.0, True), (-1.0, False)):
        grads = torch.autograd.grad(fl.FuncTerm(algo._fmodel, sign)(w, ctx), list(w.values()))
        gmax = max(float(g.abs().max()) for g in grads)
        assert (gmax < 1e-6) == zero, (sign, gmax)
    # B alone pulls towards the global predictions: with ŷ_g one-hot at the memory labels, a gradient
    # step on the default term lowers the CE of the other clients' memory points to those labels
    onehot = F.one_hot(algo.mem_class, 3).float()
    ctx2 = {**ctx, "soft_g": onehot, "own": torch.zeros(len(algo.mem_owner))}
    term = fl.FuncTerm(algo._fmodel, 1.0)
    before = float(term(w, ctx2).detach())
    grads = torch.autograd.grad(term(w, ctx2), list(w.values()))
    w2 = {n: (t - 0.05 * g).detach() for (n, t), g in zip(w.items(), grads)}
    assert float(term(w2, ctx2).detach()) < before


@pytest.mark.parametrize("name", ["fedlap", "fedlap_cov", "fedlap_func"])
def test_serial_and_batched_engines_agree(name):
    cfg = {"name": name, "server_iters": 20} if name == "fedlap_func" else {"name": name}
    a, _ = _run(_mlp_setup(backend="serial"), cfg, 2)
    b, _ = _run(_mlp_setup(backend="batched"), cfg, 2)
    for n in a["params"]:
        torch.testing.assert_close(a["params"][n], b["params"][n], rtol=1e-4, atol=1e-5)


def test_previous_local_options_run():
    st, _ = _run(_mlp_setup(), {"name": "fedlap", "local_start": "previous_local"}, 2)
    assert st["w_local"] is not None and len(st["w_local"]) == 3
    st, _ = _run(_mlp_setup(), {"name": "fedlap_cov", "hessian_at": "previous_local", "fisher": "mc"}, 2)
    assert all(bool((V[n] >= 0).all()) for V in st["V"] for n in V)


def test_fedlap_func_binary_logistic_runs():
    """One-logit models: soft labels are sigmoid outputs and ℓ is BCE with a soft target (UCI Credit)."""
    setup = _logreg_setup(epochs=3)
    algo = _algo(setup, {"name": "fedlap_func", "server_iters": 30, "server_lr": 0.01})
    state, logs = run_rounds(setup, algo, _init(setup), 2, progress=False)
    assert state["soft"].shape == (6, 1)                                     # 3 clients × 2 classes × 1
    assert bool(((state["soft"] > 0) & (state["soft"] < 1)).all())
    P = _nparams(setup)
    assert logs[1].uplink_bytes == 3 * P * 4 + 6 * 4
    assert state["server_objective"][-1] < state["server_objective"][0]


@pytest.mark.parametrize("opt", ["fedlap", "fedlap_cov", "fedlap_func"])
def test_yaml_composes_and_builds(opt):
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=[f"algorithm={opt}"])
    node = OmegaConf.to_container(cfg.algorithm, resolve=True)
    assert node["name"] == opt
    algo = _algo(_mlp_setup(), node)
    assert algo.delta == node["delta"] and algo.rho == node["rho"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["fedlap", "fedlap_cov", "fedlap_func"])
def test_runs_on_cuda(name):
    dev = torch.device("cuda")
    s = _mlp_setup()
    train = TrainData(s.train.x.to(dev), s.train.y.to(dev))
    setup = FLSetup(model=s.model.to(dev), train=train, test_inputs=train.inputs, test_y=train.y,
                    client_indices=[i.to(dev) for i in s.client_indices], local=s.local, seed=0, device=dev)
    cfg = {"name": name, "server_iters": 10} if name == "fedlap_func" else {"name": name}
    state, logs = _run(setup, cfg, 2)
    assert all(t.device.type == "cuda" for t in state["params"].values())
    assert math.isfinite(logs[-1].metrics["accuracy"])


def test_round_one_client_stage_is_shared_and_cached(tmp_path):
    """Round 1 (zero prior mean) is the same local problem for the three methods: one cached stage,
    and the cached run gives what a fresh run gives; FedLap-Cov's H_k is cached beside it."""
    from fedbench.fl.cache import ClientStageCache

    def cached_setup():
        s = _mlp_setup()
        s.cache = ClientStageCache(tmp_path / "cache")
        s.stage_parts = {"test": "fedlap", "seed": 0}
        return s

    _, logs = _run(cached_setup(), {"name": "fedlap", "delta": 2.0}, 2)
    assert not logs[0].cached_clients
    s = cached_setup()
    cov, logs = _run(s, {"name": "fedlap_cov", "delta": 2.0}, 2)
    assert logs[0].cached_clients and not logs[1].cached_clients       # later rounds depend on the duals
    cov_again, logs = _run(cached_setup(), {"name": "fedlap_cov", "delta": 2.0}, 2)
    assert logs[0].cached_clients
    fresh, _ = _run(_mlp_setup(), {"name": "fedlap_cov", "delta": 2.0}, 2)
    for n in fresh["params"]:
        torch.testing.assert_close(cov["params"][n], fresh["params"][n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cov_again["params"][n], cov["params"][n], rtol=0, atol=0)
    _, logs = _run(cached_setup(), {"name": "fedlap", "delta": 3.0}, 1)             # another δ: own entry
    assert not logs[0].cached_clients
    _, logs = _run(cached_setup(), {"name": "fedlap", "delta": 2.0, "init": "duals_from_init"}, 1)
    assert not logs[0].cached_clients
