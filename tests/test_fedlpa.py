"""FedLPA (notes/fedlpa.md §1.3–1.5): the server system against dense torch.kron solves, the
client factors against their formulas (KFC conv scaling, bias column, damping/π), bytes,
single/identical clients, the round-2 posterior term, config errors, and an end-to-end run."""
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from fedbench.algorithms import fedlpa as fl
from fedbench.algorithms.base import ALGORITHMS
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.fl.products import ProductStage
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, TrainResult

from tests.test_run import SMALL, records, run


pytestmark = pytest.mark.usefixtures("one_thread")


D = torch.float64


# ------------------------------------------------------------------------------------------------
# the per-layer system, pure functions
# ------------------------------------------------------------------------------------------------
def _spd(n, g, ridge=0.1):
    X = torch.randn(n, n + 2, generator=g, dtype=D)
    return X @ X.T / n + ridge * torch.eye(n, dtype=D)


def _problem(K=3, o=4, i=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    Gs = torch.stack([_spd(o, g) for _ in range(K)])
    As = torch.stack([_spd(i, g) for _ in range(K)])
    Ms = torch.randn(K, o, i, generator=g, dtype=D)
    p = torch.rand(K, generator=g, dtype=D) + 0.2
    return Gs, As, Ms, p / p.sum()


def _dense(Gs, As, Ms, p):
    """Σ p_k (A_k ⊗ G_k) vec(W) = Σ p_k (A_k ⊗ G_k) vec(W_k) on the column-stacked vec, i.e.
    kron(G_k, A_k) on the row-major flatten; returns (matrix, rhs, solution [o, i])."""
    Kd = sum(p[k] * torch.kron(Gs[k], As[k]) for k in range(len(p)))
    rhs = sum(p[k] * torch.kron(Gs[k], As[k]) @ Ms[k].flatten() for k in range(len(p)))
    return Kd, rhs, torch.linalg.solve(Kd, rhs).reshape(Ms.shape[1:])


def test_kron_op_and_column_vec_convention():
    Gs, As, Ms, p = _problem()
    Kd, rhs, _ = _dense(Gs, As, Ms, p)
    M = Ms[0]
    assert torch.allclose(fl.KronSystem(Gs, As, p)(M).flatten(), Kd @ M.flatten(), rtol=0, atol=1e-12)
    # the paper's form: (A ⊗ G) vec(M) with column-stacked vec
    vec = lambda X: X.T.reshape(-1)  # noqa: E731
    Kcol = sum(p[k] * torch.kron(As[k], Gs[k]) for k in range(3))
    assert torch.allclose(vec(fl.KronSystem(Gs, As, p)(M)), Kcol @ vec(M), rtol=0, atol=1e-12)


def test_ea_cg_gd_against_dense():
    Gs, As, Ms, p = _problem()
    Kd, rhs, M_star = _dense(Gs, As, Ms, p)
    M_ea, Z, A_bar, G_bar = fl.ea_solve(Gs, As, p, Ms)
    assert torch.allclose(Z.flatten(), rhs, rtol=0, atol=1e-12)
    # EA = exact solve of the Kronecker-of-sums system (App. E)
    ea_dense = torch.linalg.solve(torch.kron(G_bar, A_bar), rhs).reshape(M_star.shape)
    assert torch.allclose(M_ea, ea_dense, rtol=0, atol=1e-10)
    assert (M_ea - M_star).abs().max() > 1e-3            # heterogeneous factors: EA is biased
    for pre in ((G_bar, A_bar), None):
        M_cg, iters, rel = fl.cg_solve(Gs, As, p, Z, M_ea, tol=1e-12, max_iters=200, precond=pre)
        assert rel <= 1e-12 and iters <= 40       # n = 20 unknowns
        assert torch.allclose(M_cg, M_star, rtol=0, atol=1e-10)
    # GD on the mean-MSE with a stable step (lr < numel / λ_max(𝒜)², §1.4 [I] stability)
    lmax = float(torch.linalg.eigvalsh(Kd).max())
    lr = 0.9 * M_star.numel() / lmax ** 2
    M_gd = fl.gd_solve(Gs, As, p, Z, M_ea, 3000, lr)
    assert (M_gd - M_star).abs().max() < 1e-4 * (1 + M_star.abs().max())
    assert (fl.gd_solve(Gs, As, p, Z, M_ea, 30, lr) - M_star).norm() < (M_ea - M_star).norm()


def test_gd_is_autodiff_gd_on_mean_mse_and_lr_one_can_diverge():
    """Same iterates as torch.nn.MSELoss + autograd (the released code), step by step."""
    Gs, As, Ms, p = _problem(seed=1)
    M_ea, Z, _, _ = fl.ea_solve(Gs, As, p, Ms)
    M = M_ea.clone().requires_grad_(True)
    lr = 0.05
    for _ in range(5):
        R = sum(p[k] * Gs[k] @ M @ As[k] for k in range(3))
        loss = nn.MSELoss()(R, Z)
        (g,) = torch.autograd.grad(loss, M)
        M = (M - lr * g).detach().requires_grad_(True)
    assert torch.allclose(fl.gd_solve(Gs, As, p, Z, M_ea, 5, lr), M.detach(), rtol=0, atol=1e-12)
    # the code's lr = 1.0 on a 20-entry layer: GD on (1/n)||𝒜M − Z||² is stable iff lr < n / λ_max(𝒜)²
    Kd, _, M_star = _dense(Gs, As, Ms, p)
    lmax = float(torch.linalg.eigvalsh(Kd).max())
    assert 20 / lmax ** 2 < 1.0
    M1 = fl.gd_solve(Gs, As, p, Z, M_ea, 2000, 1.0)
    assert not torch.isfinite(M1).all() or (M1 - M_star).norm() > 1e6
    M2 = fl.gd_solve(Gs, As, p, Z, M_ea, 2000, 0.99 * 20 / lmax ** 2)
    assert (M2 - M_star).norm() < (M_ea - M_star).norm()


@pytest.mark.parametrize("K,o,i,seed", [(3, 4, 5, 0), (2, 1, 3, 3), (5, 10, 21, 2)])
def test_lanczos_lambda_max_matches_the_dense_eigendecomposition(K, o, i, seed):
    """λ_max of 𝒜 from 30 Lanczos steps on KronSystem = the top eigenvalue of the explicit Σ p_k kron(G_k, A_k),
    also when the layer has more unknowns (210) than Lanczos steps, and in float32 to float32 rounding."""
    Gs, As, Ms, p = _problem(K=K, o=o, i=i, seed=seed)
    Kd = _dense(Gs, As, Ms, p)[0]
    exact = float(torch.linalg.eigvalsh(Kd)[-1])
    est = fl.lambda_max(fl.KronSystem(Gs, As, p), Ms[0])
    assert abs(est - exact) <= 1e-12 * exact
    est32 = fl.lambda_max(fl.KronSystem(Gs.float(), As.float(), p.float()), Ms[0].float())
    assert abs(est32 - exact) <= 1e-5 * exact
    assert est != fl.lambda_max(fl.KronSystem(2 * Gs, As, p), Ms[0])          # it reads the operator
    assert abs(fl.lambda_max(fl.KronSystem(2 * Gs, As, p), Ms[0]) - 2 * exact) <= 1e-12 * exact


def test_stable_step_converges_where_the_fixed_step_diverges():
    """gd_lr = 1 above the limit n/λ_max² (= 20/λ² < 1 here): the released fixed step blows up, the stable step
    min(gd_lr, 1/L), L = 2λ²/n, is exactly half the limit and GD from EA converges to the dense solution."""
    Gs, As, Ms, p = _problem(seed=1)
    Kd, _, M_star = _dense(Gs, As, Ms, p)
    lam = float(torch.linalg.eigvalsh(Kd)[-1])
    limit = 20 / lam ** 2
    assert limit < 1.0
    M_ea, Z, _, _ = fl.ea_solve(Gs, As, p, Ms)
    step, lam_est = fl.stable_gd_lr(fl.KronSystem(Gs, As, p), Z, 1.0)
    assert abs(lam_est - lam) <= 1e-12 * lam and abs(step - 0.5 * limit) <= 1e-10 * limit
    fixed = fl.gd_solve(Gs, As, p, Z, M_ea, 2000, 1.0)
    assert not torch.isfinite(fixed).all() or (fixed - M_star).norm() > 1e6
    stable = fl.gd_solve(Gs, As, p, Z, M_ea, 5000, step)
    assert (stable - M_star).norm() < 1e-6 * (M_ea - M_star).norm()
    assert fl.stable_gd_lr(fl.KronSystem(Gs, As, p), Z, 0.25 * limit)[0] == 0.25 * limit   # below the cap: as given


def _stable_vs_fixed(setup, plist, **cfg):
    out = {}
    for step in ("fixed", "stable"):
        algo = ALGORITHMS.get("fedlpa")({"gd_step": step, **cfg}, setup)
        out[step] = algo.aggregate(_messages(algo, setup, plist), algo.init_state(plist[0]), 1)
    return out["fixed"], out["stable"]


def test_stable_equals_fixed_bit_for_bit_below_the_limit():
    setup = _setup((12, 20, 9))
    plist = [_client_params(setup, k, k) for k in range(3)]
    fixed, stable = _stable_vs_fixed(setup, plist, gd_steps=300, gd_lr=1e-3)
    assert all(torch.equal(fixed["params"][n], stable["params"][n]) for n in plist[0])
    assert stable["extra_metrics"]["gd_clamped_layers"] == 0.0 and stable["extra_metrics"]["gd_min_step"] == 1e-3
    assert [r["layer"] for r in stable["trace"]] == ["conv", "fc"]
    assert all(r["gd_step"] == 1e-3 and r["clamped"] == 0 and r["lambda_max"] > 0 for r in stable["trace"])
    assert "trace" not in fixed and "gd_clamped_layers" not in fixed["extra_metrics"]   # records unchanged


def test_stable_aggregate_clamps_each_layer_and_approaches_cg():
    """gd_lr far above every layer's limit: fixed GD is not finite, stable GD's step is 1/L per layer
    (L from the layer's dense operator) and its solution nears CG's (slowly: GD on 𝒜² squares its condition)."""
    setup = _setup((12, 20, 9))
    plist = [_client_params(setup, k, k) for k in range(3)]
    fixed, stable = _stable_vs_fixed(setup, plist, gd_steps=3000, gd_lr=1e4)
    assert fixed["extra_metrics"]["solver_rel_residual"] == math.inf
    algo = ALGORITHMS.get("fedlpa")({"solver": "cg", "cg_tol": 1e-13}, setup)
    msgs = _messages(algo, setup, plist)
    cg = algo.aggregate(msgs, algo.init_state(plist[0]), 1)
    p = torch.tensor([12, 20, 9], dtype=D) / 41
    for s, row in zip(algo.specs, stable["trace"]):
        As = torch.stack([fl.unpack_sym(m.payload["A"][s.module], s.d_in) for m in msgs])
        Gs = torch.stack([fl.unpack_sym(m.payload["G"][s.module], s.d_out) for m in msgs])
        lam = float(torch.linalg.eigvalsh(_dense(Gs, As, As[:, :1, :1].expand(-1, s.d_out, s.d_in), p)[0])[-1])
        n = s.d_out * s.d_in
        assert row["clamped"] == 1 and abs(row["gd_step"] - n / (2 * lam ** 2)) <= 1e-9 * row["gd_step"]
        ea_err = (s.to_matrix(stable["extra_eval"]["ea"]) - s.to_matrix(cg["params"])).norm()
        assert (s.to_matrix(stable["params"]) - s.to_matrix(cg["params"])).norm() < 0.25 * ea_err   # fc: 0.145
    assert stable["extra_metrics"]["gd_clamped_layers"] == 2.0
    assert stable["extra_metrics"]["solver_rel_residual"] < stable["extra_metrics"]["ea_rel_residual"]


def test_gd_step_fixed_stays_out_of_the_run_id():
    """Every record made before the switch existed keeps its run id; the stable step is a new run."""
    from fedbench.config.compose import compose_config
    from fedbench.results.records import compute_run_id
    cfg = compose_config(["algorithm=fedlpa"])
    bare = OmegaConf.to_container(cfg, resolve=True)
    del bare["algorithm"]["gd_step"]
    assert cfg.algorithm.gd_step == "fixed" and compute_run_id(cfg) == compute_run_id(bare)
    assert compute_run_id(compose_config(["algorithm=fedlpa", "algorithm.gd_step=stable"])) != compute_run_id(cfg)


def test_reference_solve_is_the_exact_solution_and_is_never_carried():
    """reference_solve=cg beside a float32 GD that stops far from the solution (5 steps): its model is each layer's
    dense Kronecker solve (float64), it is evaluated as 'reference', and the carried model, the EA model and the
    solver's residual are bit for bit those of the run without it."""
    setup = _setup((12, 20, 9))
    plist = [_client_params(setup, k, k) for k in range(3)]
    cfg = {"gd_steps": 5, "gd_lr": 1e-3, "server_dtype": "float32"}
    algos = {r: ALGORITHMS.get("fedlpa")({**cfg, "reference_solve": r}, setup) for r in ("none", "cg")}
    out = {r: a.aggregate(_messages(a, setup, plist), a.init_state(plist[0]), 1) for r, a in algos.items()}
    plain, paired = out["none"], out["cg"]
    assert all(torch.equal(plain["params"][n], paired["params"][n]) for n in plist[0])
    assert all(torch.equal(plain["extra_eval"]["ea"][n], paired["extra_eval"]["ea"][n]) for n in plist[0])
    assert plain["extra_metrics"]["solver_rel_residual"] == paired["extra_metrics"]["solver_rel_residual"]
    assert set(plain["extra_eval"]) == {"ea"} and "reference_rel_residual" not in plain["extra_metrics"]
    msgs = _messages(algos["cg"], setup, plist)
    p = torch.tensor([12, 20, 9], dtype=D) / 41
    for s in algos["cg"].specs:
        As = torch.stack([fl.unpack_sym(m.payload["A"][s.module], s.d_in) for m in msgs])
        Gs = torch.stack([fl.unpack_sym(m.payload["G"][s.module], s.d_out) for m in msgs])
        Ms = torch.stack([s.to_matrix(m.payload["params"]) for m in msgs])
        exact = _dense(Gs, As, Ms, p)[2]
        got = s.to_matrix(paired["extra_eval"]["reference"])
        assert torch.allclose(got, exact, rtol=0, atol=1e-7 * exact.abs().max())
        assert (s.to_matrix(paired["params"]) - exact).norm() > 1e3 * (got - exact).norm()   # GD is far from it
    m = paired["extra_metrics"]
    assert m["reference_rel_residual"] <= 1e-8 < m["solver_rel_residual"] and m["reference_cg_iters"] >= 1


def test_reference_solve_none_stays_out_of_the_run_id():
    from fedbench.config.compose import compose_config
    from fedbench.results.records import compute_run_id
    cfg = compose_config(["algorithm=fedlpa"])
    bare = OmegaConf.to_container(cfg, resolve=True)
    del bare["algorithm"]["reference_solve"]
    assert cfg.algorithm.reference_solve == "none" and compute_run_id(cfg) == compute_run_id(bare)
    assert compute_run_id(compose_config(["algorithm=fedlpa", "algorithm.reference_solve=cg"])) != compute_run_id(cfg)


def test_kron_system_equals_the_per_client_sum():
    """The two-GEMM layout gives Σ_k p_k G_k M A_k exactly as the released per-client loop writes it."""
    Gs, As, Ms, p = _problem(K=4, o=3, i=6, seed=2)
    op = fl.KronSystem(Gs, As, p)
    for M in (Ms[0], Ms[3], torch.eye(3, 6, dtype=D)):
        loop = sum(p[k] * Gs[k] @ M @ As[k] for k in range(4))
        assert torch.allclose(op(M), loop, rtol=0, atol=1e-13)


def test_gd_fixed_point_is_the_cg_solution():
    """GD on the mean-MSE stops moving exactly at 𝒜(M) = Z: from CG's solution 1,000 released steps
    (lr 1.0, stable here) stay there, and from EA they approach it monotonically."""
    Gs, As, Ms, p = _problem(K=3, o=4, i=5, seed=4)
    Gs, As = 0.5 * Gs, 0.5 * As                      # factor scale as damped real ones: lr 1.0 stable
    Kd, _, M_star = _dense(Gs, As, Ms, p)
    assert 2.0 * float(torch.linalg.eigvalsh(Kd).max()) ** 2 / 20 < 2.0      # lr 1.0 is stable on this layer
    M_ea, Z, A_bar, G_bar = fl.ea_solve(Gs, As, p, Ms)
    M_cg = fl.cg_solve(Gs, As, p, Z, M_ea, tol=1e-14, max_iters=200, precond=(G_bar, A_bar))[0]
    assert torch.allclose(fl.gd_solve(Gs, As, p, Z, M_cg, 1000, 1.0), M_star, rtol=0, atol=1e-12)
    errs = [float((fl.gd_solve(Gs, As, p, Z, M_ea, n, 1.0) - M_star).norm()) for n in (0, 100, 1000, 10000)]
    assert errs[0] > errs[1] > errs[2] > errs[3]


def test_float32_server_reports_its_float64_residual():
    """server_dtype float32 solves in float32; the record's residual is the float64 one of that solution."""
    setup = _setup((12, 20, 9))
    plist = [_client_params(setup, k, k) for k in range(3)]
    cfg = {"solver": "cg", "cg_tol": 1e-12, "cg_max_iters": 500}
    out = {}
    for dt in ("float64", "float32"):
        algo = ALGORITHMS.get("fedlpa")({**cfg, "server_dtype": dt}, setup)
        msgs = _messages(algo, setup, plist)
        out[dt] = (algo, msgs, algo.aggregate(msgs, algo.init_state(plist[0]), 1))
    algo, msgs, st32 = out["float32"]
    p = torch.tensor([12.0, 20.0, 9.0], dtype=D) / 41
    for s in algo.specs:
        As = torch.stack([fl.unpack_sym(m.payload["A"][s.module], s.d_in) for m in msgs])
        Gs = torch.stack([fl.unpack_sym(m.payload["G"][s.module], s.d_out) for m in msgs])
        Ms = torch.stack([s.to_matrix(pk) for pk in plist])
        M32 = s.to_matrix(st32["params"])
        Z = sum(p[k] * Gs[k] @ Ms[k] @ As[k] for k in range(3))
        r64 = float((sum(p[k] * Gs[k] @ M32 @ As[k] for k in range(3)) - Z).norm() / Z.norm())
        assert st32["solver_info"][s.module]["rel_residual"] == pytest.approx(r64, rel=1e-9)
        assert 1e-10 < r64 < 1e-4                                 # float32 rounding, seen in float64
        assert out["float64"][2]["solver_info"][s.module]["rel_residual"] < 1e-11


def test_ea_exact_when_clients_share_factors():
    Gs, As, Ms, p = _problem()
    Gs[:] = Gs[0]
    As[:] = As[0]
    _, _, M_star = _dense(Gs, As, Ms, p)
    M_ea = fl.ea_solve(Gs, As, p, Ms)[0]
    assert torch.allclose(M_ea, M_star, rtol=0, atol=1e-10)
    assert torch.allclose(M_ea, (p[:, None, None] * Ms).sum(0), rtol=0, atol=1e-10)   # = the p-weighted average


def test_pack_unpack_roundtrip():
    A = _spd(6, torch.Generator().manual_seed(3))
    A = (A + A.T) / 2                       # X Xᵀ in floating point is symmetric only to round-off
    v = fl.pack_sym(A)
    assert v.numel() == 21 and fl.sym_size(21) == 6
    assert torch.equal(fl.unpack_sym(v, 6), A)


# ------------------------------------------------------------------------------------------------
# the algorithm on a tiny conv net
# ------------------------------------------------------------------------------------------------
class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)          # 5×5 -> 3×3: S = 9, A 10×10, G 2×2
        self.fc = nn.Linear(18, 3)              # A 19×19, G 3×3

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _setup(sizes=(12, 20), seed=0, same_data=False, model=None, dtype=D):
    """float64 model by default (exact comparisons); TrainData yields float32 inputs, so the
    evaluation inputs are cast to the model dtype (the loop test trains in float32)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(n, 1, 5, 5, generator=g, dtype=D)
    y = torch.randint(0, 3, (n,), generator=g)
    if same_data:
        x[sizes[0]:], y[sizes[0]:] = x[: sizes[0]], y[: sizes[0]]
    idx, s = [], 0
    for k in sizes:
        idx.append(torch.arange(s, s + k))
        s += k
    torch.manual_seed(seed)
    model = (model or TinyCNN()).to(dtype)
    train = TrainData(x, y)
    return FLSetup(model=model, train=train, test_inputs=lambda i: train.inputs(i).to(dtype), test_y=y,
                   client_indices=idx,
                   local=LocalTrainConfig(lr=0.1, batch_size=8, epochs=1), seed=0, device=torch.device("cpu"))


def _client_params(setup, k, seed):
    torch.manual_seed(100 + seed)
    m = TinyCNN().to(D)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _messages(algo, setup, plist):
    res = TrainResult(plist, [1] * len(plist), [0.0] * len(plist), 0.0)
    return [ProductStage(setup).message(algo, k, plist[k], res, k, {}, 1) for k in range(len(plist))]


def _manual_factors(model, x, y):
    """§1.3 step 2 by hand: conv A = Σ ā āᵀ/(N S²), G = (S/N) Σ δ δᵀ; linear A = Σ ā āᵀ/N,
    G = Σ δ δᵀ/N; ā = [a; 1], δ = ∂ℓ_i/∂z (per-sample CE, true label)."""
    N, x = x.shape[0], x.to(D)
    z = model.conv(x)
    z.retain_grad()
    h = torch.relu(z).flatten(1)
    out = model.fc(h)
    out.retain_grad()
    F.cross_entropy(out, y, reduction="sum").backward()
    U = F.unfold(x, 3)                                    # [N, 9, S]
    S = U.shape[-1]
    a = torch.cat([U, torch.ones(N, 1, S, dtype=D)], 1).permute(0, 2, 1).reshape(-1, 10)
    d = z.grad.reshape(N, 2, S).permute(0, 2, 1).reshape(-1, 2)
    hb = torch.cat([h, torch.ones(N, 1, dtype=D)], 1).detach()
    return {"conv": (a.T @ a / (N * S * S), S * d.T @ d / N),
            "fc": (hb.T @ hb / N, out.grad.T @ out.grad / N)}


@pytest.mark.parametrize("pi", ["one", "trace", 2.5])
def test_client_factors_damping_and_bytes(pi):
    setup = _setup()
    lam = 0.01
    algo = ALGORITHMS.get("fedlpa")({"damping": lam, "pi": pi}, setup)
    params = _client_params(setup, 0, 0)
    msg = _messages(algo, setup, [params])[0]
    m = TinyCNN().to(D)
    m.load_state_dict(params)
    x, y = setup.client_data(0)
    ref = _manual_factors(m, x, y)
    for layer, (A, G) in ref.items():
        got_A = fl.unpack_sym(msg.payload["A"][layer], A.shape[0])
        got_G = fl.unpack_sym(msg.payload["G"][layer], G.shape[0])
        p = 1.0 if pi == "one" else (pi if not isinstance(pi, str) else
                                     math.sqrt((A.trace() / A.shape[0]) / (G.trace() / G.shape[0])))
        assert torch.allclose(got_A, A + p * math.sqrt(lam) * torch.eye(A.shape[0], dtype=D), rtol=0, atol=1e-12)
        assert torch.allclose(got_G, G + math.sqrt(lam) / p * torch.eye(G.shape[0], dtype=D), rtol=0, atol=1e-12)
    # bytes: weights + upper triangles of A (10, 19) and G (2, 3), float64
    n_w = sum(t.numel() for t in params.values())
    assert msg.nbytes == 8 * (n_w + 55 + 3 + 190 + 6)
    full = ALGORITHMS.get("fedlpa")({"factor_upload": "full"}, setup)
    assert _messages(full, setup, [params])[0].nbytes == 8 * (n_w + 100 + 4 + 361 + 9)


@pytest.mark.parametrize("solver", ["ea", "gd", "cg"])
def test_single_and_identical_clients_give_the_client_weights(solver):
    setup = _setup((16,))
    algo = ALGORITHMS.get("fedlpa")({"solver": solver, "gd_steps": 50}, setup)
    params = _client_params(setup, 0, 0)
    st = algo.aggregate(_messages(algo, setup, [params]), algo.init_state(params), 1)
    for n, t in params.items():
        assert torch.allclose(st["params"][n], t, rtol=0, atol=1e-10)
        assert torch.allclose(st["extra_eval"]["ea"][n], t, rtol=0, atol=1e-10)
    # two clients, same weights, same data: same factors, so every solver returns those weights
    setup2 = _setup((10, 10), same_data=True)
    algo2 = ALGORITHMS.get("fedlpa")({"solver": solver, "gd_steps": 50}, setup2)
    st2 = algo2.aggregate(_messages(algo2, setup2, [params, params]), algo2.init_state(params), 1)
    for n, t in params.items():
        assert torch.allclose(st2["params"][n], t, rtol=0, atol=1e-10)


def test_aggregate_matches_dense_solve_per_layer():
    setup = _setup((12, 20, 9))
    plist = [_client_params(setup, k, k) for k in range(3)]
    cg = ALGORITHMS.get("fedlpa")({"solver": "cg", "cg_tol": 1e-13, "cg_max_iters": 500}, setup)
    uni = ALGORITHMS.get("fedlpa")({"solver": "cg", "cg_tol": 1e-13, "cg_max_iters": 500,
                                    "weighting": "uniform"}, setup)
    for algo, w in ((cg, [12, 20, 9]), (uni, [1, 1, 1])):
        msgs = _messages(algo, setup, plist)
        st = algo.aggregate(msgs, algo.init_state(plist[0]), 1)
        p = torch.tensor(w, dtype=D) / sum(w)
        for s in algo.specs:
            As = torch.stack([fl.unpack_sym(m.payload["A"][s.module], s.d_in) for m in msgs])
            Gs = torch.stack([fl.unpack_sym(m.payload["G"][s.module], s.d_out) for m in msgs])
            Ms = torch.stack([s.to_matrix(pk) for pk in plist])
            _, _, M_star = _dense(Gs, As, Ms, p)
            assert torch.allclose(s.to_matrix(st["params"]), M_star, rtol=0, atol=1e-9)
            assert st["solver_info"][s.module]["rel_residual"] < 1e-12
            M_ea = fl.ea_solve(Gs, As, p, Ms)[0]
            assert torch.allclose(s.to_matrix(st["extra_eval"]["ea"]), M_ea, rtol=0, atol=1e-12)
        # the record's residuals are the worst layer's; distinct client factors leave EA off the solution
        layers = st["solver_info"].values()
        assert st["extra_metrics"]["solver_rel_residual"] == max(i["rel_residual"] for i in layers) < 1e-12
        assert st["extra_metrics"]["ea_rel_residual"] == max(i["ea_rel_residual"] for i in layers) > 1e-6


def test_best_of_ea_gd_on_test_picks_the_better_test_accuracy():
    from fedbench.eval.metrics import evaluate
    setup = _setup((12, 20, 9))
    plist = [_client_params(setup, k, k) for k in range(3)]
    algo = ALGORITHMS.get("fedlpa")({"solver": "gd", "gd_steps": 30, "gd_lr": 1e-3,
                                     "report": "best_of_ea_gd_on_test"}, setup)
    st = algo.aggregate(_messages(algo, setup, plist), algo.init_state(plist[0]), 1)
    acc = {k: evaluate(setup.model, st["extra_eval"][k], setup.test_inputs, setup.test_y)["accuracy"]
           for k in ("ea", "gd")}
    best = "gd" if acc["gd"] >= acc["ea"] else "ea"
    assert st["report_choice"] == best and algo.predict_params(st) is st["extra_eval"][best]
    assert st["params"] is st["extra_eval"]["gd"]           # the carried model is the solver's


def _round_one(options):
    """Two clients with different data and weights, aggregated once: (setup, weights, algorithm, messages, state)."""
    setup = _setup((12, 20))
    plist = [_client_params(setup, k, k) for k in range(2)]
    algo = ALGORITHMS.get("fedlpa")(options, setup)
    msgs = _messages(algo, setup, plist)
    return setup, plist, algo, msgs, algo.aggregate(msgs, algo.init_state(plist[0]), 1)


def test_round_two_posterior_term_and_fedlpa_then_fedavg():
    setup, plist, algo, msgs, st = _round_one({"solver": "ea"})
    assert algo.local_objective(st, [0, 1], 1).terms == []
    obj = algo.local_objective(st, [0, 1], 2)
    w = _client_params(setup, 0, 7)
    p = torch.tensor([12.0, 20.0], dtype=D) / 32
    for c in (0, 1):
        got = obj.terms[0](w, {**obj.shared_ctx, **obj.client_ctx[c]})
        want = 0.0
        for s in algo.specs:
            A = [fl.unpack_sym(m.payload["A"][s.module], s.d_in) for m in msgs]
            G = [fl.unpack_sym(m.payload["G"][s.module], s.d_out) for m in msgs]
            Ab, Gb = p[0] * A[0] + p[1] * A[1], p[0] * G[0] + p[1] * G[1]
            Dm = s.to_matrix(w) - s.to_matrix(st["params"])
            want += (Dm * ((Gb - G[c]) @ Dm @ (Ab - A[c]))).sum()
        assert torch.allclose(got, 0.5 * want, rtol=0, atol=1e-12)
    down = algo.downlink(st)
    assert set(down) == {"params", "A_bar", "G_bar"}
    # FedLPA then FedAvg: round 2 is the p-weighted average, weights only
    tf = ALGORITHMS.get("fedlpa_then_fedavg")({"solver": "ea"}, setup)
    st1 = tf.aggregate(_messages(tf, setup, plist), tf.init_state(plist[0]), 1)
    assert tf.local_objective(st1, [0, 1], 2).terms == [] and set(tf.downlink(st1)) == {"params"}
    res = TrainResult(plist, [1, 1], [0.0, 0.0], 0.0)
    assert ProductStage(setup).compute(tf, 0, plist[0], st1, 2) == {}             # no factors after round 1
    m2 = [ProductStage(setup).message(tf, k, plist[k], res, k, st1, 2) for k in range(2)]
    assert set(m2[0].payload) == {"params"}
    st2 = tf.aggregate(m2, st1, 2)
    for n in plist[0]:
        assert torch.allclose(st2["params"][n], p[0] * plist[0][n] + p[1] * plist[1][n], rtol=0, atol=1e-12)


def test_the_posterior_term_is_unbounded_below_along_opposite_eigendirections():
    """Ā − A_k and Ḡ − G_k are differences of PSD factors: indefinite for clients with different data. Along
    D = t·u vᵀ (u, v eigenvectors of Ḡ − G_k, Ā − A_k with eigenvalues of opposite signs) the term is
    ½ η λ_G λ_A t², negative and growing without bound: the paper's local loss has no minimum there
    (results/gaps.md#fedlpa-figure2)."""
    setup, _, algo, _, st = _round_one({"solver": "ea", "posterior_eta": 0.5})
    obj = algo.local_objective(st, [0, 1], 2)
    ctx = {**obj.shared_ctx, **obj.client_ctx[0]}
    s = algo.specs[-1]
    la, va = torch.linalg.eigh(ctx["dA"][s.module])
    lg, vg = torch.linalg.eigh(ctx["dG"][s.module])
    assert la[0] < 0 < la[-1], "Ā − A_k is indefinite"
    ia, ig = (0, -1) if lg[-1] > 0 else (-1, 0)       # opposite signs
    D = torch.outer(vg[:, ig], va[:, ia])
    values = []
    for scale in (1.0, 10.0, 100.0):
        w = {**st["params"], **s.from_matrix(ctx["M_g"][s.module] + scale * D)}
        values.append(float(obj.terms[0](w, ctx)))
    want = [0.5 * 0.5 * float(lg[ig] * la[ia]) * scale ** 2 for scale in (1.0, 10.0, 100.0)]
    assert values == pytest.approx(want, rel=1e-9) and values[0] < 0
    released = ALGORITHMS.get("fedlpa")({"solver": "ea", "posterior_term": "detached_as_released"}, setup)
    assert released.local_objective(st, [0, 1], 2).terms == []      # no gradient: plain local training
    assert set(released.downlink(st)) == {"params", "A_bar", "G_bar"}  # the clients still hold Ā, Ḡ (logged term)


def test_a_client_with_non_finite_weights_is_named_in_one_line():
    _, plist, algo, msgs, st = _round_one({"solver": "ea"})
    next(iter(msgs[1].payload["params"].values()))[0] = float("nan")
    with pytest.raises(FedbenchError, match=r"round 2: client\(s\) \[1\] sent non-finite .*posterior_term="
                                            r"detached_as_released") as e:
        algo.aggregate(msgs, st, 2)
    assert "\n" not in str(e.value)
    with pytest.raises(FedbenchError, match=r"round 1: client\(s\) \[1\] sent non-finite weights or factors "
                                            r"\(their local training diverged\)$"):
        algo.aggregate(msgs, algo.init_state(plist[0]), 1)


def test_clients_that_trained_from_a_diverged_global_model_are_blamed_on_the_server():
    """The released fixed-step GD can leave a layer non-finite (Fig. 2, seed 1, round 46); the next round's
    clients then all send NaN. The error names the carried layers and the gd_step switch, not the posterior term."""
    _, _, algo, msgs, st = _round_one({"solver": "ea", "posterior_eta": 0.5})
    for m in msgs:
        next(iter(m.payload["params"].values()))[0] = float("nan")
    first = next(iter(st["params"]))
    broken = {**st, "params": {**st["params"], first: torch.full_like(st["params"][first], float("inf"))}}
    with pytest.raises(FedbenchError, match=rf"round 2: client\(s\) \[0, 1\] sent non-finite .*round 1's global "
                                            rf"model, which the server's GD solve left non-finite \({first}\): "
                                            r"algorithm.gd_step=stable") as e:
        algo.aggregate(msgs, broken, 2)
    assert "posterior_term" not in str(e.value) and "\n" not in str(e.value)


def test_two_rounds_through_the_loop():
    setup = _setup((12, 20), dtype=torch.float32)
    algo = ALGORITHMS.get("fedlpa")({"solver": "cg"}, setup)
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    state, logs = run_rounds(setup, algo, init, 2, progress=False)
    assert len(logs) == 2 and all("ea_accuracy" in l.metrics and "accuracy" in l.metrics for l in logs)
    assert logs[1].downlink_bytes > logs[0].downlink_bytes        # Ā, Ḡ sent from round 2
    assert all(torch.isfinite(t).all() for t in state["params"].values())


def test_augmented_factor_pass_is_seeded_and_differs_from_clean():
    from fedbench.data.transforms import Augment
    setup = _setup((16,))
    setup.train.augment = Augment(crop_padding=1, flip=True)
    params = _client_params(setup, 0, 0)
    stage = ProductStage(setup)
    clean = stage.compute(ALGORITHMS.get("fedlpa")({}, setup), 0, params, {}, 1)["factors"]
    aug = ALGORITHMS.get("fedlpa")({"factor_data": "augmented_as_released"}, setup)
    a1, a2 = (stage.compute(aug, 0, params, {}, 1)["factors"] for _ in range(2))
    assert torch.equal(a1["A"]["conv"], a2["A"]["conv"])
    assert not torch.allclose(a1["A"]["conv"], clean["A"]["conv"])


@pytest.mark.parametrize("name", ["fedlpa", "fedlpa_then_fedavg"])
def test_yaml_keys_are_accepted(name):
    from pathlib import Path
    from omegaconf import OmegaConf
    cfg = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf" / "algorithm" / f"{name}.yaml"))
    assert cfg.pop("name") == name
    algo = ALGORITHMS.get(name)(cfg, _setup())
    assert algo.solver == "gd" and algo.report == "solver" and algo.lam == 1e-3 and algo.gd_steps == 10_000


@pytest.mark.parametrize("cfg,needle", [
    ({"solver": "newton"}, "algorithm.solver"),
    ({"report": "best_of_ea_gd_on_test", "solver": "cg"}, "solver: gd"),
    ({"pi": -1.0}, "algorithm.pi"),
    ({"pi": "frobenius"}, "algorithm.pi"),
    ({"damping": -0.1}, "algorithm.damping"),
    ({"gd_steps": 1.5}, "algorithm.gd_steps"),
    ({"lambda": 0.1}, "unknown algorithm key"),
    ({"gd_step": "adaptive"}, "algorithm.gd_step"),
    ({"gd_step": "stable", "solver": "cg"}, "solver: gd"),
    ({"reference_solve": "exact"}, "algorithm.reference_solve"),
    ({"reference_solve": "cg", "solver": "cg"}, "solver: gd or ea"),
])
def test_bad_config_one_line(cfg, needle):
    with pytest.raises(FedbenchError) as e:
        ALGORITHMS.get("fedlpa")(cfg, _setup())
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_model_outside_linear_conv_rejected():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(18, 3))
    with pytest.raises(FedbenchError, match="nn.Linear / nn.Conv2d"):
        ALGORITHMS.get("fedlpa")({}, _setup(model=model))


# ------------------------------------------------------------------------------------------------
# end to end through run.py
# ------------------------------------------------------------------------------------------------
def test_run_py_records_accuracy_and_ea_accuracy(tmp_path):
    run(SMALL + ["rounds=1", "algorithm=fedlpa", "algorithm.gd_steps=20"], tmp_path)
    (rec_path,) = records(tmp_path)
    rec = json.loads(rec_path.read_text())
    assert rec["status"] == "ok" and rec["algorithm"] == "fedlpa"
    assert 0 <= rec["metrics"]["accuracy"] <= 100 and 0 <= rec["metrics"]["ea_accuracy"] <= 100
    assert rec["metrics"]["solver_rel_residual"] >= 0 and rec["metrics"]["ea_rel_residual"] >= 0
    # uplink > weights alone (the K-FAC factors travel too)
    assert rec["communication"]["uplink_bytes"] > 3 * 4 * rec["model"]["num_parameters"]
    p = run(SMALL + ["rounds=1", "algorithm=fedlpa", "algorithm.solver=newton"], tmp_path, expect=2)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedbench: error:") and "algorithm.solver" in lines[0]


def test_worst_residual_reports_a_diverged_layer_as_inf():
    from fedbench.algorithms.fedlpa import worst_residual
    assert worst_residual([1e-3, float("nan")]) == float("inf")   # max() alone would return 1e-3 here
    assert worst_residual([float("nan"), 1e-3]) == float("inf")
    assert worst_residual([1e-3, 0.2]) == 0.2
    assert worst_residual([]) == 0.0


def test_run_py_stable_step_writes_its_per_layer_trace(tmp_path):
    """gd_step=stable through run.py: one trace.csv row per LeNet layer with λ_max and the step used; a gd_lr far
    above every limit is clamped on every layer and the record stays finite."""
    import csv
    run(SMALL + ["rounds=1", "algorithm=fedlpa", "algorithm.gd_steps=20", "algorithm.gd_lr=1e6",
                 "algorithm.gd_step=stable"], tmp_path)
    (rec_path,) = records(tmp_path)
    rec = json.loads(rec_path.read_text())
    rows = list(csv.DictReader((rec_path.parent / "trace.csv").open()))
    assert [r["layer"] for r in rows] == ["conv1", "conv2", "fc1", "fc2", "fc3"]
    assert all(r["clamped"] == "1" and 0 < float(r["gd_step"]) < 1e6 and float(r["lambda_max"]) > 0 for r in rows)
    assert rec["metrics"]["gd_clamped_layers"] == 5 and math.isfinite(rec["metrics"]["solver_rel_residual"])
    assert rec["metrics"]["gd_min_step"] == min(float(r["gd_step"]) for r in rows)


def test_run_py_reference_solve_logs_its_accuracy_beside_the_solver(tmp_path):
    run(SMALL + ["rounds=1", "algorithm=fedlpa", "algorithm.gd_steps=20", "algorithm.reference_solve=cg"], tmp_path)
    (rec_path,) = records(tmp_path)
    m = json.loads(rec_path.read_text())["metrics"]
    assert 0 <= m["reference_accuracy"] <= 100 and 0 <= m["accuracy"] <= 100 and "reference_nll" in m
    assert m["reference_rel_residual"] <= 1e-8 < m["solver_rel_residual"]


def test_solver_rounds_plot_reads_the_reference_columns(tmp_path, monkeypatch):
    """The plot kind of the reference collection: every history row goes to the figure's data CSV; a run without
    reference_solve=cg is refused in one line that names the switch."""
    import pandas as pd
    from fedbench.papers.fedlpa import solver_rounds
    from fedbench.report.registry import PLOT_KINDS
    assert PLOT_KINDS["fedlpa_solver_rounds"] is solver_rounds.plot_kind
    rows = pd.DataFrame({"round": [1, 2, 3], "accuracy": [90.1, 84.0, 97.9], "reference_accuracy": [88.5, 97.5, 97.9],
                         "ea_accuracy": [90.5, 96.0, 97.8], "solver_rel_residual": [0.04, 0.2, 0.001],
                         "reference_rel_residual": [6e-9, 4e-9, 3e-9]})
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d, h in ((good, rows), (bad, rows.drop(columns=["reference_accuracy"]))):
        d.mkdir()
        h.to_csv(d / "history.csv", index=False)
    runs = pd.DataFrame({"run_id": ["a"], "status": ["ok"], "record_dir": [str(good)], "seed": [0], "method": ["fedlpa"]})
    monkeypatch.setattr(solver_rounds, "preset_records", lambda *a: runs)
    h = solver_rounds.solver_histories([], tmp_path)
    path = solver_rounds.plot_solver_rounds(h, tmp_path / "fig.png", "title")
    assert path.is_file() and path.stat().st_size > 0
    data = pd.read_csv(tmp_path / "fig_data.csv")
    assert data[["round", *solver_rounds.COLUMNS]].equals(rows[["round", *solver_rounds.COLUMNS]])
    runs.loc[0, "record_dir"] = str(bad)
    with pytest.raises(FedbenchError, match="reference_accuracy.*algorithm.reference_solve=cg"):
        solver_rounds.solver_histories([], tmp_path)
