"""FedLPA Fig. 3's matrices: the full empirical Fisher against JᵀJ built by hand; K-FAC's blocks; the figure."""
import pytest
import torch
import torch.nn.functional as F

from fedbench.papers.fedlpa import fisher_heatmap as fh


def _tiny(seed=0):
    torch.manual_seed(seed)
    model = fh.tiny_cnn(image_size=8, num_classes=4, channels=(2, 3, 2)).double()
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 1, 0])
    return model, x, y


def _per_sample_jacobian(model, x, y):
    """J [N, P]: row n = ∇_θ CE(f(x_n), y_n), parameters flattened in named_parameters order."""
    rows = []
    for xn, yn in zip(x, y):
        loss = F.cross_entropy(model(xn[None]), yn[None])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def test_full_empirical_fisher_is_jt_j_over_n():
    model, x, y = _tiny()
    full, kfac = fh.fisher_pair(model, x, y)
    J = _per_sample_jacobian(model, x, y)
    P = sum(p.numel() for p in model.parameters())
    assert full.shape == kfac.shape == (P, P)
    torch.testing.assert_close(full, J.T @ J / len(x), rtol=1e-10, atol=1e-12)


def test_kfac_is_block_diagonal_and_exact_for_a_linear_layer_on_one_sample():
    model, x, y = _tiny()
    slices = fh.layer_slices(model)
    assert [n for n, _ in slices] == ["conv1", "conv2", "conv3", "fc1"]
    assert slices[-1][1].stop == sum(p.numel() for p in model.parameters())
    _, kfac = fh.fisher_pair(model, x, y)
    assert torch.equal(fh.block_diagonal(kfac, slices), kfac)        # nothing outside the layer blocks
    full1, kfac1 = fh.fisher_pair(model, x[:1], y[:1])
    fc = slices[-1][1]                                               # one sample: δδᵀ ⊗ ããᵀ = (δ⊗ã)(δ⊗ã)ᵀ exactly
    torch.testing.assert_close(kfac1[fc, fc], full1[fc, fc], rtol=1e-10, atol=1e-12)


def test_block_diagonal_and_relative_error():
    m = torch.tensor([[4.0, 1.0, 0.0], [1.0, 2.0, 2.0], [0.0, 2.0, 1.0]])
    bd = fh.block_diagonal(m, [("a", slice(0, 1)), ("b", slice(1, 3))])
    assert torch.equal(bd, torch.tensor([[4.0, 0.0, 0.0], [0.0, 2.0, 2.0], [0.0, 2.0, 1.0]]))
    assert fh.relative_frobenius(bd, m) == pytest.approx((2 / 31) ** 0.5)    # ‖(1, 1)‖ / ‖m‖_F, ‖m‖² = 31


def test_figure_draws_from_given_images(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)

    def fake_mnist(root, n_train, n_fisher, seed):
        x = torch.randn(n_train + n_fisher, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (n_train + n_fisher,), generator=g)
        return x[:n_train], y[:n_train], x[n_train:], y[n_train:]

    monkeypatch.setattr(fh, "mnist_tensors", fake_mnist)
    r = fh.figure_fedlpa3(tmp_path / "f3.png", n_train=64, n_fisher=16, epochs=1)
    assert r["num_params"] == 1432 and 0 < r["blockdiag_error"] < 1 and r["kfac_error"] > 0
    assert 10_000 < (tmp_path / "f3.png").stat().st_size < 300_000
