"""Serial and batched local training must give the same weights (and match torch.optim)."""
import pytest
import torch
import torch.nn as nn

from fedbench.errors import FedbenchError
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import LocalObjective, TrainData, train_clients
from fedbench.train.stacked import CONV_STRATEGIES, StackedModel
from fedbench.train.terms import LinearTerm, ProximalTerm, QuadraticPriorTerm


class TinyCNN(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.c1 = nn.Conv2d(1, 3, 3, bias=bias)
        self.c2 = nn.Conv2d(3, 4, 3, padding=1, stride=2, bias=bias)
        self.fc = nn.Linear(4 * 3 * 3, 5, bias=bias)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        return self.fc(x.flatten(1))


def _data(n=70, seed=0, augment=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 5, (n,), generator=g)
    return TrainData(x, y, mean=(0.5,), std=(0.25,), augment=augment)


def _clients():
    # unequal sizes so clients finish at different steps and last batches are short
    return [torch.arange(0, 23), torch.arange(23, 30), torch.arange(30, 70)]


def _start(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("opt", [
    dict(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=8, epochs=3),
    dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, batch_size=8, epochs=2, clip_grad_norm=0.5),
    dict(optimizer="sgd", lr=0.1, batch_size=16, epochs=2),
    dict(optimizer="adam", lr=0.01, weight_decay=1e-4, batch_size=8, epochs=3),
])
@pytest.mark.parametrize("strategy", CONV_STRATEGIES)
def test_serial_equals_batched(opt, strategy):
    torch.manual_seed(0)
    model = TinyCNN()
    cfg = LocalTrainConfig(**opt)
    data, clients = _data(), _clients()
    kw = dict(seed=3, round_idx=1)
    ser = train_clients(model, data, clients, _start(model), cfg, backend="serial", **kw)
    bat = train_clients(model, data, clients, _start(model), cfg, backend="batched", conv_strategy=strategy, **kw)
    assert ser.steps == bat.steps == [cfg.epochs * ((len(c) + cfg.batch_size - 1) // cfg.batch_size) for c in clients]
    for ps, pb in zip(ser.params, bat.params):
        for n in ps:
            torch.testing.assert_close(pb[n], ps[n], rtol=1e-4, atol=1e-5)
    # training actually moved the weights
    assert any((ser.params[0][n] - _start(model)[n]).abs().max() > 1e-3 for n in ser.params[0])


def test_serial_equals_batched_with_terms_and_augmentation():
    class Flip:  # deterministic-from-generator augmentation stand-in
        def __call__(self, x, gen):
            m = torch.rand(x.shape[0], generator=gen) < 0.5
            return torch.where(m.view(-1, 1, 1, 1), x.flip(-1), x)

    torch.manual_seed(1)
    model = TinyCNN(bias=False)
    start = _start(model)
    anchor = {n: t + 0.1 for n, t in start.items()}
    k = 3
    client_ctx = [{"linear": {n: torch.randn_like(t) * 0.01 for n, t in start.items()},
                   "prior_precision": {n: torch.rand_like(t) for n, t in start.items()}} for _ in range(k)]
    obj = LocalObjective(terms=[ProximalTerm(0.1), LinearTerm(1.0), QuadraticPriorTerm(0.5)],
                         shared_ctx={"anchor": anchor, "prior_mean": anchor}, client_ctx=client_ctx)
    cfg = LocalTrainConfig(lr=0.05, momentum=0.5, batch_size=8, epochs=2)
    data = _data(augment=Flip())
    ser = train_clients(model, data, _clients(), start, cfg, objective=obj, backend="serial")
    bat = train_clients(model, data, _clients(), start, cfg, objective=obj, backend="batched", conv_strategy="unfold")
    for ps, pb in zip(ser.params, bat.params):
        for n in ps:
            torch.testing.assert_close(pb[n], ps[n], rtol=1e-4, atol=1e-5)
    # the terms matter: without them the result differs
    plain = train_clients(model, data, _clients(), start, cfg, backend="serial")
    assert max((plain.params[0][n] - ser.params[0][n]).abs().max() for n in start) > 1e-4


@pytest.mark.parametrize("opt", [dict(optimizer="sgd", lr=0.05, momentum=0.9, batch_size=8, epochs=2),
                                 dict(optimizer="adam", lr=0.01, batch_size=8, epochs=2)])
@pytest.mark.parametrize("with_terms", [False, True])
def test_client_without_data_stays_finite_and_backends_agree(opt, with_terms):
    # a 100-client size-then-class Dirichlet split can leave a client empty (FedLap Table 1, FMNIST, seed 1);
    # the batched engine once turned that client's weights into NaN (0/0 loss), which poisoned the server's average
    torch.manual_seed(2)
    model = TinyCNN(bias=False)
    start = _start(model)
    clients = [torch.arange(0, 23), torch.arange(0, 0), torch.arange(30, 70)]
    obj = None
    if with_terms:
        obj = LocalObjective(terms=[ProximalTerm(0.1)], shared_ctx={"anchor": {n: t + 0.1 for n, t in start.items()}})
    cfg = LocalTrainConfig(**opt)
    ser = train_clients(model, _data(), clients, start, cfg, objective=obj, backend="serial")
    bat = train_clients(model, _data(), clients, start, cfg, objective=obj, backend="batched", conv_strategy="unfold")
    assert ser.steps == bat.steps
    for ps, pb in zip(ser.params, bat.params):
        for n in ps:
            assert torch.isfinite(pb[n]).all()
            torch.testing.assert_close(pb[n], ps[n], rtol=1e-4, atol=1e-5)
    # without a term the empty client's gradient is zero, so it returns its start exactly; with one it moves
    moved = max((bat.params[1][n] - start[n]).abs().max() for n in start)
    assert (moved > 1e-4) if with_terms else (moved == 0)


def test_serial_matches_plain_torch_loop():
    """The serial backend is an ordinary SGD loop: reproduce one client by hand."""
    from fedbench.train.engine import client_generator, epoch_batches

    torch.manual_seed(2)
    model = TinyCNN()
    data, idx = _data(), torch.arange(0, 23)
    cfg = LocalTrainConfig(lr=0.05, momentum=0.9, batch_size=8, epochs=2)
    res = train_clients(model, data, [idx], _start(model), cfg, seed=5, round_idx=0, client_ids=[4])
    ref = TinyCNN()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    gen = client_generator(5, 0, 4)
    for _ in range(2):
        for b in epoch_batches(23, 8, gen, False):
            loss = nn.functional.cross_entropy(ref(data.inputs(idx[b])), data.y[idx[b]])
            opt.zero_grad()
            loss.backward()
            opt.step()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(res.params[0][n], p.detach())


def test_zero_epochs_returns_start():
    model = TinyCNN()
    cfg = LocalTrainConfig(epochs=0)
    res = train_clients(model, _data(), _clients(), _start(model), cfg, backend="batched")
    for p in res.params:
        for n, t in _start(model).items():
            assert torch.equal(p[n], t)
    assert res.steps == [0, 0, 0]


def test_stacked_model_matches_per_client_forward():
    torch.manual_seed(0)
    model = TinyCNN()
    k, b = 4, 5
    weights = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(k)]
    x = torch.randn(k * b, 1, 8, 8)
    stacked = {n: torch.stack([w[n] for w in weights]) for n in weights[0]}
    for strat in CONV_STRATEGIES:
        out = StackedModel(model, strat)(stacked, x)
        ref = torch.cat([torch.func.functional_call(model, w, (x[i * b:(i + 1) * b],)) for i, w in enumerate(weights)])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_bad_backend_and_config():
    with pytest.raises(FedbenchError, match="backend"):
        train_clients(TinyCNN(), _data(), _clients(), _start(TinyCNN()), LocalTrainConfig(), backend="gpu-magic")
    with pytest.raises(FedbenchError, match="lr"):
        LocalTrainConfig.from_cfg({"lr": 0})
    with pytest.raises(FedbenchError, match="unknown local-training key"):
        LocalTrainConfig.from_cfg({"learning_rate": 0.1})


def test_unstackable_layer_rejected():
    class WithBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)
            self.bn = nn.BatchNorm1d(2)

        def forward(self, x):
            return self.bn(self.fc(x))

    with pytest.raises(FedbenchError, match="serial"):
        StackedModel(WithBN())


def test_real_augment_pixels_and_backends_agree():
    """Augmentation acts on [0,1] pixels before normalisation (zero padding = black pixels)."""
    from fedbench.data.transforms import Augment

    aug = Augment(crop_padding=2, pad_mode="zero", flip=True, per="sample")
    torch.manual_seed(3)
    model = TinyCNN()
    data = _data(augment=aug)
    cfg = LocalTrainConfig(lr=0.05, momentum=0.9, batch_size=8, epochs=2)
    ser = train_clients(model, data, _clients(), _start(model), cfg, backend="serial")
    bat = train_clients(model, data, _clients(), _start(model), cfg, backend="batched", conv_strategy="loop")
    for ps, pb in zip(ser.params, bat.params):
        for n in ps:
            torch.testing.assert_close(pb[n], ps[n], rtol=1e-4, atol=1e-5)
    g = torch.Generator().manual_seed(0)
    x = aug(torch.ones(64, 1, 8, 8), g)
    assert x.min() == 0.0  # padding pixels are black before Normalize, like torchvision's RandomCrop


@pytest.mark.parametrize("opt", [
    dict(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=8, epochs=3),
    dict(optimizer="adam", lr=0.01, batch_size=8, epochs=2, clip_grad_norm=0.5),
])
def test_channels_last_serial_matches_contiguous(opt):
    """hardware.memory_format=channels_last changes only the convolution kernels: same steps, same losses
    and weights to float rounding (the serial/batched tolerance), returned in the standard layout."""
    torch.manual_seed(0)
    model = TinyCNN()
    cfg = LocalTrainConfig(**opt)
    kw = dict(seed=3, round_idx=1, backend="serial")
    ref = train_clients(model, _data(), _clients(), _start(model), cfg, **kw)
    nhwc = train_clients(model, _data(), _clients(), _start(model), cfg, memory_format="channels_last", **kw)
    assert nhwc.steps == ref.steps
    assert nhwc.mean_loss == pytest.approx(ref.mean_loss, rel=1e-5)
    for pr, pc in zip(ref.params, nhwc.params):
        for n in pr:
            assert pc[n].is_contiguous()
            torch.testing.assert_close(pc[n], pr[n], rtol=1e-4, atol=1e-5)
    assert all(p.is_contiguous() for p in model.parameters())   # the caller's model is untouched


def test_bad_memory_format():
    model = TinyCNN()
    with pytest.raises(FedbenchError, match="memory format"):
        train_clients(model, _data(), _clients(), _start(model), LocalTrainConfig(), memory_format="nhwc")


class _Killer:
    """A progress bar that ends the process's training (as a session's end would) after ``after`` trained epochs,
    and counts the epochs trained (update(1)) apart from the clients taken from the store (update(epochs))."""

    def __init__(self, after=None):
        self.after, self.trained, self.restored = after, 0, 0

    def update(self, n):
        if n != 1:
            self.restored += 1
            return
        self.trained += 1
        if self.after is not None and self.trained >= self.after:
            raise KeyboardInterrupt


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_killed_stage_goes_on_from_its_finished_clients_bit_for_bit(tmp_path, channels_last):
    """train_clients(finished=...): killed in the third client, the successor takes clients 0-1 from the store and
    trains only client 2; weights, steps, losses and the snapshots equal one uninterrupted training's bit for bit."""
    from fedbench.fl.cache import ClientProgress
    torch.manual_seed(0)
    model = TinyCNN()
    cfg = LocalTrainConfig(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=8, epochs=3)
    data, clients = _data(), _clients()
    kw = dict(seed=3, round_idx=1, snapshot_epochs=[1], memory_format="channels_last" if channels_last else "contiguous")
    ref = train_clients(model, data, clients, _start(model), cfg, **kw)
    store = tmp_path / "stage.clients"
    with pytest.raises(KeyboardInterrupt):
        train_clients(model, data, clients, _start(model), cfg, progress=_Killer(after=2 * cfg.epochs + 1),
                      finished=ClientProgress(store), **kw)
    assert sorted(p.name for p in store.glob("*.pt")) == ["0.pt", "1.pt"]
    bar = _Killer()
    out = train_clients(model, data, clients, _start(model), cfg, progress=bar, finished=ClientProgress(store), **kw)
    assert (bar.restored, bar.trained) == (2, cfg.epochs)   # only the third client trained again
    assert out.steps == ref.steps and out.mean_loss == ref.mean_loss
    for got, want in zip(out.params + out.snapshots[1].params, ref.params + ref.snapshots[1].params):
        assert all(torch.equal(got[n], want[n]) for n in want)
    assert out.snapshots[1].steps == ref.snapshots[1].steps and out.snapshots[1].mean_loss == ref.snapshots[1].mean_loss
    # a store made with another setting (here another seed) is not used: every client trains again
    bar = _Killer()
    train_clients(model, data, clients, _start(model), cfg, progress=bar, finished=ClientProgress(store),
                  **{**kw, "seed": 4})
    assert (bar.restored, bar.trained) == (0, 3 * cfg.epochs)


def test_the_store_is_not_used_with_hooks_or_dropout(tmp_path):
    """Step hooks keep per-client state, dropout draws from the global generator: a client taken from the store
    would change what follows, so neither writes to it."""
    from fedbench.fl.cache import ClientProgress
    torch.manual_seed(0)
    cfg = LocalTrainConfig(optimizer="sgd", lr=0.05, batch_size=8, epochs=1)
    data, clients = _data(), _clients()
    dropout = nn.Sequential(TinyCNN(), nn.Dropout(0.5))
    train_clients(dropout, data, clients, _start(dropout), cfg, finished=ClientProgress(tmp_path / "a"))
    assert not (tmp_path / "a").exists()

    class Hook:
        def after_step(self, client_ids):
            return None
    model = TinyCNN()
    train_clients(model, data, clients, _start(model), cfg, objective=LocalObjective(step_hooks=[Hook()]),
                  finished=ClientProgress(tmp_path / "b"))
    assert not (tmp_path / "b").exists()
    train_clients(model, data, clients, _start(model), cfg, finished=ClientProgress(tmp_path / "c"))
    assert len(list((tmp_path / "c").glob("*.pt"))) == 3
