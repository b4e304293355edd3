"""Damping, Gaussian posteriors and the online diagonal Fisher against explicit dense computations
(float64; exact identities checked to 1e-9)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import MultivariateNormal

from fedbench.curvature import (DenseGaussian, DiagGaussian, KronBlock, KronGaussian,
                                OnlineDiagFisher, OnlineDiagFisherHook, ParamLayout, ProductGaussian,
                                compute_curvature, damp, damp_kfac, gaussian_from_curvature, kron_pi)
from fedbench.errors import FedbenchError

DT = torch.float64
TOL = 1e-9


def spd(n, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(n, n + 2, generator=g, dtype=DT)
    return scale * (M @ M.t()) / n


def model_and_data(n=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, bias=True), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3, bias=False),
                          nn.Tanh(), nn.Linear(3, 3)).to(DT)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, 6, 6, generator=g, dtype=DT)
    y = torch.randint(0, 3, (n,), generator=g)
    return model, x, y


# ------------------------------------------------------------------------------------------------
# damping
# ------------------------------------------------------------------------------------------------
def test_damp_kfac_pi_one_and_trace_rule():
    A, G = spd(5, 0), spd(3, 1, scale=7.0)
    lam = 1e-3
    A1, G1 = damp_kfac(A, G, lam, pi="one")
    s = math.sqrt(lam)
    assert torch.allclose(A1, A + s * torch.eye(5, dtype=DT), atol=TOL)
    assert torch.allclose(G1, G + s * torch.eye(3, dtype=DT), atol=TOL)
    pi = math.sqrt((A.trace() / 5) / (G.trace() / 3))
    assert kron_pi(A, G, "trace") == pytest.approx(float(pi), rel=1e-12)
    A2, G2 = damp_kfac(A, G, lam, pi="trace")
    assert torch.allclose(A2, A + pi * s * torch.eye(5, dtype=DT), atol=TOL)
    assert torch.allclose(G2, G + s / pi * torch.eye(3, dtype=DT), atol=TOL)
    # (A + π√λ I) ⊗ (G + √λ/π I) = A⊗G + λI + √λ (π I⊗G + A⊗I/π)   (Eq. 30 expanded)
    I5, I3 = torch.eye(5, dtype=DT), torch.eye(3, dtype=DT)
    lhs = torch.kron(A2, G2)
    rhs = torch.kron(A, G) + lam * torch.eye(15, dtype=DT) + s * (pi * torch.kron(I5, G) + torch.kron(A, I3) / pi)
    assert torch.allclose(lhs, rhs, atol=TOL)
    assert torch.allclose(damp_kfac(A, G, lam, pi=2.0)[0], A + 2 * s * I5, atol=TOL)


def test_damp_on_curvatures():
    model, x, y = model_and_data()
    k = compute_curvature(model, x, y, structure="kfac", fisher="true")
    kd = damp(k, 0.01, mode="kron", pi="one")
    for key, b in kd.blocks.items():
        assert torch.allclose(b.A, k.blocks[key].A + 0.1 * torch.eye(b.d_in, dtype=DT), atol=TOL)
        assert torch.allclose(b.G, k.blocks[key].G + 0.1 * torch.eye(b.d_out, dtype=DT), atol=TOL)
    ki = damp(k, 0.01, mode="isotropic")
    P = k.layout.numel
    assert torch.allclose(ki.to_dense(), k.to_dense() + 0.01 * torch.eye(P, dtype=DT), atol=TOL)
    d = compute_curvature(model, x, y, structure="diag", fisher="true")
    assert torch.allclose(damp(d, 0.5).diagonal(), d.vector() + 0.5, atol=TOL)
    assert torch.equal(damp(d, 0.5, mode="none").diagonal(), d.diagonal())
    with pytest.raises(FedbenchError):
        damp(d, 0.1, mode="kron")
    with pytest.raises(FedbenchError):
        damp(d, 0.1, mode="tikhonov")
    with pytest.raises(FedbenchError):
        damp(k, -1.0)
    with pytest.raises(FedbenchError):
        damp_kfac(k.blocks["0"].A, k.blocks["0"].G, 0.1, pi="norm")


# ------------------------------------------------------------------------------------------------
# Gaussian posteriors
# ------------------------------------------------------------------------------------------------
def check_gaussian(post, Lam, mean):
    """Every Gaussian method against the dense precision ``Lam``."""
    P = Lam.shape[0]
    g = torch.Generator().manual_seed(3)
    v = torch.randn(4, P, generator=g, dtype=DT)
    assert torch.allclose(post.precision_mv(v), v @ Lam, atol=TOL)
    assert torch.allclose(post.solve(v), torch.linalg.solve(Lam, v.t()).t(), atol=1e-8)
    assert float(post.logdet()) == pytest.approx(float(torch.logdet(Lam)), abs=1e-8)
    theta = mean + torch.randn(3, P, generator=g, dtype=DT)
    ref = MultivariateNormal(mean, precision_matrix=Lam).log_prob(theta)
    assert torch.allclose(post.log_prob(theta), ref, atol=1e-8)
    assert torch.allclose(post.log_prob(theta[0]), ref[0], atol=1e-8)
    # the noise map N satisfies N Nᵀ = Λ⁻¹ (so samples have covariance Λ⁻¹)
    Nmap = post._noise(torch.eye(P, dtype=DT))
    assert torch.allclose(Nmap.t() @ Nmap, torch.linalg.inv(Lam), atol=1e-8)
    s = post.sample(5, generator=torch.Generator().manual_seed(0))
    assert s.shape == (5, P)
    # log_prob is differentiable in θ: ∇ = −Λ(θ−μ)
    t = theta[0].clone().requires_grad_(True)
    post.log_prob(t).backward()
    assert torch.allclose(t.grad, -(Lam @ (theta[0] - mean)), atol=1e-8)


def test_kron_gaussian_against_dense_kronecker():
    layout = ParamLayout(["w1", "b1", "w2"], [(3, 2, 2, 2), (3,), (2, 5)])
    A1, G1 = spd(9, 0), spd(3, 1)            # [W1 | b1]: d_in = 2·2·2 + 1
    A2, G2 = spd(5, 2), spd(2, 3)
    blocks = [KronBlock("l1", ("w1", "b1"), (torch.Size([3, 2, 2, 2]), torch.Size([3])), A1, G1),
              KronBlock("l2", ("w2",), (torch.Size([2, 5]),), A2, G2)]
    mean = torch.randn(layout.numel, dtype=DT)
    coef, delta = 1 / 0.1, 10.0                 # FedBEns: T = 0.1, prior precision 10
    post = KronGaussian(layout, mean, blocks, coef=coef, delta=delta)
    Lam = torch.zeros(layout.numel, layout.numel, dtype=DT)
    # explicit: block 1 in its parameter order (w1 flattened, then b1) from kron(G, A) on M = [W | b]
    M_idx = torch.arange(27).reshape(3, 9)
    order1 = torch.cat([M_idx[:, :8].reshape(-1), M_idx[:, 8]])
    K1 = torch.kron(G1, A1)[order1][:, order1]
    Lam[:27, :27] = coef * K1
    Lam[27:, 27:] = coef * torch.kron(G2, A2)
    Lam += delta * torch.eye(layout.numel, dtype=DT)
    check_gaussian(post, Lam, mean)
    # eigenvalues c·λ_G λ_A + δ
    ev = torch.sort(torch.cat([e.reshape(-1) for e in post.eigenvalues()])).values
    assert torch.allclose(ev, torch.linalg.eigvalsh(Lam), atol=1e-8)
    # bytes: upper triangles of A and G plus the mean (float64 = 8 bytes)
    tri = lambda n: n * (n + 1) // 2
    assert post.nbytes() == 8 * (layout.numel + tri(9) + tri(3) + tri(5) + tri(2))
    assert post.nbytes(symmetric=False, include_mean=False) == 8 * (81 + 9 + 25 + 4)
    assert post.nbytes(bytes_per_value=4) == post.nbytes() // 2


def test_posteriors_from_curvature_match_dense():
    model, x, y = model_and_data()
    mean = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    T, prior = 0.1, 10.0
    for structure in ("diag", "kfac", "full", "layer_blocks", "diag_lastlayer_full"):
        c = compute_curvature(model, x, y, structure=structure, fisher="ggn", scale="sum")
        post = gaussian_from_curvature(c, model, prior_precision=prior, temperature=T)
        Lam = c.to_dense() / T + prior * torch.eye(c.layout.numel, dtype=DT)
        check_gaussian(post, Lam, mean)
        assert torch.allclose(post.mean, mean)
    # FedLPA: Kronecker-damped factors of the dataset-mean Fisher, scaled by N, no prior
    k = compute_curvature(model, x, y, structure="kfac", fisher="empirical")
    kd = damp(k, 1e-3, mode="kron")
    post = gaussian_from_curvature(kd, model, scale=x.shape[0])
    assert isinstance(post, KronGaussian)
    check_gaussian(post, x.shape[0] * kd.to_dense(), mean)
    # isotropic damping on the K-FAC curvature: exact in the eigenbasis
    ki = damp(k, 0.3)
    post = gaussian_from_curvature(ki, model, prior_precision=2.0, temperature=0.5)
    check_gaussian(post, (k.to_dense() + 0.3 * torch.eye(k.layout.numel, dtype=DT)) / 0.5
                   + 2.0 * torch.eye(k.layout.numel, dtype=DT), mean)


def test_diag_lastlayer_full_posterior_and_bytes():
    model, x, y = model_and_data()
    c = compute_curvature(model, x, y, structure="diag_lastlayer_full", fisher="ggn", scale="sum")
    post = gaussian_from_curvature(c, model, prior_precision=1.0)
    assert isinstance(post, ProductGaussian)
    assert isinstance(post.parts[0], DiagGaussian) and isinstance(post.parts[1], DenseGaussian)
    n_last = 3 * 3 + 3
    P = c.layout.numel
    assert post.nbytes() == 8 * (P + (P - n_last) + n_last * (n_last + 1) // 2)
    assert c.nbytes() == 8 * ((P - n_last) + n_last * (n_last + 1) // 2)
    d = compute_curvature(model, x, y, structure="diag", fisher="ggn")
    assert d.nbytes() == 8 * P
    assert gaussian_from_curvature(d, model, prior_precision=1.0).nbytes() == 8 * 2 * P


def test_invalid_posterior_options():
    model, x, y = model_and_data()
    d = compute_curvature(model, x, y, structure="diag")
    with pytest.raises(FedbenchError):
        gaussian_from_curvature(d, model, temperature=0.0)
    with pytest.raises(FedbenchError):
        gaussian_from_curvature(d, model, prior_precision=-1.0)
    full = compute_curvature(model, x, y, structure="full", fisher="empirical")
    with pytest.raises(FedbenchError):      # rank-deficient without a prior
        gaussian_from_curvature(full, model).logdet()


# ------------------------------------------------------------------------------------------------
# online diagonal Fisher (FOLA)
# ------------------------------------------------------------------------------------------------
def per_sample_sq(model, x, y):
    """Σ_i g_i² by a per-sample loop (independent reference)."""
    out = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            out[n] += p.grad ** 2
    model.zero_grad()
    return out


@pytest.mark.parametrize("mode", ["minibatch_sq", "per_sample_sq"])
def test_online_diag_fisher_against_explicit_sums(mode):
    model, x, y = model_and_data(n=11)
    N = x.shape[0]
    acc = OnlineDiagFisher(model, N, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 11), torch.arange(0, 5)]
    weighted = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    plain = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for b in batches:
        xb, yb = x[b], y[b]
        if mode == "minibatch_sq":
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            inc = {n: p.grad.detach() ** 2 for n, p in model.named_parameters()}
            acc.update(batch_size=len(b))                      # reads p.grad
        else:
            sq = per_sample_sq(model, xb, yb)
            inc = {n: v / len(b) for n, v in sq.items()}       # batch mean of per-sample squares
            acc.update(x=xb, y=yb)
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
        for n in inc:
            weighted[n] += len(b) / N * inc[n]
            plain[n] += inc[n]
        opt.step()                                              # weights move: the Fisher is online
    got = acc.fisher("none")
    steps = acc.fisher("steps")
    for n in weighted:
        assert torch.allclose(got[n], weighted[n], atol=TOL), n
        assert torch.allclose(steps[n], plain[n] / len(batches), atol=TOL), n
    c = acc.curvature()
    assert c.structure == "diag" and c.meta["steps"] == 4
    acc.reset()
    assert all(float(t.abs().sum()) == 0 for t in acc.fisher().values())


def test_online_hook_matches_single_client_accumulators():
    model, x, y = model_and_data(n=8)
    params = {n: p.detach() for n, p in model.named_parameters()}
    hook = OnlineDiagFisherHook(params, {3: 8, 5: 6})
    g = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(2, *p.shape, generator=g, dtype=DT) for n, p in params.items()}
    hook.after_backward([3, 5], grads, torch.tensor([4, 2]))
    hook.after_backward([5], {n: t[1:] for n, t in grads.items()}, torch.tensor([3]))
    for n in params:
        assert torch.allclose(hook[3].fisher()[n], 4 / 8 * grads[n][0] ** 2, atol=TOL)
        assert torch.allclose(hook[5].fisher()[n], (2 / 6 + 3 / 6) * grads[n][1] ** 2, atol=TOL)
    assert hook[5].steps == 2


def test_online_invalid_options():
    model, x, y = model_and_data()
    with pytest.raises(FedbenchError):
        OnlineDiagFisher(model, 10, mode="per_batch")
    with pytest.raises(FedbenchError):
        OnlineDiagFisher(model, 0)
    with pytest.raises(FedbenchError):
        OnlineDiagFisher({n: p for n, p in model.named_parameters()}, 10, mode="per_sample_sq")
    acc = OnlineDiagFisher(model, 10)
    with pytest.raises(FedbenchError):
        acc.update(batch_size=4)           # no .grad yet
    with pytest.raises(FedbenchError):
        acc.fisher("epochs")
    acc2 = OnlineDiagFisher(model, 10, mode="per_sample_sq")
    with pytest.raises(FedbenchError):
        acc2.update(batch_size=4)


def test_kfac_bytes_count_a_shared_g_once():
    model, x, y = model_and_data()
    aug = compute_curvature(model, x, y, structure="kfac", bias_augment=True)
    sep = compute_curvature(model, x, y, structure="kfac", bias_augment=False)
    tri = lambda n: n * (n + 1) // 2
    # conv "0": 2 out, 9 (+1) in; Linear "3": 3 out, 32 in, no bias; Linear "5": 3 out, 3 (+1) in
    assert aug.nbytes() == 8 * (tri(10) + tri(2) + tri(32) + tri(3) + tri(4) + tri(3))
    assert sep.nbytes() == 8 * (tri(9) + 1 + tri(2) + tri(32) + tri(3) + tri(3) + 1 + tri(3))
    assert sep.nbytes(symmetric=False) == 8 * (81 + 1 + 4 + 1024 + 9 + 9 + 1 + 9)
