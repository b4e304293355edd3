"""One axis for FedLPA's tables: a NIID-Bench partition written as the paper's row label.

FedLPA's tables mix two partition families in one column (``β=0.05`` rows and ``#C=2`` rows); a
Hydra sweep over ``partition.spec='beta=0.05','#C=2'`` covers both, and the label is the one the
reference tables use. ``beta=<b>`` is ``noniid-labeldir`` with that beta, ``#C=<k>`` is
``noniid-#label`` with that k (identical splits: same functions, same RNG order).
"""
from __future__ import annotations

import re
from typing import List, Optional

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.partition.base import DEFAULT_MAX_RETRIES, PARTITIONS
from fedbench.partition.niid_bench import noniid_label_k, noniid_labeldir

_BETA = re.compile(r"^beta=([0-9.eE+-]+)$")
_CK = re.compile(r"^#C=(\d+)$")


def parse_spec(spec: str):
    spec = str(spec).strip()
    m = _BETA.match(spec)
    if m:
        return "noniid-labeldir", {"beta": float(m.group(1))}
    m = _CK.match(spec)
    if m:
        return "noniid-#label", {"k": int(m.group(1))}
    raise FedbenchError(f"partition 'niid-bench': spec must look like 'beta=0.05' or '#C=2', got {spec!r}")


@PARTITIONS.register("niid-bench")
def niid_bench_cell(labels: np.ndarray, num_clients: int, rng_seed: int, *, num_classes: Optional[int] = None,
                    spec: str = "beta=0.5", min_require_size: int = 10,
                    max_retries: int = DEFAULT_MAX_RETRIES) -> List[np.ndarray]:
    family, params = parse_spec(spec)
    if family == "noniid-labeldir":
        return noniid_labeldir(labels, num_clients, rng_seed, num_classes=num_classes, beta=params["beta"],
                               min_require_size=min_require_size, max_retries=max_retries)
    return noniid_label_k(labels, num_clients, rng_seed, num_classes=num_classes, k=params["k"])
