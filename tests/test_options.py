"""The option reader: every method's options dataclass against its YAML, and the reader's rules."""
from __future__ import annotations

import dataclasses
import typing
from typing import Optional

import pytest
from omegaconf import OmegaConf

from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.options import option, read_options, yaml_defaults
from fedbench.config import CONF_DIR
from fedbench.config.compose import compose_config
from fedbench.errors import FedbenchError


def _keys(cls) -> dict:
    """Field names of an options dataclass, nested blocks as dicts."""
    hints = typing.get_type_hints(cls)
    return {f.name: (_keys(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None)
            for f in dataclasses.fields(cls)}


def _yaml_keys(node, like: dict) -> dict:
    """The YAML's keys in ``_keys``' shape: descend only where the dataclass has a nested block."""
    return {k: (_yaml_keys(v, like[k]) if isinstance(v, dict) and isinstance(like.get(k), dict) else None)
            for k, v in node.items() if k != "name"}


def _algorithm_yamls():
    return sorted(p.stem for p in (CONF_DIR / "algorithm").glob("*.yaml"))


def test_every_method_declares_options_and_its_yaml_matches_them():
    names = sorted(ALGORITHMS.names())
    assert len(names) == 24   # every registered method (a new one must pass too)
    for name in names:
        cls = ALGORITHMS.get(name).Options
        assert cls is not None and dataclasses.is_dataclass(cls), name
        assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(cls)), f"{name}: a Python default"
        assert _keys(cls) == _yaml_keys(yaml_defaults(name), _keys(cls)), name


@pytest.mark.parametrize("stem", _algorithm_yamls())
def test_every_algorithm_yaml_composes_to_exactly_its_methods_options(stem):
    """Through the config loader (the way runs and presets see it), variants such as dense_fedfisher included."""
    node = OmegaConf.to_container(compose_config([f"algorithm={stem}"]).algorithm, resolve=True)
    cls = ALGORITHMS.get(node["name"]).Options
    assert _yaml_keys(node, _keys(cls)) == _keys(cls)
    read_options(cls, {k: v for k, v in node.items() if k != "name"}, node["name"])   # the YAML values are valid


def test_plain_dict_gets_the_yaml_defaults_and_overrides_win():
    o = read_options(ALGORITHMS.get("fedprox").Options, {"mu": 1}, "fedprox")
    assert (o.mu, o.scale, o.weighting) == (1.0, "mean", "num_samples") and isinstance(o.mu, float)


def test_nested_block_merges_key_by_key_and_checks_its_keys():
    cls = ALGORITHMS.get("fola").Options
    o = read_options(cls, {"fisher": {"mode": "offline"}}, "fola")
    assert (o.fisher.mode, o.fisher.grad, o.fisher.chunk_size) == ("offline", "per_sample_sq", 256)
    with pytest.raises(FedbenchError, match=r"unknown algorithm key\(s\) \['mod'\] for fola fisher"):
        read_options(cls, {"fisher": {"mod": "offline"}}, "fola")
    with pytest.raises(FedbenchError, match="algorithm.fisher.chunk_size must be an integer >= 1, got 0"):
        read_options(cls, {"fisher": {"chunk_size": 0}}, "fola")


def test_a_mapping_option_replaces_the_default_whole():
    o = read_options(ALGORITHMS.get("fedov").Options, {"outlier_ops": {"rot": 1.0}}, "fedov")
    assert o.outlier_ops == {"crop": 0.0, "blur": 0.0, "erase": 0.0, "cut": 0.0, "rot": 1.0}


def test_interpolated_default_resolves_against_the_context():
    cls = ALGORITHMS.get("fednova").Options
    assert read_options(cls, {}, "fednova", context={"local": {"momentum": 0.5}}).rho == 0.5
    assert read_options(cls, {"rho": 0.0}, "fednova", context={"local": {"momentum": 0.5}}).rho == 0.0


@dataclasses.dataclass(frozen=True)
class _Toy:
    lr: float = option(positive=True)
    wd: float = option(nonneg=True)
    steps: int = option(minimum=1)
    flag: bool = option()
    mode: str = option(choices=("a", "b"))
    clip: Optional[float] = option(nonneg=True)
    cap: Optional[int] = option(minimum=2)


_TOY = {"lr": 0.1, "wd": 0.0, "steps": 3, "flag": True, "mode": "a", "clip": None, "cap": None}


@pytest.mark.parametrize("bad,message", [
    ({"lr": 0}, "algorithm.lr must be > 0, got 0.0"),
    ({"lr": "x"}, "algorithm.lr must be a finite number, got 'x'"),
    ({"lr": float("inf")}, "algorithm.lr must be a finite number, got inf"),
    ({"wd": -1}, "algorithm.wd must be >= 0, got -1.0"),
    ({"steps": 0}, "algorithm.steps must be an integer >= 1, got 0"),
    ({"steps": True}, "algorithm.steps must be an integer >= 1, got True"),
    ({"flag": "yes"}, "algorithm.flag must be true or false, got 'yes'"),
    ({"mode": "c"}, "algorithm.mode must be one of a, b, got 'c'"),
    ({"clip": -1.0}, "algorithm.clip must be >= 0, got -1.0"),
    ({"cap": 1}, "algorithm.cap must be an integer >= 2, got 1"),
    ({"lrr": 1}, r"unknown algorithm key\(s\) \['lrr'\] for toy"),
])
def test_rules_and_their_one_line_messages(bad, message, monkeypatch):
    monkeypatch.setattr("fedbench.algorithms.options._yaml_defaults", lambda method: dict(_TOY))
    with pytest.raises(FedbenchError, match=f"^{message}") as e:
        read_options(_Toy, bad, "toy")
    assert "\n" not in str(e.value)
    ok = read_options(_Toy, {"clip": 2, "cap": 5}, "toy")
    assert (ok.clip, ok.cap, ok.steps, ok.lr) == (2.0, 5, 3, 0.1) and isinstance(ok.clip, float)


def test_a_field_the_yaml_lacks_is_an_error(monkeypatch):
    monkeypatch.setattr("fedbench.algorithms.options._yaml_defaults", lambda method: {"lr": 0.1})
    with pytest.raises(FedbenchError, match="algorithm.wd is missing"):
        read_options(_Toy, {}, "toy")


@pytest.mark.parametrize("method,key", [("fedfisher_kfac", "kfac_rank"), ("regmean", "gram_rank")])
def test_rank_options_take_budget_or_a_positive_integer(method, key):
    cls = ALGORITHMS.get(method).Options
    assert getattr(read_options(cls, {}, method), key) == "budget"
    assert getattr(read_options(cls, {key: 7}, method), key) == 7
    for bad in (0, True, "auto", 2.5):
        with pytest.raises(FedbenchError, match=f"algorithm.{key} must be 'budget' or a positive integer"):
            read_options(cls, {key: bad}, method)
