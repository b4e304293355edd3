"""Hardware settings read by more than one layer (torch-free)."""
from __future__ import annotations

from typing import Optional

from fedbench.errors import FedbenchError


def parse_num_threads(spec) -> Optional[int]:
    """``hardware.num_threads``: None for ``auto`` (or unset), else a positive integer; anything else is an error."""
    if spec in (None, "auto"):
        return None
    try:
        n = int(spec)
    except (TypeError, ValueError):
        raise FedbenchError(f"hardware.num_threads must be auto or a positive integer, got {spec!r}") from None
    if n < 1:
        raise FedbenchError(f"hardware.num_threads must be auto or a positive integer, got {spec!r}")
    return n
