"""OTFusion and PFNM (notes/fedfisher.md §2, fedbens.md §2): permutation recovery, closed forms, widths,
evaluation of the wider PFNM model through the template, run.py end to end, bad configs."""
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn

from fedbench.algorithms import otfusion as O
from fedbench.algorithms import pfnm as P
from fedbench.algorithms.base import ALGORITHMS, Message, weighted_average
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup
from fedbench.models import build_model
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData
from tests.test_run import SMALL, records, run


def _mlp(bias=True, seed=0, scale=1.0):
    torch.manual_seed(seed)
    m = build_model("mlp", input_shape=(6,), num_classes=3, hidden=(5, 4), bias=bias)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return m


def _cnn(bias=False, seed=0, scale=1.0):
    torch.manual_seed(seed)
    m = build_model("lenet", input_shape=(1, 28, 28), num_classes=10, channels=(3, 4), hidden=(6, 5), bias=bias)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return m


def _params(m):
    return {n: p.detach().clone().double() for n, p in m.named_parameters()}


def _permute(params, layers, seed):
    """The same function with every hidden layer's units permuted (rows out, matching inputs of the next)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(params)
    for k, L in enumerate(layers[:-1]):
        perm = torch.randperm(L.out_units, generator=g)
        out[L.weight] = out[L.weight][perm]
        if L.bias:
            out[L.bias] = out[L.bias][perm]
        nxt = layers[k + 1]
        W = out[nxt.weight]
        out[nxt.weight] = W.reshape(W.shape[0], nxt.in_units, nxt.block)[:, perm].reshape(W.shape)
    return out


def _f(model, params, x):
    return torch.func.functional_call(model.double(), params, (x,))


def _setup(model, sizes=(20, 30, 10), val=True, num_classes=3, shape=(6,)):
    g = torch.Generator().manual_seed(1)
    n = sum(sizes)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    train = TrainData(x, y)
    idx, s = [], 0
    for k in sizes:
        idx.append(torch.arange(s, s + k))
        s += k
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx,
                   local=LocalTrainConfig(lr=0.1, batch_size=8, epochs=1), seed=0, device=torch.device("cpu"),
                   server_val=(x[:20], y[:20]) if val else None)


# ------------------------------------------------------------------------------------------------
# OTFusion
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [_mlp, _cnn])
def test_otfusion_recovers_permuted_copy(make):
    model = make(bias=True, scale=3.0)
    layers = O.layer_chain(model, "otfusion")
    B = _params(model)
    A = _permute(B, layers, seed=5)
    assert not torch.equal(A[layers[0].weight], B[layers[0].weight])
    stats = {}
    out = O.align_to(A, B, layers, correction=True, past_correction=True, stats=stats)
    # the plans moved exactly the units the permutation moved (same draws as _permute); classes stay in place
    g = torch.Generator().manual_seed(5)
    perms = [torch.randperm(L.out_units, generator=g) for L in layers[:-1]]
    assert stats["units"] == sum(L.out_units for L in layers)
    assert stats["moved"] == sum(int((q != torch.arange(len(q))).sum()) for q in perms) > 0
    # correction multiplies T by 1/(1/n + 1e-7): c_k = 1/(1 + n_k 1e-7) per transported layer
    c = [1.0 / (1.0 + L.out_units * 1e-7) for L in layers]
    for k, L in enumerate(layers):
        f = c[k] * (c[k - 1] if k else 1.0)
        torch.testing.assert_close(out[L.weight], f * B[L.weight], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[L.bias], c[k] * B[L.bias], rtol=1e-12, atol=1e-12)
    # without past_correction the code leaves the input side unpermuted: not the pivot any more
    bad = O.align_to(A, B, layers, correction=True, past_correction=False)
    assert not torch.allclose(bad[layers[1].weight], B[layers[1].weight], atol=1e-3)


def test_otfusion_identity_alignment_is_fedavg_and_identical_clients_return_the_model():
    model = _mlp(scale=3.0)
    layers = O.layer_chain(model, "otfusion")
    B = _params(model)
    g = torch.Generator().manual_seed(3)
    clients = [B] + [{n: t + 1e-3 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in B.items()}
                     for _ in range(2)]
    p = [0.5, 0.3, 0.2]
    fused = O.otfusion(clients, p, layers, correction=True, past_correction=True)
    avg = weighted_average(clients, p)
    for n in avg:
        torch.testing.assert_close(fused[n], avg[n], rtol=2e-6, atol=1e-9)
    # correction=False keeps T = 1/n: every transported layer shrinks by 1/n_k (the code's scaling quirk)
    raw = O.align_to(clients[1], B, layers, correction=False, past_correction=False)
    torch.testing.assert_close(raw[layers[0].weight], clients[1][layers[0].weight] / layers[0].out_units)

    setup = _setup(model.float())
    algo = ALGORITHMS.get("otfusion")({}, setup)
    B = {n: t.float() for n, t in B.items()}
    msgs = [Message(i, n, {"params": B}) for i, n in enumerate((20, 30, 10))]
    state = algo.aggregate(msgs, {"params": B}, 1)
    assert state["otfusion_choice"] == {"correction": True, "past_correction": True}
    assert len(state["otfusion_trace"]) == 4
    # identical clients: every plan is the identity, and the record says so
    assert state["extra_metrics"] == {"correction": 1.0, "past_correction": 1.0, "units_moved_fraction": 0.0}
    for n in B:
        torch.testing.assert_close(state["params"][n], B[n], rtol=1e-5, atol=1e-9)


def test_otfusion_keeps_class_rows_by_default_and_the_released_switch_transports_them():
    # client 1 = the pivot with the output rows of classes 0 and 1 swapped (as under label skew, where a client's
    # rows of unseen classes are interchangeable): the released plan swaps them back, the default leaves classes be
    model = _mlp(scale=3.0)
    B = {n: t.float() for n, t in _params(model).items()}
    last = O.layer_chain(model, "otfusion")[-1]
    swap = torch.tensor([1, 0, 2])
    S = {**B, last.weight: B[last.weight][swap], last.bias: B[last.bias][swap]}
    setup = _setup(model.float())
    msgs = [Message(0, 20, {"params": B}), Message(1, 20, {"params": S})]
    default = ALGORITHMS.get("otfusion")({"correction": True, "past_correction": True}, setup).aggregate(msgs, {}, 1)
    avg = weighted_average([B, S], [0.5, 0.5])
    for n in B:
        torch.testing.assert_close(default["params"][n], avg[n], rtol=1e-5, atol=1e-7)
    assert default["extra_metrics"]["units_moved_fraction"] == 0.0
    released = ALGORITHMS.get("otfusion")({"correction": True, "past_correction": True, "align_last_layer": True},
                                         setup).aggregate(msgs, {}, 1)
    torch.testing.assert_close(released["params"][last.weight], B[last.weight], rtol=1e-5, atol=1e-6)
    units = sum(L.out_units for L in O.layer_chain(model, "otfusion"))
    assert released["extra_metrics"]["units_moved_fraction"] == pytest.approx(2 / units)


def test_otfusion_ground_metric_changes_the_plan():
    # 1-d neurons: x = (0, 3), y = (1, 2): the plans (0->1, 3->2) cost 2 (sq) / 2 (abs); (0->2, 3->1): 8 / 4.
    # squared picks the identity uniquely; with |.| both cost 2 vs 4 -> identity too; use y = (2.9, 0.1+...)
    X = torch.tensor([[0.0], [3.0]], dtype=torch.float64)
    Y = torch.tensor([[1.4], [1.6]], dtype=torch.float64)
    sq = O.pairwise_cost(X, Y, True)
    eu = O.pairwise_cost(X, Y, False)
    torch.testing.assert_close(sq, torch.tensor([[1.96, 2.56], [2.56, 1.96]], dtype=torch.float64))
    torch.testing.assert_close(eu, sq.sqrt())


# ------------------------------------------------------------------------------------------------
# PFNM
# ------------------------------------------------------------------------------------------------
def _expected_shrunk(params, layers, J, mu0=0.1, sigma=1.0, sigma0=1.0):
    """PFNM's MAP for J identical clients: hidden rows (μ0/σ0 + J·w/σ)/(1/σ0 + J/σ) (weights: μ0 = 0),
    output layer as is (class-weighted average of identical rows)."""
    f = (J / sigma) / (1 / sigma0 + J / sigma)
    out = {}
    for L in layers[:-1]:
        out[L.weight] = f * params[L.weight]
        b = params[L.bias] if L.bias else torch.zeros(L.out_units, dtype=torch.float64)
        out[L.bias or f"{L.module}.bias"] = f * b + (mu0 / sigma0) / (1 / sigma0 + J / sigma)
    L = layers[-1]
    out[L.weight] = params[L.weight]
    out[L.bias or f"{L.module}.bias"] = params[L.bias] if L.bias else torch.zeros(L.out_units, dtype=torch.float64)
    return out


@pytest.mark.parametrize("make,shape", [(_mlp, (6,)), (_cnn, (1, 28, 28))])
def test_pfnm_identical_and_permuted_clients(make, shape):
    model = make(bias=False, scale=10.0)
    layers = O.layer_chain(model, "pfnm")
    B = _params(model)
    J = 3
    counts = np.array([[5] * layers[-1].out_units] * J)
    x = torch.randn(7, *shape, dtype=torch.float64)
    ref = _f(model, B, x)
    # identical clients: the matched model is the client (up to neuron order) with the MAP shrinkage;
    # a sharp likelihood (σ = 1e-3) makes that shrinkage negligible
    out, widths = P.pfnm([B] * J, counts, layers, sigma=1e-3)
    assert widths == [L.out_units for L in layers[:-1]]
    torch.testing.assert_close(_f(model, out, x), _f(model, _expected_shrunk(B, layers, J, sigma=1e-3), x))
    torch.testing.assert_close(_f(model, out, x), ref, rtol=2e-3, atol=1e-3 * float(ref.abs().max()))
    # the papers' σ = σ0 = 1 shrinks every hidden neuron to (J w + μ0)/(J + 1); permuted copies match the same way
    clients = [B, _permute(B, layers, 1), _permute(B, layers, 2)]
    out, widths = P.pfnm(clients, counts, layers)
    assert widths == [L.out_units for L in layers[:-1]]
    torch.testing.assert_close(_f(model, out, x), _f(model, _expected_shrunk(B, layers, J), x))


def test_pfnm_output_layer_is_class_count_weighted():
    model = _mlp(bias=True, scale=10.0)
    layers = O.layer_chain(model, "pfnm")
    B = _params(model)
    C = _params(_mlp(bias=True, scale=10.0, seed=0))
    C[layers[-1].weight] = C[layers[-1].weight] + 1.0     # same hidden layers, different output layer
    counts = np.array([[3, 0, 1], [1, 2, 0]])
    out, widths = P.pfnm([B, C], counts, layers, sigma=1e-6, mu0_bias=0.0)
    assert widths == [5, 4]
    a = np.array([[0.75, 0.0, 1.0], [0.25, 1.0, 0.0]])
    W = torch.from_numpy(a[0])[:, None] * B[layers[-1].weight] + torch.from_numpy(a[1])[:, None] * C[layers[-1].weight]
    x = torch.randn(5, 6, dtype=torch.float64)
    trunk = nn.Sequential(OrderedDict(list(model.named_children())[:-1])).double()
    hb = _f(trunk, {k: v for k, v in B.items() if not k.startswith("fc3")}, x)
    # the hidden layers are B's (up to order); the logits use the class-weighted output rows
    b = torch.from_numpy(a[0]) * B["fc3.bias"] + torch.from_numpy(a[1]) * C["fc3.bias"]
    torch.testing.assert_close(_f(model, out, x), hb @ W.t() + b, rtol=1e-5, atol=1e-5)


def test_pfnm_wider_global_model_evaluates_through_template():
    template = _cnn(bias=False)
    layers = O.layer_chain(template, "pfnm")
    clients = [_params(_cnn(bias=False, seed=s, scale=2.0)) for s in range(3)]
    counts = np.array([[2] * 10, [1] * 10, [3] * 10])
    out, widths = P.pfnm(clients, counts, layers)
    assert all(w >= L.out_units for w, L in zip(widths, layers[:-1])) and sum(widths) > sum(
        L.out_units for L in layers[:-1])
    wide = build_model("lenet", input_shape=(1, 28, 28), num_classes=10, channels=tuple(widths[:2]),
                       hidden=tuple(widths[2:]), bias=True).double()
    wide.load_state_dict({k: v for k, v in out.items()})
    x = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(_f(template, out, x), wide(x))


def test_pfnm_algorithm_messages_and_one_shot_only():
    model = _mlp(bias=True, scale=10.0)
    setup = _setup(model)
    algo = ALGORITHMS.get("pfnm")({}, setup)
    B = _params(model)
    res = type("R", (), {"steps": [1, 1, 1], "mean_loss": [0.0, 0.0, 0.0]})()
    msgs = [algo.client_message(i, B, res, i, {"params": B}, 1, {}) for i in range(3)]
    assert msgs[0].nbytes == sum(t.numel() * 8 for t in B.values()) + 3 * 8     # weights + int64 class counts
    assert int(msgs[1].payload["class_counts"].sum()) == 30
    state = algo.aggregate(msgs, {"params": B}, 1)
    assert state["pfnm_widths"] == [5, 4]
    with pytest.raises(FedbenchError, match="one-shot"):
        algo.start_params(state, [0, 1, 2])


# ------------------------------------------------------------------------------------------------
# configuration errors (before training)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,cfg,needle", [
    ("otfusion", {"correction": "maybe"}, "correction"),
    ("otfusion", {"ground_metric": "cosine"}, "ground_metric"),
    ("otfusion", {"pivot": 9}, "pivot"),
    ("otfusion", {"typo": 1}, "unknown"),
    ("pfnm", {"gamma": -1}, "gamma"),
    ("pfnm", {"prior_bias_slot": "x"}, "prior_bias_slot"),
])
def test_bad_config(name, cfg, needle):
    with pytest.raises(FedbenchError, match=needle):
        ALGORITHMS.get(name)(cfg, _setup(_mlp()))


def test_needs_server_val_and_supported_models():
    with pytest.raises(FedbenchError, match="server validation"):
        ALGORITHMS.get("otfusion")({}, _setup(_mlp(), val=False))
    ALGORITHMS.get("otfusion")({"correction": True, "past_correction": True}, _setup(_mlp(), val=False))
    bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    for name in ("otfusion", "pfnm"):
        with pytest.raises(FedbenchError, match="BatchNorm1d"):
            ALGORITHMS.get(name)({}, _setup(bn))


# ------------------------------------------------------------------------------------------------
# run.py end to end
# ------------------------------------------------------------------------------------------------
def test_run_py_fedavg_otfusion_pfnm(tmp_path):
    run(SMALL + ["rounds=1", "server_val.size=50", "aggregators=[fedavg,otfusion,pfnm]"], tmp_path)
    recs = {r["algorithm"]: r for r in (json.loads(p.read_text()) for p in records(tmp_path))}
    assert sorted(recs) == ["fedavg", "otfusion", "pfnm"]
    for r in recs.values():
        assert r["status"] == "ok" and 0 <= r["metrics"]["accuracy"] <= 100
    up = recs["fedavg"]["communication"]["uplink_bytes"]
    assert recs["otfusion"]["communication"]["uplink_bytes"] == up
    assert recs["pfnm"]["communication"]["uplink_bytes"] == up + 3 * 10 * 8
    assert recs["otfusion"]["cache"]["hits"] >= 1 and recs["pfnm"]["cache"]["hits"] >= 1
    p = run(SMALL + ["rounds=1", "algorithm=otfusion"], tmp_path / "b", expect=2)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and "server validation" in lines[0]


def test_pfnm_released_prior_slot_moves_mu0_to_first_input_column():
    model = _mlp(bias=True, scale=10.0)
    layers = O.layer_chain(model, "pfnm")
    B = _params(model)
    J = 2
    counts = np.ones((J, 3))
    out, _ = P.pfnm([B] * J, counts, layers, prior_bias_slot="first_column")
    exp = _expected_shrunk(B, layers, J)
    # layer 1 keeps μ0 on the bias; layer 2 (global order = the first client's) has it on input column 0
    L2 = layers[1]
    exp[L2.weight] = exp[L2.weight].clone()
    exp[L2.weight][:, 0] += 0.1 / (J + 1)
    exp[L2.bias] = J * B[L2.bias] / (J + 1)
    for n in exp:
        torch.testing.assert_close(out[n], exp[n])


# ------------------------------------------------------------------------------------------------
# OTFusion on residual networks (FedFisher Table 3, FedBEns Table 9)
# ------------------------------------------------------------------------------------------------
def _tiny_resnet(seed=0, head=(), head_names=None):
    from fedbench.models.resnet import ResNet18NoBN

    torch.manual_seed(seed)
    return ResNet18NoBN((3, 32, 32), 5, stem="mod7", head=head, head_names=head_names, blocks=(2, 1, 2, 1),
                        widths=(4, 6, 6, 8)).double()


def _permute_spaces(params, layers, seed):
    """``params`` with every transport space's units permuted (the output space too); outputs then permute."""
    g = torch.Generator().manual_seed(seed)
    spaces = {L.out_space: L.out_units for L in layers}
    perm = {s: torch.randperm(n, generator=g) for s, n in spaces.items()}
    out = dict(params)
    for L in layers:
        W = rows(params[L.weight], L)[perm[L.out_space]]
        if L.in_space is not None:
            W = W[:, perm[L.in_space]]
        out[L.weight] = W.reshape(L.shape)
    return out, perm[layers[-1].out_space]


def rows(W, L):
    return O.rows(W, L)


def test_resnet_layout_ties_the_residual_streams():
    layers = O.fusion_layers(_tiny_resnet(), "otfusion", "tiny")
    by = {L.module: L for L in layers}
    # identity shortcut: conv2 writes the block input's space and inherits its transport
    assert by["layer1.0.conv2"].out_space == by["conv1"].out_space == by["layer2.0.conv1"].in_space
    assert not by["layer1.0.conv2"].solves and not by["layer1.1.conv2"].solves
    # downsampling block: conv2 and the 1x1 shortcut write one new space, the shortcut reads the block input's
    assert by["layer2.0.conv2"].out_space == by["layer2.0.shortcut.0"].out_space != by["conv1"].out_space
    assert by["layer2.0.shortcut.0"].in_space == by["conv1"].out_space
    assert by["layer2.0.conv2"].solves and by["layer2.0.shortcut.0"].solves
    assert by["linear"].in_space == by["layer4.0.conv2"].out_space and by["linear"].block == 1
    assert len({L.out_space for L in layers}) == 1 + 6 + 3 + 1   # stem, 6 conv1s, 3 downsampling streams, head


@pytest.mark.parametrize("head,names", [((), None), ((7, 6), ("fc", "linear", "final"))])
def test_resnet_hard_plan_permutation_keeps_the_function(head, names):
    """(a) a model permuted by the plans found against another model computes the same function (eps = 0 and
    correction: the plans are exact permutation matrices); the plans do move units."""
    A = _tiny_resnet(seed=1, head=head, head_names=names)
    B = _tiny_resnet(seed=2, head=head, head_names=names)
    layers = O.fusion_layers(A, "otfusion")
    pa, pb = _params(A), _params(B)
    stats = {}
    moved = O.align_to(pa, pb, layers, correction=True, past_correction=True, eps=0.0, align_last=False, stats=stats)
    assert stats["moved"] > 0
    assert any(not torch.equal(moved[n], pa[n]) for n in pa)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(_f(A, moved, x), _f(A, pa, x), rtol=1e-5, atol=1e-5)
    # the ties are what keeps it: a block's conv2 solving its own plan instead of inheriting the stream's breaks it
    broken = [L if L.module != "layer1.0.conv2" else O.Layer(**{**L.__dict__, "out_space": 99, "solves": True})
              for L in layers]
    bad = O.align_to(pa, pb, broken, correction=True, past_correction=True, eps=0.0, align_last=False)
    ref = _f(A, pa, x)
    assert (_f(A, bad, x) - ref).abs().max() > 1e-2 * ref.abs().max()


def test_resnet_fusing_a_permuted_copy_gives_back_the_model():
    """(b) pivot B and a copy with every space permuted (a different function only up to the class order): the
    aligned copy is B (weights), and the fused model computes B's function."""
    model = _tiny_resnet(seed=3)
    layers = O.fusion_layers(model, "otfusion")
    B = _params(model)
    A, class_perm = _permute_spaces(B, layers, seed=7)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(_f(model, A, x), _f(model, B, x)[:, class_perm])   # the test's permutation is exact
    aligned = O.align_to(A, B, layers, correction=True, past_correction=True, eps=0.0, align_last=True)
    for n in B:
        torch.testing.assert_close(aligned[n], B[n], rtol=1e-12, atol=1e-12)
    fused = O.otfusion([B, A], [0.4, 0.6], layers, correction=True, past_correction=True, align_last=True)
    torch.testing.assert_close(_f(model, fused, x), _f(model, B, x), rtol=1e-5, atol=1e-5 * float(_f(model, B, x).abs().max()))


def _real_resnet_fusion(name, cfg):
    torch.manual_seed(0)
    model = build_model(name, input_shape=(3, 32, 32), num_classes=10)
    setup = _setup(model, sizes=(3, 3), num_classes=10, shape=(3, 32, 32))
    setup.stage_parts = {"model": {"name": name}}
    algo = ALGORITHMS.get("otfusion")(cfg, setup)
    B = {n: p.detach().clone() for n, p in model.named_parameters()}
    A, _ = _permute_spaces(B, algo.layers, seed=1)
    state = algo.aggregate([Message(0, 3, {"params": B}), Message(1, 3, {"params": A})], {"params": B}, 1)
    x = setup.server_val[0][:2]
    return state, torch.func.functional_call(model, state["params"], (x,)), torch.func.functional_call(model, B, (x,))


def test_otfusion_real_resnet18_end_to_end():
    """The registered resnet18_mod (FedFisher Table 3) through the algorithm on tiny synthetic data: two clients, one
    a copy of the pivot with every space permuted; the released flags give back the pivot's function."""
    state, out, ref = _real_resnet_fusion("resnet18_mod", {"align_last_layer": True, "correction": True,
                                                           "past_correction": True})
    assert 0.9 < state["extra_metrics"]["units_moved_fraction"] <= 1    # (nearly) every unit was moved back
    assert out.shape == (2, 10)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.slow
def test_otfusion_real_resnet18_nobn_validation_grid():
    """resnet18_nobn (FedBEns Table 9) with the 4-setting validation grid (4 fusions of 11M weights: ~1 min on CPU)."""
    state, out, ref = _real_resnet_fusion("resnet18_nobn", {"align_last_layer": True})
    assert len(state["otfusion_trace"]) == 4 and torch.isfinite(out).all()
    if state["otfusion_choice"] == {"correction": True, "past_correction": True}:
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("name", ["resnet18_nobn", "resnet18_mod", "resnet18_tiny"])
def test_pfnm_refuses_resnets_in_one_line_naming_the_model(name):
    torch.manual_seed(0)
    model = build_model(name, input_shape=(3, 32, 32), num_classes=10)
    setup = _setup(model, sizes=(2, 2), num_classes=10, shape=(3, 32, 32))
    setup.stage_parts = {"model": {"name": name}}
    with pytest.raises(FedbenchError) as e:
        ALGORITHMS.get("pfnm")({}, setup)
    msg = str(e.value)
    assert "\n" not in msg and f"pfnm on model '{name}'" in msg and "skip connections" in msg and "lenet" in msg
    ALGORITHMS.get("otfusion")({}, setup)   # OTFusion takes the same model
