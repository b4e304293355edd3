"""FOLA and FedCurv against their closed forms, and the §IV-E softmax-regression study helpers."""
from types import SimpleNamespace

import dataclasses
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fedbench.algorithms.fedcurv as fedcurv_mod
import fedbench.algorithms.fola as fola_mod
from fedbench.algorithms.base import ALGORITHMS
from fedbench.curvature.posterior import diag_gaussian_product
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, client_generator, epoch_batches, train_clients


def _setup(backend="serial", sizes=(23, 31), clip=None, momentum=0.0, epochs=2, batch_size=8, drop_last=False):
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    x = torch.randn(n, 5, generator=g)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    train = TrainData(x, y)
    idx, s = [], 0
    for k in sizes:
        idx.append(torch.arange(s, s + k))
        s += k
    local = LocalTrainConfig(lr=0.2, momentum=momentum, batch_size=batch_size, epochs=epochs,
                             clip_grad_norm=clip, drop_last=drop_last)
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx, local=local,
                   seed=3, device=torch.device("cpu"), backend=backend)


def _init(setup):
    torch.manual_seed(0)
    for m in setup.model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    return {n: p.detach().clone() for n, p in setup.model.named_parameters()}


def _build(name, cfg, setup):
    return ALGORITHMS.get(name)(cfg, setup)


def _maxdiff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


# ---- Gaussian product -------------------------------------------------------------------------------------
def test_product_aggregation_is_closed_form_gaussian_product():
    g = torch.Generator().manual_seed(1)
    shapes = {"w": (3, 4), "b": (3,)}
    means = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(3)]
    precs = [{n: torch.rand(s, generator=g) * 2 + 0.1 for n, s in shapes.items()} for _ in range(3)]
    w = [10.0, 30.0, 60.0]
    pi = torch.tensor(w) / 100
    mu, om = diag_gaussian_product(means, precs, w, eps=0.0)
    for n in shapes:
        want_prec = sum(p * q[n] for p, q in zip(pi, precs))
        want_mean = sum(p * q[n] * m[n] for p, q, m in zip(pi, precs, means)) / want_prec
        torch.testing.assert_close(om[n], want_prec)
        torch.testing.assert_close(mu[n], want_mean)
    # scalar case: the product of N(1, 1/1) and N(3, 1/3) with equal weights has mean (1*1+3*3)/(1+3)
    m2, o2 = diag_gaussian_product([{"a": torch.tensor([1.0])}, {"a": torch.tensor([3.0])}],
                                            [{"a": torch.tensor([1.0])}, {"a": torch.tensor([3.0])}], [1, 1], eps=0.0)
    assert float(m2["a"]) == pytest.approx(2.5) and float(o2["a"]) == pytest.approx(2.0)


def test_product_eps_handling():
    means = [{"a": torch.tensor([2.0, 4.0])}, {"a": torch.tensor([6.0, 8.0])}]
    precs = [{"a": torch.tensor([0.0, 1.0])}, {"a": torch.tensor([0.0, 3.0])}]
    mu, om = diag_gaussian_product(means, precs, [1, 1], eps=1e-5, eps_mode="denominator")
    assert float(mu["a"][0]) == 0.0                       # code: zero precision everywhere pulls to 0 (§1.3)
    want = (0.5 * 1 * 4 + 0.5 * 3 * 8) / (0.5 * 1 + 0.5 * 3 + 1e-5)
    assert float(mu["a"][1]) == pytest.approx(want, rel=1e-6)
    assert torch.equal(om["a"], torch.tensor([0.0, 2.0]))  # the stored precision carries no eps
    mu2, _ = diag_gaussian_product(means, precs, [1, 1], eps=1e-5, eps_mode="per_client")
    assert float(mu2["a"][0]) == pytest.approx(4.0)        # falls back to the FedAvg average
    assert float(mu2["a"][1]) == pytest.approx((0.5 * 1 * 4 + 0.5 * 3 * 8 + 1e-5 * 6) / (2 + 1e-5), rel=1e-6)


def test_round_scaling_formulas():
    f, s = {"a": torch.tensor([4.0])}, {"a": torch.tensor([2.0])}
    assert float(fola_mod.client_precision(f, s, 4, "paper", "online")["a"]) == pytest.approx(4 / 4 + 2 * 3 / 4)
    assert float(fola_mod.client_precision(f, s, 4, "code", "online")["a"]) == pytest.approx(6.0)
    assert float(fola_mod.client_precision(f, s, 4, "code", "offline")["a"]) == pytest.approx(4.0)
    assert fola_mod.prior_coefficient(10.0, 4, "paper") == 10.0
    assert fola_mod.prior_coefficient(10.0, 4, "code") == 2.5


# ---- online Fisher -------------------------------------------------------------------------------------------
def _explicit_round(setup, start, prior_mean, prior_prec, coef, round_idx, per_sample=True):
    """Replays the engine's SGD by hand: explicit task gradients, explicit per-sample squares."""
    model = setup.model
    local = setup.local
    names = [n for n, _ in model.named_parameters()]
    out = []
    for cid, idx_all in enumerate(setup.client_indices):
        theta = {n: start[n].clone() for n in names}
        gen = client_generator(setup.seed, round_idx, cid)
        acc = {k: {n: torch.zeros_like(theta[n]) for n in names} for k in ("mb_w", "mb_u", "ps_w", "ps_u")}
        T, N, buf = 0, len(idx_all), None
        for _ in range(local.epochs):
            for b in epoch_batches(N, local.batch_size, gen, local.drop_last):
                idx = idx_all[b]
                x, y = setup.train.inputs(idx), setup.train.targets(idx)
                p = {n: theta[n].clone().requires_grad_(True) for n in names}
                loss = F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)
                g = dict(zip(names, torch.autograd.grad(loss, list(p.values()))))
                ps = {n: torch.zeros_like(theta[n]) for n in names}
                for i in range(len(idx) if per_sample else 0):
                    li = F.cross_entropy(torch.func.functional_call(model, p, (x[i:i + 1],)), y[i:i + 1])
                    gi = torch.autograd.grad(li, list(p.values()))
                    for n, t in zip(names, gi):
                        ps[n] += t ** 2 / len(idx)
                for n in names:
                    acc["mb_w"][n] += len(idx) / N * g[n] ** 2
                    acc["mb_u"][n] += g[n] ** 2
                    acc["ps_w"][n] += len(idx) / N * ps[n]
                    acc["ps_u"][n] += ps[n]
                T += 1
                total = {n: g[n] + coef * prior_prec[n] * (theta[n] - prior_mean[n]) for n in names}
                if local.clip_grad_norm is not None:
                    norm = torch.sqrt(sum((t ** 2).sum() for t in total.values()))
                    c = min(1.0, local.clip_grad_norm / (float(norm) + 1e-6))
                    total = {n: t * c for n, t in total.items()}
                if local.momentum:
                    buf = dict(total) if buf is None else {n: local.momentum * buf[n] + total[n] for n in names}
                    total = buf
                theta = {n: theta[n] - local.lr * total[n] for n in names}
        out.append({"theta": theta, "none": {"minibatch_sq": acc["mb_w"], "per_sample_sq": acc["ps_w"]},
                    "steps": {"minibatch_sq": {n: t / T for n, t in acc["mb_u"].items()},
                              "per_sample_sq": {n: t / T for n, t in acc["ps_u"].items()}}})
    return out


@pytest.mark.parametrize("backend,momentum", [("serial", 0.0), ("batched", 0.0), ("serial", 0.5)])
@pytest.mark.parametrize("grad", ["minibatch_sq", "per_sample_sq"])
def test_online_fisher_equals_explicit_sum_with_live_prior(backend, momentum, grad):
    setup = _setup(backend=backend, clip=0.2, momentum=momentum)
    init = _init(setup)
    algo = _build("fola", {"lambda_prior": 3.0, "fisher": {"grad": grad}}, setup)
    state, _ = run_rounds(setup, algo, init, 1, progress=False)   # round 1: ω_S from the online Fisher
    assert any(float(t.abs().max()) > 0 for t in state["precision"].values())
    obj = algo.local_objective(state, [0, 1], 2)
    assert len(obj.terms) == 1 and len(obj.step_hooks) == 1
    res = train_clients(setup.model, setup.train, setup.client_indices, state["params"], setup.local,
                        objective=obj, seed=setup.seed, round_idx=2, backend=backend)
    want = _explicit_round(setup, state["params"], state["params"], state["precision"], 3.0, 2,
                           per_sample=grad == "per_sample_sq")
    for cid in range(2):
        assert _maxdiff(res.params[cid], want[cid]["theta"]) < 1e-5      # the replay matches the engine
        for norm in ("none", "steps"):
            got = obj.step_hooks[0][cid].fisher(norm)
            ref = want[cid][norm][grad]
            scale = max(float(t.abs().max()) for t in ref.values())
            assert _maxdiff(got, ref) < 1e-4 * scale


def test_total_gradient_switch_differs_from_task_gradient():
    setup = _setup(clip=None)
    init = _init(setup)
    fs = {}
    for gradient in ("task", "total"):
        algo = _build("fola", {"lambda_prior": 50.0, "fisher": {"grad": "minibatch_sq", "gradient": gradient}}, setup)
        state, _ = run_rounds(setup, algo, init, 1, progress=False)
        obj = algo.local_objective(state, [0, 1], 2)
        train_clients(setup.model, setup.train, setup.client_indices, state["params"], setup.local, objective=obj,
                      seed=setup.seed, round_idx=2)
        fs[gradient] = obj.step_hooks[0][0].fisher("none")
    assert _maxdiff(fs["task"], fs["total"]) > 1e-6


def test_fisher_step_normalisation_and_round_one_sum():
    """Round 1 (no prior): the engine's gradients are task gradients; 'none' = Σ|b|/N g², 'steps' = mean g²."""
    setup = _setup()
    init = _init(setup)
    algo = _build("fola", {"fisher": {"grad": "minibatch_sq", "normalize": "none"}, "round_scaling": "code"}, setup)
    obj = algo.local_objective(algo.init_state(init), [0, 1], 1)
    assert obj.terms == []
    res = train_clients(setup.model, setup.train, setup.client_indices, init, setup.local, objective=obj,
                        seed=setup.seed, round_idx=1)
    want = _explicit_round(setup, init, init, {n: torch.zeros_like(t) for n, t in init.items()}, 0.0, 1,
                           per_sample=False)
    assert _maxdiff(obj.step_hooks[0][1].fisher("none"), want[1]["none"]["minibatch_sq"]) < 1e-6
    assert _maxdiff(obj.step_hooks[0][1].fisher("steps"), want[1]["steps"]["minibatch_sq"]) < 1e-6
    # the training result carries the hook's output (normalize: none), which client_message reads
    assert _maxdiff(res.extras["online_fisher"][1], want[1]["none"]["minibatch_sq"]) < 1e-6


# ---- prior gradient switch ------------------------------------------------------------------------------------
def test_prior_grad_live_changes_training_detached_equals_plain():
    runs = {}
    for key, cfg in {"live": {"lambda_prior": 20.0}, "detached": {"lambda_prior": 20.0,
                                                                    "prior_grad": "detached_as_released"},
                     "plain": {"lambda_prior": 0.0}}.items():
        setup = _setup()
        algo = _build("fola", {**cfg, "fisher": {"grad": "minibatch_sq"}}, setup)
        runs[key], _ = run_rounds(setup, algo, _init(setup), 3, progress=False)
    assert _maxdiff(runs["detached"]["params"], runs["plain"]["params"]) == 0.0
    assert _maxdiff(runs["detached"]["precision"], runs["plain"]["precision"]) == 0.0
    assert _maxdiff(runs["live"]["params"], runs["plain"]["params"]) > 1e-4


def test_live_prior_term_gradient_is_lambda_omega_delta():
    setup = _setup()
    init = _init(setup)
    algo = _build("fola", {"lambda_prior": 7.0, "round_scaling": "code"}, setup)
    state = {"params": init, "precision": {n: torch.rand_like(t) for n, t in init.items()}}
    obj = algo.local_objective(state, [0, 1], 2)
    theta = {n: (t + 0.1).requires_grad_(True) for n, t in init.items()}
    val = obj.terms[0](theta, obj.shared_ctx)
    g = torch.autograd.grad(val, list(theta.values()))
    for (n, t), gn in zip(theta.items(), g):
        torch.testing.assert_close(gn, 3.5 * state["precision"][n] * (t.detach() - init[n]))


# ---- offline Fisher, messages, variants -------------------------------------------------------------------------
def test_offline_fisher_and_message_bytes():
    setup = _setup()
    init = _init(setup)
    nbytes = sum(t.numel() * 4 for t in init.values())
    for grad in ("per_sample_sq", "minibatch_sq"):
        algo = _build("fola", {"fisher": {"mode": "offline", "grad": grad, "normalize": "none"}}, setup)
        state, logs = run_rounds(setup, algo, init, 1, progress=False)
        assert logs[0].uplink_bytes == 2 * 2 * nbytes and logs[0].downlink_bytes == 2 * 2 * nbytes
        res = train_clients(setup.model, setup.train, setup.client_indices, init, setup.local, seed=setup.seed,
                            round_idx=1)
        fis = fola_mod.offline_diag_fisher(setup, algo._worker, res.params[0], 0, grad=grad, normalize="none")
        idx = setup.client_indices[0]
        x, y = setup.train.inputs(idx), setup.train.targets(idx)
        want = {n: torch.zeros_like(t) for n, t in init.items()}
        p = {n: t.clone().requires_grad_(True) for n, t in res.params[0].items()}
        chunks = [slice(i, i + 1) for i in range(len(idx))] if grad == "per_sample_sq" else \
            [slice(i, i + setup.local.batch_size) for i in range(0, len(idx), setup.local.batch_size)]
        for sl in chunks:
            loss = F.cross_entropy(torch.func.functional_call(setup.model, p, (x[sl],)), y[sl])
            for n, gn in zip(p, torch.autograd.grad(loss, list(p.values()))):
                want[n] += len(x[sl]) / len(idx) * gn ** 2
        assert _maxdiff(fis, want) < 1e-6
    # prior loss + FedAvg aggregation: μ_S is the weighted average, ω_S still Σ π ω
    algo = _build("fola", {"aggregation": "mean"}, setup)
    state, _ = run_rounds(setup, algo, init, 1, progress=False)
    res = train_clients(setup.model, setup.train, setup.client_indices, init, setup.local, seed=setup.seed, round_idx=1)
    avg = {n: (23 * res.params[0][n] + 31 * res.params[1][n]) / 54 for n in init}
    assert _maxdiff(state["params"], avg) < 1e-6


def test_fola_code_preset_runs_and_uses_running_sum():
    setup = _setup(clip=10.0)
    init = _init(setup)
    cfg = {"prior_grad": "detached_as_released", "round_scaling": "code",
           "fisher": {"grad": "minibatch_sq", "normalize": "none"}}
    algo = _build("fola", cfg, setup)
    s1, _ = run_rounds(setup, algo, init, 1, progress=False)
    s2, _ = run_rounds(setup, _build("fola", cfg, setup), init, 2, progress=False)
    # running sum: the round-2 precision is at least the round-1 precision everywhere
    assert all(bool((s2["precision"][n] >= s1["precision"][n] - 1e-7).all()) for n in init)


# ---- FedCurv ---------------------------------------------------------------------------------------------------
def _fola_code_penalty(params, mean, precision, lam, round_idx, round_factor="inverse_round"):
    """The penalty FedCurv(fola_code) trains with: its local objective's term at the server state (mean, ω_S)."""
    setup = SimpleNamespace(num_clients=2, model=nn.Linear(1, 1))
    algo = _build("fedcurv", {"lambda_prior": lam, "round_factor": round_factor}, setup)
    obj = algo.local_objective({"params": mean, "precision": precision}, [0], round_idx)
    assert len(obj.terms) == 1
    return obj.terms[0](params, obj.shared_ctx)


def _original_penalty_reference(params, anchors, fishers, client, lam):
    """λ Σ_{j≠n} Σ_i F_{j,i} (θ_i − θ̂_{j,i})², the definition (a loop over the other clients)."""
    out = 0.0
    for j, (a, f) in enumerate(zip(anchors, fishers)):
        if j == client or a is None:
            continue
        out = out + sum((f[n] * (p - a[n]) ** 2).sum() for n, p in params.items())
    return lam * out


def test_fedcurv_formulas_on_tiny_tensors():
    g = torch.Generator().manual_seed(5)
    shp = {"w": (2, 3), "b": (2,)}
    theta = {n: torch.randn(s, generator=g, requires_grad=True) for n, s in shp.items()}
    mean = {n: torch.randn(s, generator=g) for n, s in shp.items()}
    prec = {n: torch.rand(s, generator=g) for n, s in shp.items()}
    # code variant: λ·(0.5/r)·Σω(θ-μ)², the term FedCurv's local objective adds in round r
    val = _fola_code_penalty(theta, mean, prec, lam=10.0, round_idx=4)
    want = 10.0 * 0.5 / 4 * sum((prec[n] * (theta[n] - mean[n]) ** 2).sum() for n in shp)
    torch.testing.assert_close(val, want)
    val1 = _fola_code_penalty(theta, mean, prec, lam=10.0, round_idx=4, round_factor="none")
    torch.testing.assert_close(val1, 4 * want)
    # original: λ Σ_{j≠n} Σ F_j (θ - θ̂_j)², via server sums minus own share
    K = 4
    anchors = [{n: torch.randn(s, generator=g) for n, s in shp.items()} for _ in range(K)]
    fishers = [{n: torch.rand(s, generator=g) for n, s in shp.items()} for _ in range(K)]
    sums = {"a": {n: sum(f[n] for f in fishers) for n in shp},
            "b": {n: sum(f[n] * a[n] for f, a in zip(fishers, anchors)) for n in shp},
            "c": sum(sum((f[n] * a[n] ** 2).sum() for n in shp) for f, a in zip(fishers, anchors))}
    term = fedcurv_mod.OriginalFedCurvTerm(2.0)
    for k in range(K):
        ctx = fedcurv_mod.original_context(sums, fishers[k], anchors[k])
        got = term(theta, ctx)
        ref = _original_penalty_reference(theta, anchors, fishers, k, 2.0)
        explicit = 2.0 * sum(sum((fishers[j][n] * (theta[n] - anchors[j][n]) ** 2).sum() for n in shp)
                             for j in range(K) if j != k)
        torch.testing.assert_close(ref, explicit)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        g1 = torch.autograd.grad(got, list(theta.values()))
        g2 = torch.autograd.grad(ref, list(theta.values()))
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the two variants differ on the same inputs
    code_val = _fola_code_penalty(theta, mean, prec, lam=4.0, round_idx=2)   # = λ 2 at r = 1 (no term in round 1)
    orig_val = term(theta, fedcurv_mod.original_context(sums, fishers[0], anchors[0]))
    assert abs(float(code_val.detach()) - float(orig_val.detach())) > 1e-3


@pytest.mark.parametrize("backend", ["serial", "batched"])
def test_fedcurv_runs_both_variants(backend):
    out = {}
    for variant in ("fola_code", "original"):
        setup = _setup(backend=backend, sizes=(20, 25, 15))
        init = _init(setup)
        algo = _build("fedcurv", {"variant": variant, "lambda_prior": 5.0}, setup)
        out[variant], logs = run_rounds(setup, algo, init, 2, progress=False)
        nbytes = sum(t.numel() * 4 for t in init.values())
        assert logs[0].uplink_bytes == 3 * 2 * nbytes
    st = out["original"]
    assert all(f is not None for f in st["fishers"])
    torch.testing.assert_close(st["sums"]["a"]["0.weight"], sum(f["0.weight"] for f in st["fishers"]))
    assert _maxdiff(out["original"]["params"], out["fola_code"]["params"]) > 1e-6
    # detached as released: FedCurv trains like FedAvg
    setup = _setup(backend=backend, sizes=(20, 25, 15))
    det, _ = run_rounds(setup, _build("fedcurv", {"prior_grad": "detached_as_released", "lambda_prior": 5.0}, setup),
                        _init(setup), 2, progress=False)
    setup = _setup(backend=backend, sizes=(20, 25, 15))
    avg, _ = run_rounds(setup, ALGORITHMS.get("fedavg")({}, setup), _init(setup), 2, progress=False)
    assert _maxdiff(det["params"], avg["params"]) < 1e-6


# ---- config errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,cfg", [
    ("fola", {"lambda_prior": -1}),
    ("fola", {"prior_grad": "detached"}),
    ("fola", {"round_scaling": "both"}),
    ("fola", {"aggregation": "median"}),
    ("fola", {"agg_eps": "x"}),
    ("fola", {"agg_eps_mode": "clip"}),
    ("fola", {"fisher": {"mode": "semi"}}),
    ("fola", {"fisher": {"grad": "per_sample"}}),
    ("fola", {"fisher": {"normalize": "epochs"}}),
    ("fola", {"fisher": {"gradient": "total"}}),          # total needs minibatch_sq
    ("fola", {"fisher": {"chunk_size": 0}}),
    ("fola", {"fisher": {"typo": 1}}),
    ("fola", {"lamda_prior": 1.0}),
    ("fola", {"agg_eps": 0.0}),
    ("fedcurv", {"variant": "shoham"}),
    ("fedcurv", {"lambda_prior": -2}),
    ("fedcurv", {"prior_grad": "none"}),
    ("fedcurv", {"round_factor": "r"}),
    ("fedcurv", {"fisher": {"grad": "kfac"}}),
    ("fedcurv", {"mu": 1}),
])
def test_bad_config_raises_one_line(name, cfg):
    with pytest.raises(FedbenchError) as e:
        _build(name, cfg, _setup())
    assert "\n" not in str(e.value)


def test_online_replay_needs_sgd():
    setup = _setup()
    setup.local = LocalTrainConfig(optimizer="adam", lr=0.01, batch_size=8, epochs=1)
    algo = _build("fola", {}, setup)
    with pytest.raises(FedbenchError):
        algo.local_objective(algo.init_state(_init(setup)), [0, 1], 1)


# ---- §IV-E study helpers (softmax regression, two clients) ---------------------------------------------------
from fedbench.papers.fola import laplace_study as fl  # noqa: E402


def _sr_problem(n=13, d=4, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, c, (n,), generator=g)
    theta = torch.randn(c * (d + 1), generator=g, dtype=torch.float64) * 0.5
    return x, y, theta


def test_softmax_regression_hessian_grad_and_fisher_match_autograd():
    x, y, theta = _sr_problem()
    xt = fl.augment(x)
    want = torch.autograd.functional.hessian(lambda t: fl.mean_loss(t, xt, y), theta)
    torch.testing.assert_close(fl.hessian(theta, xt), want)
    torch.testing.assert_close(fl.hessian(theta, xt, chunk_size=4), want)   # chunking changes nothing
    gw = torch.autograd.functional.jacobian(lambda t: fl.mean_loss(t, xt, y), theta)
    torch.testing.assert_close(fl.mean_grad(theta, xt, y).reshape(-1), gw)
    per = torch.stack([torch.autograd.functional.jacobian(lambda t: fl.mean_loss(t, xt[i:i + 1], y[i:i + 1]), theta)
                       for i in range(len(y))])
    torch.testing.assert_close(fl.diag_fisher_sum(theta, xt, y), (per ** 2).sum(0))
    ev = fl.efull_precision(want)
    assert bool((ev[1:] >= ev[:-1]).all()) and float(ev.min()) >= 0
    torch.testing.assert_close(ev.sum(), torch.diagonal(want).sum().clamp_min(0))
    # the isotropic reading: every entry is the mean eigenvalue (= tr(H)/P, no eigh)
    iso = fl.efull_precision(want, "isotropic")
    torch.testing.assert_close(iso, torch.full_like(ev, float(ev.mean())))
    # flat Θ order vs nn.Linear order
    lin = fl.to_linear(theta, 4)
    torch.testing.assert_close(fl.from_linear(lin["weight"], lin["bias"]), theta)
    flat_model = torch.cat([lin["weight"].reshape(-1), lin["bias"]])
    torch.testing.assert_close(theta[fl.model_order(3, 4)], flat_model)


def _pd(p, g, scale=1.0):
    a = torch.randn(p, p, generator=g, dtype=torch.float64)
    return a @ a.T * scale / p + 0.1 * torch.eye(p, dtype=torch.float64)


def test_ridge_curve_endpoints_and_interior():
    g = torch.Generator().manual_seed(2)
    p = 6
    l1, l2 = _pd(p, g), _pd(p, g, 3.0)
    mu1, mu2 = torch.randn(p, generator=g, dtype=torch.float64), torch.randn(p, generator=g, dtype=torch.float64)
    pis = torch.tensor([0.0, 0.3, 0.51, 1.0], dtype=torch.float64)
    curve = fl.ridge_curve(("dense", l1), mu1, ("dense", l2), mu2, pis, eps=0.0)
    torch.testing.assert_close(curve[-1], mu1)                 # π₁ = 1: client 1's mean
    torch.testing.assert_close(curve[0], mu2)
    for i, pi in enumerate(pis.tolist()):
        lam = pi * l1 + (1 - pi) * l2
        torch.testing.assert_close(curve[i], torch.linalg.solve(lam, pi * l1 @ mu1 + (1 - pi) * l2 @ mu2))
        prod, prec = fl.gaussian_product([("dense", l1), ("dense", l2)], [mu1, mu2], [pi, 1 - pi], eps=0.0)
        torch.testing.assert_close(prod, curve[i])
        torch.testing.assert_close(prec[1], lam)
    # with ε the curve solves (Λ(π₁) + εI)θ = b(π₁)
    ce = fl.ridge_curve(("dense", l1), mu1, ("dense", l2), mu2, pis, eps=0.5)
    torch.testing.assert_close(ce[2], torch.linalg.solve(0.51 * l1 + 0.49 * l2 + 0.5 * torch.eye(p, dtype=torch.float64),
                                                         0.51 * l1 @ mu1 + 0.49 * l2 @ mu2))
    # diagonal (diag Fisher / e-full) and identity (FedAvg)
    d1, d2 = torch.diagonal(l1).clone(), torch.diagonal(l2).clone()
    cd = fl.ridge_curve(("diag", d1), mu1, ("diag", d2), mu2, pis, eps=0.0)
    torch.testing.assert_close(cd[-1], mu1)
    torch.testing.assert_close(cd[1], (0.3 * d1 * mu1 + 0.7 * d2 * mu2) / (0.3 * d1 + 0.7 * d2))
    ci = fl.ridge_curve(("identity", None), mu1, ("identity", None), mu2, pis, eps=1e-5)
    torch.testing.assert_close(ci[1], 0.3 * mu1 + 0.7 * mu2)
    assert fl.posterior_distance(mu1, mu1, ("dense", l1)) == 0.0


def test_ridge_curve_on_singular_softmax_hessians_predicts_like_client_one():
    """Softmax Hessians are singular (logit shift); with the code's ε the π₁ = 1 end differs from μ₁ only
    in directions that do not change predictions much, and the solve works without a prior."""
    x, y, t1 = _sr_problem(n=40, seed=3)
    _, _, t2 = _sr_problem(n=40, seed=4)
    xt = fl.augment(x)
    h1, h2 = fl.hessian(t1, xt), fl.hessian(t2, xt)
    curve = fl.ridge_curve(("dense", h1), t1, ("dense", h2), t2, torch.tensor([1.0], dtype=torch.float64), eps=1e-8)
    torch.testing.assert_close(h1 @ curve[0], h1 @ t1, rtol=1e-5, atol=1e-6)


def test_normalized_cosine_of_diagonal_equals_dense_construction():
    a = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    b = torch.tensor([1.0, 0.2, 3.0], dtype=torch.float64)
    dense = fl.normalized_cosine(("dense", torch.diag(a)), ("dense", torch.diag(b)))
    assert fl.normalized_cosine(("diag", a), ("diag", b)) == pytest.approx(dense)
    assert fl.normalized_cosine(("diag", a), ("diag", 3 * a)) == pytest.approx(1.0)
    assert fl.normalized_cosine(("identity", None), ("identity", None)) == 1.0


def test_tiny_study_runs_every_method():
    g = torch.Generator().manual_seed(0)
    c, d = 4, 5
    centers = torch.randn(c, d, generator=g, dtype=torch.float64) * 2
    def data(n):
        y = torch.randint(0, c, (n,), generator=g)
        return centers[y] + torch.randn(n, d, generator=g, dtype=torch.float64), y
    x, y = data(120)
    m1, m2 = y < 2, y >= 2
    clients = [(x[m1], y[m1]), (x[m2], y[m2])]
    test = data(200)
    cfg = fl.StudyConfig(rounds=2, batch_size=16, lr=0.1, sweep_points=5, sweep_rounds=(1, 2), heatmap_size=7,
                         prior_precision=1e-3)
    res = fl.run_study(clients, test, cfg, num_classes=c)
    assert len(res.rounds) == 2 * len(fl.METHODS)
    assert len(res.sweep) == 2 * 5 * len(fl.METHODS)
    assert set(res.heatmaps) == {"full_online", "full_offline"} and res.heatmaps["full_online"].shape == (7, 7)
    by = {(r["method"], r["round"]): r for r in res.rounds}
    assert by[("fedavg", 1)]["precision_cosine"] == 1.0
    assert all(0 <= r["global_accuracy"] <= 1 for r in res.rounds)
    # FedAvg's π₁ = 1 end of the sweep is client 1's model: it only knows classes {0, 1}
    sw = [s for s in res.sweep if s["method"] == "fedavg" and s["round"] == 1]
    assert sw[-1]["pi1"] == 1.0 and sw[-1]["global_accuracy"] <= 0.75
    with pytest.raises(FedbenchError):
        fl.run_study(clients, test, fl.StudyConfig(methods=("kfac",)))
    with pytest.raises(FedbenchError):
        fl.run_study(clients, test, fl.StudyConfig(rounds=0))
    with pytest.raises(FedbenchError, match="efull_reading"):
        fl.run_study(clients, test, fl.StudyConfig(efull_reading="eigenvalues"))


def test_isotropic_efull_makes_the_two_client_precisions_proportional():
    """Under ``efull_reading: isotropic`` each client's e-full precision is a multiple of I, so the normalised
    Σ₁⁻¹ and Σ₂⁻¹ coincide (cosine 1), as the paper reports for e-full; the sorted-diagonal reading does not."""
    g = torch.Generator().manual_seed(1)
    c, d = 3, 4
    centers = torch.randn(c, d, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, c, (90,), generator=g)
    x = centers[y] + torch.randn(90, d, generator=g, dtype=torch.float64)
    clients = [(x[y < 1], y[y < 1]), (x[y >= 1], y[y >= 1])]
    cfg = fl.StudyConfig(rounds=1, batch_size=16, lr=0.1, sweep_points=3, sweep_rounds=(), methods=("efull_offline",),
                         efull_reading="isotropic", eps=0.0)
    res = fl.run_study(clients, (x, y), cfg, num_classes=c)
    assert res.rounds[0]["precision_cosine"] == pytest.approx(1.0)
    sorted_cfg = dataclasses.replace(cfg, efull_reading="sorted_diagonal")
    other = fl.run_study(clients, (x, y), sorted_cfg, num_classes=c)
    assert other.rounds[0]["precision_cosine"] < 0.999   # the sorted eigenvalues differ between the clients


def test_offline_variants_share_cached_round_one_clients(tmp_path):
    from fedbench.fl.cache import ClientStageCache

    def run(cfg_name, cfg):
        setup = _setup()
        setup.cache = ClientStageCache(tmp_path / "cache")
        setup.stage_parts = {"test": "fola", "seed": 0}
        algo = _build(cfg_name, cfg, setup)
        st, logs = run_rounds(setup, algo, _init(setup), 1, progress=False)
        return st, logs[0].cached_clients

    _, hit = run("fedavg", {})
    assert not hit
    off, hit = run("fola", {"fisher": {"mode": "offline"}})
    assert hit                                            # plain round-1 training: FedAvg's clients
    off2, hit = run("fola", {"fisher": {"mode": "offline"}})
    assert hit and _maxdiff(off["precision"], off2["precision"]) == 0.0   # cached Fisher, same result
    _, hit = run("fedcurv", {})
    assert hit
    _, hit = run("fola", {})                              # online Fisher: must train (never cached)
    assert not hit
    fresh = _build("fola", {"fisher": {"mode": "offline"}}, _setup())
    st, _ = run_rounds(fresh.setup, fresh, _init(fresh.setup), 1, progress=False)
    assert _maxdiff(st["precision"], off["precision"]) < 1e-6


@pytest.mark.parametrize("grad", ["minibatch_sq", "per_sample_sq"])
@pytest.mark.parametrize("momentum,memory_format", [(0.0, "channels_last"), (0.5, "contiguous")])
def test_serial_engine_passing_its_batch_gives_the_replays_bits(grad, momentum, memory_format):
    """The serial engine hands FOLA's hook its pre-step weights and minibatch (wants_batch) instead of the hook
    replaying the SGD update and the batch stream: the same Fisher and weights, bit for bit, with a live prior,
    clipping and momentum (committed FOLA records keep their numbers)."""
    setup = _setup(backend="serial", clip=0.2, momentum=momentum)
    algo = _build("fola", {"lambda_prior": 3.0, "fisher": {"grad": grad}}, setup)
    state, _ = run_rounds(setup, algo, _init(setup), 1, progress=False)
    fishers, weights = [], []
    for passed in (True, False):
        obj = algo.local_objective(state, [0, 1], 2)
        hook = obj.step_hooks[0]
        hook.wants_batch = passed
        calls = []
        replay_next = hook.replay.get(0).next if hook.replay else None
        if replay_next is not None:   # count the replayed batches of client 0
            hook.replay[0].next = lambda f=replay_next: calls.append(1) or f()
        res = train_clients(setup.model, setup.train, setup.client_indices, state["params"], setup.local,
                            objective=obj, seed=setup.seed, round_idx=2, backend="serial", memory_format=memory_format)
        assert (len(calls) > 0) == (grad == "per_sample_sq" and not passed)
        fishers.append([hook[c].fisher(norm) for c in (0, 1) for norm in ("none", "steps")])
        weights.append(res.params)
    for a, b in zip(*fishers):
        assert all(torch.equal(a[n], b[n]) for n in a)
        assert any(float(a[n].abs().max()) > 0 for n in a)
    for a, b in zip(*weights):
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("momentum,memory_format,chunk", [(0.0, "channels_last", 256), (0.5, "contiguous", 256),
                                                          (0.0, "contiguous", 5)])
def test_per_sample_squares_read_off_the_engines_forward_pass_give_the_second_passs_bits(
        momentum, memory_format, chunk, monkeypatch):
    """Under the serial engine the per-sample online Fisher reads each step's squares off the engine's own forward
    pass (``watch`` taps the worker) instead of a second forward pass at the pre-step weights: the same Fisher and
    weights, bit for bit, with a live prior, clipping and momentum, and no second pass; a minibatch larger than the
    hook's curvature chunk (chunk 5, batches of 8) keeps the second pass, as its chunked sums differ in rounding."""
    import fedbench.curvature.online as online

    setup = _setup(backend="serial", clip=0.2, momentum=momentum)
    algo = _build("fola", {"lambda_prior": 3.0, "fisher": {"grad": "per_sample_sq"}}, setup)
    state, _ = run_rounds(setup, algo, _init(setup), 1, progress=False)
    second_passes = []
    real = online.compute_curvature
    monkeypatch.setattr(online, "compute_curvature", lambda *a, **k: second_passes.append(1) or real(*a, **k))
    fishers, weights, passes = [], [], []
    for tapped in (True, False):
        obj = algo.local_objective(state, [0, 1], 2)
        hook = obj.step_hooks[0]
        hook.tap_forward, hook.chunk = tapped, chunk
        for acc in hook.accs.values():
            acc.batch_size = chunk
        second_passes.clear()
        res = train_clients(setup.model, setup.train, setup.client_indices, state["params"], setup.local,
                            objective=obj, seed=setup.seed, round_idx=2, backend="serial", memory_format=memory_format)
        passes.append(len(second_passes))
        fishers.append([hook[c].fisher(norm) for c in (0, 1) for norm in ("none", "steps")])
        weights.append(res.params)
        assert (hook.tap is not None) == tapped
    steps = sum(-(-len(i) // 8) for i in setup.client_indices) * setup.local.epochs
    assert passes[1] == steps
    assert passes[0] == (0 if chunk >= 8 else steps)
    for a, b in zip(*fishers):
        assert all(torch.equal(a[n], b[n]) for n in a)
        assert any(float(a[n].abs().max()) > 0 for n in a)
    for a, b in zip(*weights):
        assert all(torch.equal(a[n], b[n]) for n in a)
