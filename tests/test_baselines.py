"""FedProx / FedNova / SCAFFOLD / FedDyn against FedAvg and their closed forms."""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fedbench.algorithms import build_algorithm
from fedbench.algorithms.fednova import effective_steps
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, client_generator, epoch_batches


def _setup(momentum=0.0, sizes=(30, 45, 25), backend="serial"):
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    torch.manual_seed(0)  # the same initial weights whatever ran before (tests compare two setups)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    train = TrainData(x, y)
    idx, s = [], 0
    for k in sizes:
        idx.append(torch.arange(s, s + k))
        s += k
    local = LocalTrainConfig(lr=0.1, momentum=momentum, batch_size=10, epochs=2)
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx, local=local,
                   seed=0, device=torch.device("cpu"), backend=backend)


def _run(setup, cfg, rounds=1):
    torch.manual_seed(0)
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    state, logs = run_rounds(setup, build_algorithm(cfg, setup), init, rounds, progress=False)
    return state, logs, init


def _close(a, b, **kw):
    for n in a:
        torch.testing.assert_close(a[n], b[n], **kw)


def test_fedavg_is_weighted_average_of_clients():
    setup = _setup()
    state, logs, init = _run(setup, {"name": "fedavg"})
    from fedbench.train.engine import train_clients

    res = train_clients(setup.model, setup.train, setup.client_indices, init, setup.local, seed=0, round_idx=1)
    w = torch.tensor([30.0, 45, 25]) / 100
    want = {n: sum(wk * p[n] for wk, p in zip(w, res.params)) for n in init}
    _close(state["params"], want, rtol=1e-6, atol=1e-6)
    assert logs[0].uplink_bytes == 3 * sum(t.numel() * 4 for t in init.values())


@pytest.mark.parametrize("backend", ["serial", "batched"])
def test_one_round_scaffold_and_prox0_equal_fedavg(backend):
    base, _, _ = _run(_setup(momentum=0.9, backend=backend), {"name": "fedavg"})
    sc, logs, init = _run(_setup(momentum=0.9, backend=backend), {"name": "scaffold"})
    _close(sc["params"], base["params"])
    assert logs[0].uplink_bytes == 2 * 3 * sum(t.numel() * 4 for t in init.values())  # model + control variate
    px, _, _ = _run(_setup(momentum=0.9, backend=backend), {"name": "fedprox", "mu": 0.0})
    _close(px["params"], base["params"])
    px1, _, _ = _run(_setup(momentum=0.9, backend=backend), {"name": "fedprox", "mu": 1.0})
    assert max((px1["params"][n] - base["params"][n]).abs().max() for n in base["params"]) > 1e-4


def test_scaffold_control_variates_change_round_two():
    sc, _, _ = _run(_setup(), {"name": "scaffold"}, rounds=2)
    av, _, _ = _run(_setup(), {"name": "fedavg"}, rounds=2)
    assert any(sc["c"][n].abs().max() > 0 for n in sc["c"])
    assert max((sc["params"][n] - av["params"][n]).abs().max() for n in av["params"]) > 1e-5


def _released_scaffold_rounds(setup, init, rounds):
    """NIID-Bench's SCAFFOLD written out: torch's SGD (momentum, weight decay) on each batch, then
    theta -= lr (c - c_k); c_k+ = c_k - c + (theta_g - theta_k) / (steps lr); p-weighted model average."""
    lr, sizes = setup.local.lr, [len(ix) for ix in setup.client_indices]
    theta_g, c = dict(init), {n: torch.zeros_like(t) for n, t in init.items()}
    cks = [dict(c) for _ in sizes]
    for r in range(1, rounds + 1):
        trained, deltas = [], []
        for k, ix in enumerate(setup.client_indices):
            model = copy.deepcopy(setup.model)
            named = dict(model.named_parameters())
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(theta_g[n])
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=setup.local.momentum,
                                  weight_decay=setup.local.weight_decay)
            gen, steps = client_generator(setup.seed, r, k), 0
            for _ in range(setup.local.epochs):
                for b in epoch_batches(len(ix), setup.local.batch_size, gen, setup.local.drop_last):
                    opt.zero_grad()
                    F.cross_entropy(model(setup.train.x[ix[b]]), setup.train.y[ix[b]]).backward()
                    opt.step()
                    with torch.no_grad():
                        for n, p in named.items():
                            p.sub_(lr * (c[n] - cks[k][n]))
                    steps += 1
            theta_k = {n: p.detach().clone() for n, p in named.items()}
            ck_new = {n: cks[k][n] - c[n] + (theta_g[n] - theta_k[n]) / (steps * lr) for n in c}
            deltas.append({n: ck_new[n] - cks[k][n] for n in c})
            trained.append(theta_k)
            cks[k] = ck_new
        w = [s_k / sum(sizes) for s_k in sizes]
        theta_g = {n: sum(wk * t[n] for wk, t in zip(w, trained)) for n in c}
        c = {n: c[n] + sum(d[n] for d in deltas) / len(deltas) for n in c}
    return theta_g, c


@pytest.mark.parametrize("backend", ["serial", "batched"])
def test_scaffold_after_step_correction_is_the_released_update(backend):
    def setup():
        s = _setup(momentum=0.9, backend=backend)
        s.local = dataclasses.replace(s.local, weight_decay=1e-3)
        return s

    released, _, init = _run(setup(), {"name": "scaffold", "correction": "after_step"}, rounds=3)
    want_params, want_c = _released_scaffold_rounds(setup(), init, rounds=3)
    _close(released["params"], want_params, rtol=1e-5, atol=1e-6)
    _close(released["c"], want_c, rtol=1e-4, atol=1e-5)
    # through the momentum (the paper's corrected gradient) the weights differ from round 2 on
    through_momentum, _, _ = _run(setup(), {"name": "scaffold", "correction": "gradient"}, rounds=3)
    assert max((through_momentum["params"][n] - want_params[n]).abs().max() for n in want_params) > 1e-4


def test_fednova_formula_and_equal_steps_reduce_to_fedavg():
    assert effective_steps(5, 0.0) == 5
    rho, tau = 0.9, 7
    assert effective_steps(tau, rho) == pytest.approx(sum((1 - rho ** (i + 1)) / (1 - rho) for i in range(tau)))
    # equal client sizes -> equal steps -> FedNova == FedAvg
    nova, _, _ = _run(_setup(sizes=(30, 30, 30)), {"name": "fednova", "rho": 0.0})
    avg, _, _ = _run(_setup(sizes=(30, 30, 30)), {"name": "fedavg"})
    _close(nova["params"], avg["params"], rtol=1e-5, atol=1e-6)
    # unequal steps: differs from FedAvg
    nova2, _, _ = _run(_setup(), {"name": "fednova", "rho": 0.0})
    avg2, _, _ = _run(_setup(), {"name": "fedavg"})
    assert max((nova2["params"][n] - avg2["params"][n]).abs().max() for n in avg2["params"]) > 1e-5


def test_feddyn_server_rule_and_vanishing_alpha():
    setup = _setup()
    st, _, init = _run(setup, {"name": "feddyn", "alpha": 1e-12})
    avg, _, _ = _run(_setup(), {"name": "fedavg", "weighting": "uniform"})
    _close(st["avg"], avg["params"], rtol=1e-5, atol=1e-6)  # correction ~0 -> trains like FedAvg
    # theta_g = mean theta_k + mean h_k with h_k = theta_k - theta_0 after round 1
    want = {n: 2 * st["avg"][n] - init[n] for n in init}
    _close(st["params"], want, rtol=1e-5, atol=1e-6)
    for k in range(3):
        assert set(st["h"][k]) == set(init)


def test_feddyn_with_an_empty_client_matches_the_run_without_it_up_to_the_average():
    # size_class_dirichlet at 10 % of FMNIST left a client empty (seed 1): FedDyn divided by its size.
    st, _, init = _run(_setup(sizes=(30, 0, 45, 25)), {"name": "feddyn", "alpha": 0.01})
    ref, _, _ = _run(_setup(sizes=(30, 45, 25)), {"name": "feddyn", "alpha": 0.01})
    for n in init:  # the empty client sends theta_g back: h stays 0 and it enters the mean as theta_g
        assert torch.equal(st["h"][1][n], torch.zeros_like(init[n]))
        assert torch.isfinite(st["params"][n]).all()


def test_feddyn_variant_acar_stays_out_of_the_run_id():
    """Every FedDyn record made before the switch keeps its run id; bayes_admm is a new run."""
    from omegaconf import OmegaConf
    from fedbench.config.compose import compose_config
    from fedbench.results.records import compute_run_id
    cfg = compose_config(["algorithm=feddyn"])
    bare = OmegaConf.to_container(cfg, resolve=True)
    del bare["algorithm"]["variant"]
    assert cfg.algorithm.variant == "acar" and compute_run_id(cfg) == compute_run_id(bare)
    assert compute_run_id(compose_config(["algorithm=feddyn", "algorithm.variant=bayes_admm"])) != compute_run_id(cfg)


def test_feddyn_bayes_admm_term_gradient_is_the_released_loss():
    """d/dθ [α_k/2 ||θ-θ_g|| + <θ, α_k h> + wd/2 ||θ||²] = α_k/2 (θ-θ_g)/||θ-θ_g|| + α_k h + wd θ, over all
    tensors as one vector (the released loss norms the flattened parameter vector); 0 + α_k h at θ = θ_g."""
    from fedbench.algorithms.feddyn import feddyn_bayes_admm_term
    g = torch.Generator().manual_seed(1)
    shapes = {"w": (3, 4), "b": (4,)}
    p = {n: torch.randn(s, generator=g, requires_grad=True) for n, s in shapes.items()}
    ctx = {"alpha_k": torch.tensor(0.3), "wd": torch.tensor(0.05),
           "theta_g": {n: torch.randn(s, generator=g) for n, s in shapes.items()},
           "h": {n: torch.randn(s, generator=g) for n, s in shapes.items()}}
    grads = torch.autograd.grad(feddyn_bayes_admm_term(p, ctx), list(p.values()))
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in shapes])
    diff = flat(p).detach() - flat(ctx["theta_g"])
    want = 0.15 * diff / diff.norm() + 0.3 * flat(ctx["h"]) + 0.05 * flat(p).detach()
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in grads]), want)
    at_g = {n: ctx["theta_g"][n].clone().requires_grad_(True) for n in shapes}
    grads = torch.autograd.grad(feddyn_bayes_admm_term(at_g, ctx), list(at_g.values()))
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in grads]),
                               0.3 * flat(ctx["h"]) + 0.05 * flat(ctx["theta_g"]))


def test_feddyn_bayes_admm_server_adds_1_over_k_of_the_weighted_drift_from_round_two():
    from fedbench.algorithms.base import Message
    setup = _setup(sizes=(30, 45, 25))
    alpha = 0.02
    algo = build_algorithm({"name": "feddyn", "alpha": alpha, "variant": "bayes_admm"}, setup)
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    state = algo.init_state(init)
    g = torch.Generator().manual_seed(3)
    rand = lambda: {n: t + torch.randn(t.shape, generator=g) for n, t in init.items()}
    ctx = algo.local_objective(state, [0, 1, 2], 1).client_ctx
    assert [float(c["alpha_k"]) for c in ctx] == pytest.approx([alpha * 0.30, alpha * 0.45, alpha * 0.25])
    w1 = [rand() for _ in range(3)]
    state = algo.aggregate([Message(k, 1, {"params": w1[k]}) for k in range(3)], state, 1)
    mean1 = {n: sum(w[n] for w in w1) / 3 for n in init}
    _close(state["params"], mean1)   # round 1: the plain mean, no history
    for k in range(3):   # the client duals still count round 1's drift
        _close(state["h"][k], {n: w1[k][n] - init[n] for n in init})
    w2 = [rand() for _ in range(3)]
    state2 = algo.aggregate([Message(k, 1, {"params": w2[k]}) for k in range(3)], state, 2)
    frac = [0.30, 0.45, 0.25]
    want = {n: sum(w[n] for w in w2) / 3 + sum(f / 3 * (w[n] - mean1[n]) for f, w in zip(frac, w2)) for n in init}
    _close(state2["params"], want, rtol=1e-5, atol=1e-6)
    acar = build_algorithm({"name": "feddyn", "alpha": alpha}, setup)   # acar adds the whole mean of h_k
    st = acar.aggregate([Message(k, 1, {"params": w1[k]}) for k in range(3)], acar.init_state(init), 1)
    _close(st["params"], {n: 2 * mean1[n] - init[n] for n in init}, rtol=1e-5, atol=1e-6)


def test_feddyn_bayes_admm_trains_the_same_serial_and_batched():
    runs = [_run(_setup(backend=b), {"name": "feddyn", "alpha": 0.5, "weight_decay": 1e-3, "variant": "bayes_admm"},
                 rounds=2)[0] for b in ("serial", "batched")]
    _close(runs[0]["params"], runs[1]["params"], rtol=1e-4, atol=1e-5)
    plain, _, _ = _run(_setup(), {"name": "feddyn", "alpha": 0.5, "weight_decay": 1e-3}, rounds=2)
    assert max((plain["params"][n] - runs[0]["params"][n]).abs().max() for n in plain["params"]) > 1e-4
