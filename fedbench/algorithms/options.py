"""Reading a method's config keys with one-line FedbenchErrors (raised from ``__init__``, before training).

A method states its options once, as a frozen dataclass with typed fields and per-field constraints
(``option(positive=True)``, ``option(choices=(...))``, ``option(check=fn)``) and NO Python defaults: the defaults
live only in ``conf/algorithm/<method>.yaml``. ``read_options(OptionsClass, cfg, method)`` fills the keys the cfg
lacks from that YAML (a Hydra-composed cfg already has them; tests often pass a plain dict), rejects unknown keys
and validates every value.

Field types: ``float`` / ``int`` / ``bool`` / ``str`` (with ``choices``), ``Optional[...]`` of those (null
allowed), a nested options dataclass (a YAML mapping such as FOLA's ``fisher:``), or ``Any`` with a ``check``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
from numbers import Integral, Real
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, TypeVar

from omegaconf import OmegaConf

from fedbench.config import CONF_DIR
from fedbench.errors import FedbenchError

T = TypeVar("T")


def number(cfg: Mapping[str, Any], key: str, default, *, positive: bool = False, nonneg: bool = False,
           allow_none: bool = False):
    val = cfg.get(key, default)
    if val is None and allow_none:
        return None
    if isinstance(val, bool) or not isinstance(val, Real) or not math.isfinite(float(val)):
        raise FedbenchError(f"algorithm.{key} must be a finite number, got {val!r}")
    val = float(val)
    if positive and not val > 0:
        raise FedbenchError(f"algorithm.{key} must be > 0, got {val}")
    if nonneg and val < 0:
        raise FedbenchError(f"algorithm.{key} must be >= 0, got {val}")
    return val


def integer(cfg: Mapping[str, Any], key: str, default, *, minimum: int = 0) -> int:
    val = cfg.get(key, default)
    if isinstance(val, bool) or not isinstance(val, Integral) or val < minimum:
        raise FedbenchError(f"algorithm.{key} must be an integer >= {minimum}, got {val!r}")
    return int(val)


def choice(cfg: Mapping[str, Any], key: str, default, allowed: Sequence[Any]):
    val = cfg.get(key, default)
    if val not in allowed:
        raise FedbenchError(f"algorithm.{key} must be one of {', '.join(map(str, allowed))}, got {val!r}")
    return val


def boolean(cfg: Mapping[str, Any], key: str, default) -> bool:
    val = cfg.get(key, default)
    if not isinstance(val, bool):
        raise FedbenchError(f"algorithm.{key} must be true or false, got {val!r}")
    return val


def check_keys(cfg: Mapping[str, Any], keys: Sequence[str], name: str) -> None:
    unknown = sorted(set(cfg) - set(keys) - {"name"})
    if unknown:
        raise FedbenchError(f"unknown algorithm key(s) {unknown} for {name}; known: {sorted(keys)}")


# ---- the declarative reader ---------------------------------------------------------------------------
def option(*, positive: bool = False, nonneg: bool = False, minimum: int = 0, choices: Sequence[Any] = (),
           check: Optional[Callable[[str, Any], Any]] = None) -> Any:
    """A dataclass field without a default: its constraints (the default is in the method's YAML).
    ``check(key, value) -> value`` validates (and may convert) what the type rules cannot say."""
    return dataclasses.field(metadata={"positive": positive, "nonneg": nonneg, "minimum": minimum,
                                       "choices": tuple(choices), "check": check})


@functools.lru_cache(maxsize=None)
def _yaml_defaults(method: str) -> Dict[str, Any]:
    path = CONF_DIR / "algorithm" / f"{method}.yaml"
    if not path.is_file():
        raise FedbenchError(f"no conf/algorithm/{method}.yaml holds the defaults of method '{method}'")
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    node.pop("name", None)
    return node


def yaml_defaults(method: str, context: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The keys of ``conf/algorithm/<method>.yaml`` (but ``name``); interpolations such as
    ``${local.momentum}`` resolve against ``context`` (the rest of the run's config)."""
    raw = _yaml_defaults(method)
    if context is None:
        return dict(raw)
    root = OmegaConf.create({**dict(context), "algorithm": raw})
    return OmegaConf.to_container(root.algorithm, resolve=True)


def _field_value(f: dataclasses.Field, hint: Any, key: str, val: Any, method: str) -> Any:
    meta = f.metadata
    optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if meta.get("check") is not None:
        return meta["check"](key, val)
    if dataclasses.is_dataclass(base):
        return _read(base, val, key + ".", method)
    one = {key: val}
    if base is bool:
        return boolean(one, key, None)
    if base is float:
        return number(one, key, None, positive=meta["positive"], nonneg=meta["nonneg"], allow_none=optional)
    if optional and val is None:
        return None
    if base is int:
        return integer(one, key, None, minimum=meta["minimum"])
    if meta["choices"]:
        return choice(one, key, None, meta["choices"])
    return val


def _read(cls, given: Any, prefix: str, method: str):
    if not isinstance(given, Mapping):
        raise FedbenchError(f"algorithm.{prefix.rstrip('.')} must be a mapping of options, got {given!r}")
    fields = dataclasses.fields(cls)
    check_keys(given, [f.name for f in fields], f"{method} {prefix.rstrip('.')}".strip())
    missing = [prefix + f.name for f in fields if f.name not in given]
    if missing:
        raise FedbenchError(f"algorithm.{missing[0]} is missing (its default belongs in conf/algorithm/{method}.yaml)")
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _field_value(f, hints[f.name], prefix + f.name, given[f.name], method) for f in fields})


def _merged(cls, defaults: Mapping[str, Any], given: Mapping[str, Any]) -> Dict[str, Any]:
    """``given`` over ``defaults``; a nested options block merges key by key (a partial ``fisher: {mode: ...}``),
    any other mapping value replaces the default whole."""
    out = dict(defaults)
    hints = typing.get_type_hints(cls)
    for k, v in given.items():
        d, sub = defaults.get(k), hints.get(k)
        nested = dataclasses.is_dataclass(sub) and isinstance(d, Mapping) and isinstance(v, Mapping)
        out[k] = _merged(sub, d, v) if nested else v
    return out


def read_options(cls: typing.Type[T], cfg: Mapping[str, Any], method: str, *,
                 context: Optional[Mapping[str, Any]] = None) -> T:
    """The method's validated options: ``cfg`` over the defaults of ``conf/algorithm/<method>.yaml``."""
    given = {k: v for k, v in dict(cfg).items() if k != "name"}
    keys = [f.name for f in dataclasses.fields(cls)]
    check_keys(given, keys, method)
    return _read(cls, _merged(cls, yaml_defaults(method, context), given), "", method)
