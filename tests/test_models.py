"""Model zoo: exact parameter counts from the papers, shapes, the batched-engine contract, configs."""
from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from fedbench.errors import FedbenchError
from fedbench.models import MODELS, build_model, count_parameters

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"

# name, input_shape, num_classes, kwargs, parameter count stated in the notes
COUNTS = [
    ("simple_cnn", (1, 28, 28), 10, {}, 44_426),          # fedlpa.md §3, MNIST/FMNIST variant
    ("simple_cnn", (3, 32, 32), 10, {}, 62_006),          # fedlpa.md §3, CIFAR-10/SVHN variant
    ("lenet", (1, 28, 28), 10, {}, 44_190),               # fedfisher.md §3.3, fedbens.md §3.4
    ("fedma_cnn", (3, 32, 32), 10, {}, 939_616),          # fedfisher.md §3.3, fedbens.md §3.4
    ("mlp_500_300", (1, 28, 28), 10, {}, 545_810),        # fola.md §3.2
    ("mlp", (784,), 10, {"hidden": [500, 300]}, 545_810),
    ("mlp_200_100", (1, 28, 28), 10, {}, 178_110),        # fedlap.md §3.2
    ("mlp", (1, 28, 28), 10, {"hidden": [200, 100]}, 178_110),
    ("softmax_regression", (1, 28, 28), 10, {}, 7_850),   # fola.md §3.2
    ("logistic_regression", (46,), 2, {}, 47),            # fedlap.md §3.2, UCI Credit
    ("logistic_regression", (13,), 2, {}, 14),            # fedlap.md §3.2, FLamby-Heart
    ("fola_cnn", (3, 32, 32), 10, {}, 878_538),           # fola.md §3.2
    ("cifarnet", (3, 32, 32), 10, {}, 1_250_858),         # fedlap.md §3.2
    ("cifarnet", (3, 32, 32), 10, {"dropout": False}, 1_250_858),
    ("resnet18_nobn", (3, 32, 32), 100, {}, 11_210_432),  # fedbens.md §3.4
    ("resnet18_mod", (3, 32, 32), 10, {}, 11_880_912),    # fedfisher.md §1.6 worked numbers
    ("resnet18_tiny", (3, 32, 32), 200, {}, 11_880_912 - 200 * 10),   # resnet18_mod without its final 200->10
    ("two_layer_relu", (2,), 0, {"width": 512}, 1_024),   # fedfisher.md §1.8: d = 2m
]

SMALL = [c for c in COUNTS if not c[0].startswith("resnet")]
BIAS_FREE = ["lenet", "fedma_cnn", "resnet18_nobn", "resnet18_mod", "resnet18_tiny", "two_layer_relu"]
FITS = {  # a data shape each registered model accepts
    "simple_cnn": ((3, 32, 32), 10), "lenet": ((1, 28, 28), 10), "fedma_cnn": ((3, 32, 32), 10),
    "mlp": ((1, 28, 28), 10), "mlp_500_300": ((1, 28, 28), 10), "mlp_200_100": ((784,), 10),
    "softmax_regression": ((1, 28, 28), 10), "logistic_regression": ((46,), 2), "fola_cnn": ((3, 32, 32), 10),
    "cifarnet": ((3, 32, 32), 10), "resnet18_nobn": ((3, 32, 32), 100), "resnet18_mod": ((3, 32, 32), 10),
    "resnet18_tiny": ((3, 32, 32), 200), "two_layer_relu": ((2,), 0),
}


@functools.lru_cache(maxsize=None)
def _resnet(name: str, num_classes: int) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, input_shape=(3, 32, 32), num_classes=num_classes)


def _build(name, shape, nc, kw=None):
    if name.startswith("resnet") and not kw:
        return _resnet(name, nc)
    return build_model(name, input_shape=shape, num_classes=nc, **(kw or {}))


@pytest.mark.parametrize("name,shape,nc,kw,expected", COUNTS, ids=lambda v: str(v) if isinstance(v, str) else None)
def test_parameter_counts_match_papers(name, shape, nc, kw, expected):
    assert count_parameters(_build(name, shape, nc, kw)) == expected


@pytest.mark.parametrize("name,shape,nc,kw,expected", SMALL)
def test_forward_shapes(name, shape, nc, kw, expected):
    model = _build(name, shape, nc, kw)
    out = model(torch.randn(3, *shape))
    assert out.shape == (3, nc if nc >= 3 else 1)


def test_resnet_forward_one_tiny_batch():
    with torch.no_grad():
        assert _resnet("resnet18_nobn", 100)(torch.randn(1, 3, 32, 32)).shape == (1, 100)
        assert _resnet("resnet18_mod", 10)(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_resnet_bias_finding():
    # 11,210,432 requires every layer bias-free, the final linear included (a biased head gives +100).
    m = _resnet("resnet18_nobn", 100)
    assert not [n for n, _ in m.named_parameters() if n.endswith("bias")]
    assert sum(p.numel() for n, p in m.named_parameters() if n.startswith("linear")) == 512 * 100
    shortcuts = [mod for n, mod in m.named_modules() if n.endswith("shortcut") and len(mod)]
    assert len(shortcuts) == 3 and all(s[0].kernel_size == (1, 1) for s in shortcuts)
    mod = _resnet("resnet18_mod", 10)
    assert mod.conv1.kernel_size == (7, 7) and mod.conv1.padding == (1, 1) and mod.conv1.stride == (1, 1)
    assert [mod.fc.out_features, mod.linear.out_features, mod.final.out_features] == [1000, 200, 10]


def _check_contract(model: nn.Module):
    owned = set()
    for mod_name, mod in model.named_modules():
        assert not isinstance(mod, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)), mod_name
        own = list(mod.named_parameters(recurse=False))
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            owned.update(f"{mod_name}.{n}" if mod_name else n for n, _ in own)
        else:
            assert not own, f"{mod_name} ({type(mod).__name__}) holds parameters"
    assert owned == {n for n, _ in model.named_parameters()}
    for mod in model.modules():
        if isinstance(mod, nn.Flatten):
            assert mod.start_dim == 1


@pytest.mark.parametrize("name", sorted(FITS))
def test_batched_engine_contract(name):
    shape, nc = FITS[name]
    _check_contract(_build(name, shape, nc))


def test_stacked_engine_accepts_models_and_matches_per_client_forward():
    from fedbench.train.stacked import StackedModel

    for name in ["simple_cnn", "lenet", "mlp_200_100", "logistic_regression", "two_layer_relu", "cifarnet"]:
        shape, nc = FITS[name]
        torch.manual_seed(1)
        a, b = (build_model(name, input_shape=shape, num_classes=nc).eval() for _ in range(2))
        for n, buf in a.named_buffers():  # buffers (two_layer_relu's fixed a) are shared by all clients
            b.get_buffer(n).copy_(buf)
        stacked = StackedModel(a).eval()
        params = {n: torch.stack([pa.detach(), pb.detach()]) for (n, pa), (_, pb)
                  in zip(a.named_parameters(), b.named_parameters())}
        x = torch.randn(4, *shape)
        with torch.no_grad():
            got = stacked(params, x)
            want = torch.cat([a(x[:2]), b(x[2:])])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", BIAS_FREE)
def test_bias_free_models_have_no_bias(name):
    shape, nc = FITS[name]
    model = _build(name, shape, nc)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            assert mod.bias is None


def test_biased_models_have_biases():
    for name in ["simple_cnn", "mlp_500_300", "fola_cnn", "cifarnet"]:
        shape, nc = FITS[name]
        model = _build(name, shape, nc)
        layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        assert layers and all(m.bias is not None for m in layers), name


def test_fola_cnn_xavier_weights_and_zero_biases():
    torch.manual_seed(0)
    model = build_model("fola_cnn", input_shape=(3, 32, 32), num_classes=10)
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            assert torch.count_nonzero(mod.bias) == 0
            fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(mod.weight)
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            w = mod.weight.detach()
            assert w.abs().max() <= bound
            assert w.abs().max() > 0.9 * bound  # spans the xavier range, not PyTorch's smaller default one


@pytest.mark.parametrize("name", [n for n in sorted(FITS) if not n.startswith("resnet")])
def test_deterministic_under_manual_seed(name):
    shape, nc = FITS[name]

    def state(seed):
        torch.manual_seed(seed)
        return build_model(name, input_shape=shape, num_classes=nc).state_dict()

    s0, s0b, s1 = state(0), state(0), state(1)
    assert all(torch.equal(s0[k], s0b[k]) for k in s0)
    assert any(not torch.equal(s0[k], s1[k]) for k in s0)


def test_resnet_deterministic_under_manual_seed():
    torch.manual_seed(0)
    a = build_model("resnet18_nobn", input_shape=(3, 32, 32), num_classes=100)
    ref = _resnet("resnet18_nobn", 100)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), ref.parameters()))


@pytest.mark.parametrize("name,shape,kw", [
    ("simple_cnn", (1, 28, 28), {"channels": [12, 32], "hidden": [240, 168]}),
    ("simple_cnn", (3, 32, 32), {"channels": [8, 20], "hidden": [150]}),
    ("lenet", (1, 28, 28), {"channels": [9, 24], "hidden": [180, 126]}),
    ("fedma_cnn", (3, 32, 32), {"channels": [48, 96], "hidden": [768, 192]}),
    ("fola_cnn", (3, 32, 32), {"channels": [40, 80], "hidden": [600]}),
    ("mlp", (1, 28, 28), {"hidden": [600, 400, 200]}),
    ("mlp_200_100", (1, 28, 28), {"hidden": [260, 130]}),
    ("mlp_500_300", (1, 28, 28), {"hidden": [650, 390]}),
    ("cifarnet", (3, 32, 32), {"hidden": 640}),
    ("two_layer_relu", (2,), {"width": 2048}),
])
def test_wider_widths_build_and_run(name, shape, kw):
    nc = FITS[name][1]
    default = build_model(name, input_shape=shape, num_classes=nc)
    wide = build_model(name, input_shape=shape, num_classes=nc, **kw)
    assert count_parameters(wide) > count_parameters(default)
    out = wide(torch.randn(2, *shape))
    assert out.shape == (2, nc if nc >= 3 else 1)
    _check_contract(wide)


@pytest.mark.parametrize("name,shape,nc", [
    ("lenet", (3, 32, 32), 10),
    ("simple_cnn", (3, 28, 28), 10),
    ("simple_cnn", (784,), 10),
    ("fedma_cnn", (1, 28, 28), 10),
    ("fola_cnn", (1, 28, 28), 10),
    ("cifarnet", (1, 28, 28), 10),
    ("resnet18_nobn", (1, 28, 28), 10),
    ("resnet18_mod", (3, 64, 64), 10),
    ("mlp_500_300", (3, 32, 32), 10),
    ("mlp_200_100", (46,), 10),
    ("softmax_regression", (3, 32, 32), 10),
])
def test_wrong_input_shape_is_one_line_error(name, shape, nc):
    with pytest.raises(FedbenchError) as e:
        build_model(name, input_shape=shape, num_classes=nc)
    msg = str(e.value)
    assert "\n" not in msg and f"'{name}'" in msg and "expects" in msg
    assert "x".join(map(str, shape)) in msg  # names what it got


def test_logistic_regression_zero_init():
    """init=zeros starts at PVI's prior mean w = 0 (every logit 0); the default init is PyTorch's (not all zero)."""
    zero = build_model("logistic_regression", input_shape=(46,), num_classes=2, init="zeros")
    assert all(torch.count_nonzero(p) == 0 for p in zero.parameters())
    assert torch.equal(zero(torch.randn(5, 46)), torch.zeros(5, 1))
    default = build_model("logistic_regression", input_shape=(46,), num_classes=2)
    assert torch.count_nonzero(default.linear.weight) == 46


def test_other_user_errors_are_one_line():
    cases = [
        dict(name="no_such_model", input_shape=(1, 28, 28), num_classes=10),
        dict(name="lenet", input_shape=(1, 28, 28), num_classes=10, widht=3),
        dict(name="lenet", input_shape=(1, 28, 28), num_classes=10, channels=[6]),
        dict(name="mlp", input_shape=(1, 28, 28), num_classes=10, hidden=[100, -1]),
        dict(name="logistic_regression", input_shape=(46,), num_classes=10),
        dict(name="logistic_regression", input_shape=(46,), num_classes=2, init="normal"),
        dict(name="two_layer_relu", input_shape=(2,), num_classes=10),
        dict(name="lenet", input_shape=(1, 28, 28), num_classes=None),
        dict(name="cifarnet", input_shape=(3, 32, 32), num_classes=10, dropout="yes"),
        dict(name="mlp", input_shape="abc", num_classes=10),
    ]
    for kw in cases:
        name = kw.pop("name")
        with pytest.raises(FedbenchError) as e:
            build_model(name, **kw)
        assert "\n" not in str(e.value) and name in str(e.value)


def test_simple_cnn_picks_variant_from_input():
    m = build_model("simple_cnn", input_shape=(1, 28, 28), num_classes=10)
    c = build_model("simple_cnn", input_shape=(3, 32, 32), num_classes=10)
    assert (m.variant, m.fc1.in_features, m.conv1.in_channels) == ("mnist", 256, 1)
    assert (c.variant, c.fc1.in_features, c.conv1.in_channels) == ("cifar", 400, 3)


def test_cifarnet_dropout_switch():
    drops = lambda m: [mod.p for mod in m.modules() if isinstance(mod, nn.Dropout)]  # noqa: E731
    assert drops(build_model("cifarnet", input_shape=(3, 32, 32), num_classes=10)) == [0.25, 0.25, 0.5]
    assert drops(build_model("cifarnet", input_shape=(3, 32, 32), num_classes=10, dropout=False)) == []


def test_two_layer_relu_definition():
    torch.manual_seed(0)
    m = build_model("two_layer_relu", input_shape=(2,), num_classes=0, width=4096)
    assert [n for n, _ in m.named_parameters()] == ["fc1.weight"] and m.fc1.bias is None
    assert "a" in dict(m.named_buffers()) and not m.a.requires_grad
    assert torch.allclose(m.a.abs(), torch.full((4096,), 4096 ** -0.5))
    assert abs((m.a > 0).float().mean().item() - 0.5) < 0.05
    assert abs(m.fc1.weight.var().item() - 0.5) < 0.03  # w_r ~ N(0, I/2)
    x = torch.randn(5, 2)
    want = (torch.relu(x @ m.fc1.weight.T) * m.a).sum(1, keepdim=True)
    torch.testing.assert_close(m(x), want)
    # a fixed by a_seed regardless of the global seed; with a_seed=None it follows manual_seed
    torch.manual_seed(1)
    a1 = build_model("two_layer_relu", input_shape=(2,), num_classes=0, width=64, a_seed=7).a
    torch.manual_seed(2)
    a2 = build_model("two_layer_relu", input_shape=(2,), num_classes=0, width=64, a_seed=7).a
    assert torch.equal(a1, a2)


def test_logistic_regression_is_one_logit():
    m = build_model("logistic_regression", input_shape=(46,), num_classes=2)
    assert m(torch.randn(4, 46)).shape == (4, 1)


def test_every_model_config_builds_and_every_model_has_one():
    files = sorted(CONF.glob("*.yaml"))
    assert {f.stem for f in files} == set(MODELS.names()) == set(FITS)
    for f in files:
        cfg = OmegaConf.to_container(OmegaConf.load(f), resolve=True)
        assert cfg["name"] == f.stem
        assert cfg.pop("pretrained", None) is None   # a runner option (fedbench/models/pretrained.py), off by default
        shape, nc = FITS[cfg["name"]]
        model = _build(cfg.pop("name"), shape, nc, cfg)
        assert count_parameters(model) > 0
