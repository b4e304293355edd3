"""Numerics versions: which version of the arithmetic produced a record.

A record stores ``numerics = {"core": CORE, "method": <its method's version>}``. A refactor that keeps results
bit-identical changes nothing here, so every record stays valid; a change that moves numbers bumps a version, and
every record made before it becomes *stale*: it is rerun instead of skipped, and ``collect`` leaves it out of
its cells (and says how many it left out).

- ``CORE`` covers everything every method shares: data loading and transforms, partitions, models and their
  initialisation, local training, per-client curvature / Gram products, evaluation. Bumping it also changes the
  client-stage cache key, so cached clients are retrained.
- ``METHODS[name]`` covers one method's own server step (or its own client training). Methods not listed are 1.

Torch-free on purpose: collect and the validator read it without importing torch.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

CORE = 1

METHODS: Dict[str, int] = {
    # name: version — add a line (starting at 2) when a change moves that method's numbers, with a word on why.
}


def method_version(method: str) -> int:
    return int(METHODS.get(str(method), 1))


def current(method: str) -> Dict[str, int]:
    """What a record of ``method`` written by this code says under ``numerics``."""
    return {"core": CORE, "method": method_version(method)}


def is_current(record: Optional[Mapping[str, Any]]) -> bool:
    """True when ``record`` was made by the numerics of this code (records without the field are stale)."""
    if not record:
        return False
    return record.get("numerics") == current(record.get("algorithm") or "")
