"""The 2-D aggregation illustrations: products, diagonal, FedAvg collapse, mixture products, the figures."""
import numpy as np
import pytest

from fedbench.papers import gaussian_2d as g2

G1 = g2.Gaussian2D.from_cov((-1.0, 0.5), [[1.2, 0.7], [0.7, 0.8]])
G2 = g2.Gaussian2D.from_cov((1.5, -0.2), [[0.5, -0.3], [-0.3, 0.9]])


def _grid(n=401, half=7.0):
    X, Y, P = g2.grid((-half, half), (-half, half), n)
    return P, (2 * half / (n - 1)) ** 2


def test_gaussian_density_integrates_to_one_and_matches_scipy():
    from scipy.stats import multivariate_normal

    P, cell = _grid()
    assert G1.pdf(P).sum() * cell == pytest.approx(1.0, abs=1e-6)
    pts = np.array([[0.3, -0.4], [2.0, 1.0]])
    np.testing.assert_allclose(G1.pdf(pts), multivariate_normal(G1.mean, G1.cov).pdf(pts), rtol=1e-12)


def test_product_equals_the_closed_form_and_the_normalised_grid_product():
    prod = g2.product([G1, G2])
    S1, S2 = G1.cov, G2.cov
    inv = np.linalg.inv(S1 + S2)
    want_cov = S1 @ inv @ S2                                      # Σ₁(Σ₁+Σ₂)⁻¹Σ₂
    want_mean = S2 @ inv @ G1.mean + S1 @ inv @ G2.mean
    np.testing.assert_allclose(prod.cov, want_cov, atol=1e-12)
    np.testing.assert_allclose(prod.mean, want_mean, atol=1e-12)
    P, cell = _grid()
    raw = G1.pdf(P) * G2.pdf(P)
    z = raw.sum() * cell
    assert z == pytest.approx(np.exp(g2.log_overlap(G1, G2)), rel=1e-6)   # ∫N₁N₂ = N(μ₁; μ₂, Σ₁+Σ₂)
    np.testing.assert_allclose(raw / z, prod.pdf(P), atol=1e-7)


def test_weighted_product_and_ridge_line():
    half = g2.product([G1, G2], [0.5, 0.5])
    np.testing.assert_allclose(half.mean, g2.product([G1, G2]).mean, atol=1e-12)   # uniform weights move no mean
    np.testing.assert_allclose(half.precision, 0.5 * (G1.precision + G2.precision), atol=1e-12)
    ridge = g2.ridge_line(G1, G2, 11)
    np.testing.assert_allclose(ridge[0], G2.mean, atol=1e-12)     # π = 0
    np.testing.assert_allclose(ridge[-1], G1.mean, atol=1e-12)    # π = 1
    np.testing.assert_allclose(ridge[5], half.mean, atol=1e-12)


def test_diag_aggregate_ignores_correlation():
    def client(mean, a, b, c):
        return g2.Gaussian2D(np.array(mean, float), np.array([[a, c], [c, b]], float))

    strong = [client((-1, 0), 2.0, 1.0, 1.2), client((1, 1), 0.5, 3.0, -1.0)]
    none = [client((-1, 0), 2.0, 1.0, 0.0), client((1, 1), 0.5, 3.0, 0.0)]
    d = g2.diag_product(strong)
    # coordinate-wise precision-weighted means: ((2·−1 + 0.5·1)/2.5, (1·0 + 3·1)/4)
    np.testing.assert_allclose(d.mean, [-0.6, 0.75], atol=1e-12)
    np.testing.assert_allclose(d.precision, np.diag([2.5, 4.0]), atol=1e-12)
    np.testing.assert_allclose(g2.diag_product(none).mean, d.mean, atol=1e-12)
    assert np.linalg.norm(g2.product(strong).mean - d.mean) > 0.5   # the exact product does see the correlation


def test_fedavg_collapse_moment_matches_the_mixture():
    col = g2.fedavg_collapse([G1, G2], [1.0, 3.0])
    mix = g2.Mixture2D(np.array([0.25, 0.75]), (G1, G2))
    P, cell = _grid()
    w = mix.pdf(P) * cell
    mean = np.einsum("hw,hwi->i", w, P)
    d = P - mean
    cov = np.einsum("hw,hwi,hwj->ij", w, d, d)
    np.testing.assert_allclose(col.mean, 0.25 * G1.mean + 0.75 * G2.mean, atol=1e-12)
    np.testing.assert_allclose(col.mean, mean, atol=1e-5)
    np.testing.assert_allclose(col.cov, cov, atol=1e-4)


def test_mixture_product_weights_sum_to_one_and_match_the_grid():
    G3 = g2.Gaussian2D.from_cov((0.5, 2.0), [[0.3, 0.0], [0.0, 0.6]])
    a = g2.Mixture2D(np.array([0.3, 0.7]), (G1, G3))
    b = g2.Mixture2D(np.array([0.6, 0.4]), (G2, G3))
    prod = g2.mixture_product([a, b])
    assert len(prod.components) == 4 and prod.weights.sum() == pytest.approx(1.0, abs=1e-12)
    P, cell = _grid()
    raw = a.pdf(P) * b.pdf(P)
    np.testing.assert_allclose(raw / (raw.sum() * cell), prod.pdf(P), atol=1e-7)
    three = g2.mixture_product([a, b, g2.equal_mixture([G1, G2])])
    assert len(three.components) == 8 and three.weights.sum() == pytest.approx(1.0, abs=1e-12)


def test_kfac_fisher_splits_the_expectation():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((50, 2))
    e = 1.0 + a[:, 0]
    full, kfac = g2.kfac_fisher(a, e)
    np.testing.assert_allclose(full, sum(ei ** 2 * np.outer(ai, ai) for ai, ei in zip(a, e)) / 50, atol=1e-12)
    np.testing.assert_allclose(kfac, np.mean(e ** 2) * (a.T @ a) / 50, atol=1e-12)
    same_full, same_kfac = g2.kfac_fisher(a, np.full(50, 2.0))   # e² constant: K-FAC is exact
    np.testing.assert_allclose(same_full, same_kfac, atol=1e-12)


def test_mode_and_laplace():
    mix = g2.Mixture2D(np.array([0.5, 0.5]), (G1, G2))
    mode = g2.find_mode(mix, G1.mean)
    grad, hess = mix.grad_hess_logpdf(mode)
    assert np.linalg.norm(grad) < 1e-9 and np.all(np.linalg.eigvalsh(hess) < 0)
    lap = g2.laplace(g2.equal_mixture([G1]), G1.mean)         # a Gaussian's Laplace approximation is itself
    np.testing.assert_allclose(lap.precision, G1.precision, atol=1e-12)
    eps = 1e-5                                                # the analytic Hessian against finite differences
    num = np.stack([(mix.grad_hess_logpdf(mode + eps * e)[0] - mix.grad_hess_logpdf(mode - eps * e)[0]) / (2 * eps)
                    for e in np.eye(2)])
    np.testing.assert_allclose(hess, num, atol=1e-6)


def test_figures_make_the_papers_points(tmp_path):
    from fedbench.papers import gaussian_2d_figures as figs

    f6 = figs.figure_fedlpa6(tmp_path / "f6.png")
    err = {k: np.linalg.norm(f6[k] - f6["exact"]) for k in ("kfac", "diag", "fedavg")}
    assert err["kfac"] < 0.2 < 0.8 < err["diag"] and err["fedavg"] > 0.8
    f2 = figs.figure_fola2(tmp_path / "f2.png")
    assert f2["density_product"] > 100 * f2["density_fedavg"]   # ridge vs valley
    f1 = figs.figure_fedbens1(tmp_path / "f1.png")
    assert np.linalg.norm(f1["fedbens"] - f1["optimum"]) < 0.05 < 2.0 < np.linalg.norm(f1["laplace_at_a"] - f1["optimum"])
    for name in ("f6", "f2", "f1"):
        assert 10_000 < (tmp_path / f"{name}.png").stat().st_size < 300_000
