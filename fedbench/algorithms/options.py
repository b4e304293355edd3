"""Reading a method's config keys with one-line FedbenchErrors (raised from ``__init__``, before training)."""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Mapping, Sequence

from fedbench.errors import FedbenchError


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
