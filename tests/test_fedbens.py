"""FedBEns (notes/fedbens.md §1.2–1.7): component densities vs dense Gaussians and the exact GGN,
the server objective (Eq. 5) and its optimum, median starts, validation selection, the loop's
member mechanism (distinct shared inits, caching) and an end-to-end run."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributions import MultivariateNormal

from fedbench.algorithms import fedbens as fb
from fedbench.algorithms.base import ALGORITHMS
from fedbench.errors import FedbenchError
from fedbench.fl.cache import ClientStageCache
from fedbench.fl.loop import FLSetup, member_seed, run_rounds
from fedbench.fl.products import ProductStage
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, train_clients

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(sizes=(12, 9), dtype=torch.float64, epochs=2, cache=None, val=True, seed=0):
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    x = torch.randn(n, 3, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)
    idx, s = [], 0
    for k in sizes:
        idx.append(torch.arange(s, s + k))
        s += k
    train = TrainData(x, y)
    local = LocalTrainConfig(optimizer="sgd", lr=0.1, batch_size=4, epochs=epochs)
    setup = FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx, local=local,
                    seed=seed, device=torch.device("cpu"), cache=cache,
                    stage_parts={"test": "fedbens", "dtype": str(dtype)} if cache is not None else None,
                    server_val=(x[:10], y[:10]) if val else None)
    return setup


def _algo(setup, **cfg):
    return ALGORITHMS.get("fedbens")(cfg, setup)


def _params(setup, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in setup.model.named_parameters()}


def _exact_ggn(setup, params, client):
    """Σ_n J_nᵀ (diag p − p pᵀ) J_n over the client's data (flat parameter order), by autograd."""
    from torch.func import functional_call, jacrev
    x, _ = setup.client_data(client)
    x = x.double()
    names = [n for n, _ in setup.model.named_parameters()]
    flat = torch.cat([params[n].reshape(-1) for n in names])
    shapes = [params[n].shape for n in names]

    def f(v, xi):
        parts, o = {}, 0
        for n, s in zip(names, shapes):
            k = int(torch.Size(s).numel())
            parts[n] = v[o:o + k].reshape(s)
            o += k
        return functional_call(setup.model, parts, (xi[None],))[0]

    G = torch.zeros(flat.numel(), flat.numel(), dtype=flat.dtype)
    for xi in x:
        J = jacrev(f)(flat, xi)                       # [K, P]
        p = torch.softmax(f(flat, xi), -1)
        G += J.t() @ (torch.diag(p) - torch.outer(p, p)) @ J
    return G


def _param_blocks_mask(setup):
    sizes = [p.numel() for p in setup.model.parameters()]
    P = sum(sizes)
    M = torch.zeros(P, P, dtype=torch.bool)
    o = 0
    for k in sizes:
        M[o:o + k, o:o + k] = True
        o += k
    return M


# ------------------------------------------------------------------------------------------------
# component densities (§1.3): Λ = G_sum / T + I / σ², normalised log-density
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("laplace", ["kron", "diag", "diag_full_last"])
def test_component_matches_exact_ggn_and_dense_mvn(laplace):
    # one sample on client 1: K-FAC with a separate bias block is then the exact GGN on per-parameter blocks
    setup = _setup(sizes=(12, 1))
    T, var = 0.1, 0.1
    algo = _algo(setup, laplace=laplace, temperature=T, prior_var=var, select="min_objective")
    client = 1 if laplace == "kron" else 0
    params = _params(setup)
    g = algo.member_gaussian(client, 0, params, ProductStage(setup).compute(algo, client, params, {}, 1)["curvature0"])
    G = _exact_ggn(setup, params, client)
    P = G.shape[0]
    if laplace == "kron":
        G = torch.where(_param_blocks_mask(setup), G, torch.zeros_like(G))
    elif laplace == "diag":
        G = torch.diag(G.diagonal())
    else:   # diagonal outside the last layer, exact block on it
        last = sum(p.numel() for p in setup.model[2].parameters())
        D = torch.diag(G.diagonal())
        D[P - last:, P - last:] = G[P - last:, P - last:]
        G = D
    Lam = G / T + torch.eye(P, dtype=G.dtype) / var
    mean = torch.cat([params[n].reshape(-1) for n, _ in setup.model.named_parameters()])
    mvn = MultivariateNormal(mean, precision_matrix=Lam)
    thetas = mean + 0.3 * torch.randn(4, P, generator=torch.Generator().manual_seed(3), dtype=G.dtype)
    for th in thetas:
        assert float(g.log_prob(th)) == pytest.approx(float(mvn.log_prob(th)), rel=1e-9, abs=1e-8)


def _gaussians(setup, algo, members=2):
    stage = ProductStage(setup)
    return [[algo.member_gaussian(c, m, p, stage.compute(algo, c, p, {}, 1)["curvature0"])
             for m, p in enumerate(_params(setup, seed=10 * c + m) for m in range(members))]
            for c in range(setup.num_clients)]


@pytest.mark.parametrize("laplace", ["kron", "diag", "diag_full_last"])
def test_server_objective_equals_dense_mixture_and_its_gradient(laplace):
    setup = _setup()
    algo = _algo(setup, laplace=laplace, select="min_objective")
    comps = _gaussians(setup, algo)
    server_var = 0.5
    obj = fb.ServerObjective(comps, 1.0 / server_var)
    P = comps[0][0].dim
    theta = 0.4 * torch.randn(P, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    eye = torch.eye(P, dtype=torch.float64)
    dense = [[MultivariateNormal(g.mean, precision_matrix=g.precision_mv(eye)) for g in row] for row in comps]
    prior = MultivariateNormal(torch.zeros(P, dtype=torch.float64), covariance_matrix=server_var * eye)
    ref = sum(torch.logsumexp(torch.stack([d.log_prob(theta) for d in row]) - math.log(len(row)), 0) for row in dense) \
        - (len(comps) - 1) * prior.log_prob(theta)
    th = theta.clone().requires_grad_(True)
    val = obj.log_posterior(th)
    assert float(val.detach()) == pytest.approx(float(ref), rel=1e-10)
    # the note's gradient: ∇(−L) = Σ_c Σ_m r_cm Λ_cm (θ − μ_cm) − (C − 1) σ⁻² θ, r = softmax of the log-densities
    (grad,) = torch.autograd.grad(-val, th)
    want = -(len(comps) - 1) / server_var * theta
    for row, drow in zip(comps, dense):
        r = torch.softmax(torch.stack([d.log_prob(theta) for d in drow]), 0)
        for rm, g in zip(r, row):
            want = want + rm * g.precision_mv(theta - g.mean)
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-9)


def test_server_optimum_single_client_is_its_mean_and_two_clients_closed_form():
    setup = _setup()
    algo = _algo(setup, laplace="diag", select="min_objective")
    (g1, g2) = [row[0] for row in _gaussians(setup, algo, members=1)]
    # C = 1, M = 1: the objective is log N(θ; μ, Λ⁻¹): zero gradient at μ, and Adam converges to μ
    obj = fb.ServerObjective([[g1]], 10.0)
    th = g1.mean.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(obj(th), th)
    assert gr.abs().max() < 1e-10
    start = g1.mean + 0.3
    best, info = fb.optimise_component(obj, start, steps=400, lr=0.01, grad_clip=None, select="min_objective")
    assert (best - g1.mean).abs().max() < 0.02 < (start - g1.mean).abs().max()
    assert info["objective"] <= float(obj(start))
    # C = 2, M = 1: θ* = (Λ1 + Λ2 − σ⁻²I)⁻¹ (Λ1 μ1 + Λ2 μ2), the (C−1) prior division (Eq. 2)
    obj2 = fb.ServerObjective([[g1], [g2]], 10.0)
    star = (g1.precision * g1.mean + g2.precision * g2.mean) / (g1.precision + g2.precision - 10.0)
    th = star.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(obj2(th), th)
    assert gr.abs().max() < 1e-8
    moved = star + 0.01
    th = moved.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(obj2(th), th)
    assert gr.abs().max() > 1e-3


def test_coordinate_median():
    v = torch.tensor([[1.0, 5.0], [3.0, -1.0], [2.0, 0.0], [10.0, 2.0]])
    assert fb.coordinate_median(v, "lower").tolist() == [2.0, 0.0]          # torch.median: lower middle
    assert fb.coordinate_median(v, "average").tolist() == [2.5, 1.0]
    assert fb.coordinate_median(v[:3], "lower").tolist() == fb.coordinate_median(v[:3], "average").tolist() \
        == [2.0, 0.0]


def test_aggregate_starts_each_component_from_its_median():
    setup = _setup(sizes=(5, 6, 7))
    algo = _algo(setup, laplace="diag", select="min_objective", server_steps=0)
    comps = _gaussians(setup, algo, members=2)
    from fedbench.algorithms.base import Message
    msgs = [Message(c, 1, {}, {"gaussians": comps[c]}) for c in range(3)]
    state = algo.aggregate(msgs, {"params": None}, 1)
    for m in range(2):
        got = algo.layout.flatten(state["components"][m])
        want = torch.stack([comps[c][m].mean for c in range(3)]).median(0).values
        assert torch.equal(got, want)
    assert set(state["extra_eval"]) == {"component0", "component1"}
    assert len(algo.predict_params(state)) == 2


def test_validation_selection_steps_and_strict_improvement():
    calls, accs = [], iter([50, 60, 60, 55, 61, 61, 10, 0, 0, 0, 0, 0])

    def val_fn(x):
        calls.append(x.clone())
        return next(accs)

    steps = []
    obj_calls = {"k": 0}

    def objective(x):
        obj_calls["k"] += 1
        steps.append(x.detach().clone())
        return (x * x).sum()

    start = torch.ones(3)
    best, info = fb.optimise_component(objective, start, steps=100, lr=0.01, val_every=30, select="val_accuracy",
                                       val_fn=val_fn)
    # evaluated after the updates of k = 0, 30, 60, 90, 99: accuracies 50, 60, 60, 55, 61
    assert len(calls) == 5 and info["val_accuracy"] == 61 and info["best_step"] == 100
    assert torch.equal(best, calls[4])
    calls.clear()
    accs = iter([50, 60, 60, 55, 59])
    best, info = fb.optimise_component(objective, start, steps=100, lr=0.01, val_every=30, select="val_accuracy",
                                       val_fn=lambda x: (calls.append(x.clone()), next(accs))[1])
    assert info["best_step"] == 31 and torch.equal(best, calls[1])     # the tie at k = 60 does not replace it


# ------------------------------------------------------------------------------------------------
# members in the round loop (§1.2)
# ------------------------------------------------------------------------------------------------
class _Spy(fb.FedBEns):
    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        self.seen, self.starts = {}, {}

    def member_start_params(self, state, client_ids, member, round_idx):
        p = super().member_start_params(state, client_ids, member, round_idx)
        self.starts[member] = p
        return p

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        self.seen[client_id] = params
        return super().client_message(client_id, params, result, pos, state, round_idx, products)


def test_member_inits_are_shared_distinct_and_seeded():
    setup = _setup()
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    a1 = fb.member_init_params(setup.model, init, 0, 1)
    assert all(torch.equal(a1[n], b) for n, b in fb.member_init_params(setup.model, init, 0, 1).items())
    a2 = fb.member_init_params(setup.model, init, 0, 2)
    s1 = fb.member_init_params(setup.model, init, 1, 1)
    for other in (init, a2, s1):
        assert not torch.equal(a1["0.weight"], other["0.weight"])
    pert = fb.member_init_params(setup.model, init, 0, 1, rule="perturb", std=0.001)
    d = pert["0.weight"] - init["0.weight"]
    assert 0 < d.abs().max() < 0.01
    assert member_seed(0, 1) != member_seed(0, 2) and member_seed(0, 1) != member_seed(1, 1)


def test_loop_trains_members_and_caches_them(tmp_path):
    M = 3
    cfg = dict(members=M, laplace="kron", select="min_objective", server_steps=5)
    setup = _setup(cache=ClientStageCache(tmp_path), dtype=torch.float32)
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    algo = _Spy(cfg, setup)
    state, logs = run_rounds(setup, algo, init, 1, progress=False)
    # every client got M trained models; member m from the same start on every client, distinct across m
    assert all(isinstance(p, list) and len(p) == M for p in algo.seen.values())
    assert set(algo.starts) == {1, 2}
    assert not torch.equal(algo.starts[1]["0.weight"], algo.starts[2]["0.weight"])
    for c in range(2):
        ws = [p["0.weight"] for p in algo.seen[c]]
        assert not torch.equal(ws[0], ws[1]) and not torch.equal(ws[1], ws[2])
    # member 0 is the plain training from the run's init with the run seed (shared with every method)
    plain = train_clients(setup.model, setup.train, setup.client_indices, init, setup.local, seed=setup.seed,
                          round_idx=1)
    for c in range(2):
        assert torch.equal(plain.params[c]["0.weight"], algo.seen[c][0]["0.weight"])
    # member 2 = training from its shared init with its own data-order seed
    mem2 = train_clients(setup.model, setup.train, setup.client_indices, algo.starts[2], setup.local,
                         seed=member_seed(setup.seed, 2), round_idx=1)
    assert torch.equal(mem2.params[1]["2.bias"], algo.seen[1][2]["2.bias"])
    assert setup.cache.misses == M + 2 * M and not logs[0].cached_clients   # M trainings + C·M curvatures
    assert len(state["components"]) == M and set(state["extra_eval"]) == {f"component{m}" for m in range(M)}
    # the second run: every training and curvature from the cache, the same answer
    setup2 = _setup(cache=ClientStageCache(tmp_path), dtype=torch.float32)
    algo2 = _Spy(cfg, setup2)
    state2, logs2 = run_rounds(setup2, algo2, init, 1, progress=False)
    assert setup2.cache.misses == 0 and setup2.cache.hits == M + 2 * M and logs2[0].cached_clients
    for m in range(M):
        assert all(torch.equal(state["components"][m][n], state2["components"][m][n]) for n in init)
    # a plain FedAvg run reuses member 0's cached training
    setup3 = _setup(cache=ClientStageCache(tmp_path), dtype=torch.float32)
    run_rounds(setup3, ALGORITHMS.get("fedavg")({}, setup3), init, 1, progress=False)
    assert setup3.cache.hits == 1 and setup3.cache.misses == 0


def test_member_curvature_cache_follows_the_member_init_rule(tmp_path):
    """Table 7's perturbed replicas share Table 1's client stage: member 1's curvature must be computed at the replica,
    not read from the reset member 1 cached under the same index (the bug behind the first Table 7 records)."""
    cfg = dict(members=2, laplace="kron", select="min_objective", server_steps=3)
    init = {n: p.detach().clone() for n, p in _setup().model.to(torch.float32).named_parameters()}
    reset = _setup(cache=ClientStageCache(tmp_path), dtype=torch.float32)
    run_rounds(reset, _algo(reset, **cfg), init, 1, progress=False)
    shared = _setup(cache=ClientStageCache(tmp_path), dtype=torch.float32)
    state, _ = run_rounds(shared, _algo(shared, member_init="perturb", **cfg), init, 1, progress=False)
    # cached: member 0's training and both clients' member-0 curvature; new: member 1's training and curvatures
    assert shared.cache.hits == 1 + 2 and shared.cache.misses == 1 + 2
    alone = _setup(dtype=torch.float32)
    expect, _ = run_rounds(alone, _algo(alone, member_init="perturb", **cfg), init, 1, progress=False)
    for m in range(2):
        assert all(torch.allclose(state["components"][m][n], expect["components"][m][n]) for n in init)


def test_members_per_client_and_uplink():
    setup = _setup(dtype=torch.float32, epochs=1)
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    algo = _algo(setup, members=2, members_per_client=[1, 2], laplace="diag", select="min_objective",
                 server_steps=2)
    state, logs = run_rounds(setup, algo, init, 1, progress=False)
    assert len(state["components"]) == 1 and state["extra_eval"] == {}
    assert isinstance(algo.predict_params(state), dict)
    P = sum(p.numel() for p in init.values())
    assert logs[0].uplink_bytes == 4 * (2 * P) * (1 + 2)   # mean + diagonal precision per sent member


@pytest.mark.parametrize("cfg,needle", [
    ({"laplace": "full"}, "algorithm.laplace"),
    ({"members": 0}, "algorithm.members"),
    ({"members_per_client": [1]}, "members_per_client"),
    ({"select": "best"}, "algorithm.select"),
    ({"temperature": 0}, "temperature"),
    ({"variance_clamp": [1.0, 0.5]}, "variance_clamp"),
    ({"lr": 0.1}, "unknown algorithm key"),
])
def test_bad_config_one_line(cfg, needle):
    with pytest.raises(FedbenchError, match=needle) as e:
        _algo(_setup(), **cfg)
    assert "\n" not in str(e.value)


def test_missing_server_val_fails_in_init():
    with pytest.raises(FedbenchError, match="server validation set"):
        _algo(_setup(val=False))
    _algo(_setup(val=False), select="min_objective")   # Table 3's variant needs none


# ------------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------------
SMALL = ["dataset=synthetic", "dataset.kwargs.like=mnist", "dataset.kwargs.train_size=200",
         "dataset.kwargs.test_size=100", "model=mlp", "model.hidden=[8]", "num_clients=2", "rounds=1",
         "local.epochs=1", "hardware=cpu", "progress=false", "algorithm=fedbens", "algorithm.members=2",
         "algorithm.server_steps=4", "algorithm.val_every=2"]


def _run(args, tmp_path):
    env = {**os.environ, "FEDBENCH_OUTPUTS": str(tmp_path / "out"), "FEDBENCH_DATA": str(tmp_path / "data"),
           "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_end_to_end_record_with_component_accuracies(tmp_path):
    p = _run(SMALL + ["server_val.size=50"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    (rec_path,) = sorted((tmp_path / "out" / "runs").glob("*/metrics.json"))
    rec = json.loads(rec_path.read_text())
    assert rec["status"] == "ok" and rec["algorithm"] == "fedbens"
    for key in ("accuracy", "component0_accuracy", "component1_accuracy"):
        assert 0 <= rec["metrics"][key] <= 100
    # no server validation set: one clear line, exit 2, before training, no record
    p = _run(SMALL + ["seed=1"], tmp_path)
    assert p.returncode == 2 and "server validation set" in p.stderr
    assert len([l for l in p.stderr.strip().splitlines() if l.strip()]) == 1
