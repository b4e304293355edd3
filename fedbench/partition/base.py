"""Shared pieces of the partition families: the registry, argument checks and RNG helpers.

Every family is a registered function ``fn(labels, num_clients, rng_seed, *, num_classes, **params)``
that returns one int64 index array per client. Families draw from *local* generators only
(``np.random.RandomState(seed)`` and ``random.Random(seed)``), which produce exactly the streams of the
legacy global ``np.random.seed(seed)`` / ``random.seed(seed)`` that the papers' code uses, so splits
are reproduced without touching any global RNG state.
"""
from __future__ import annotations

import numbers
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.registry import Registry

PartitionFn = Callable[..., List[np.ndarray]]

PARTITIONS: Registry = Registry("partition")

#: Default bound on the redraws of the min-size loops (NIID-Bench loops forever; FedLab#232 and
#: ksreenivasan/OOD_FL#2 report hangs for small concentrations or many clients).
DEFAULT_MAX_RETRIES = 1000


def legacy_rng(seed: int) -> np.random.RandomState:
    """A private MT19937 stream identical to the one ``np.random.seed(seed)`` gives the global RNG."""
    return np.random.RandomState(seed)


def check_number(pname: str, key: str, value, *, positive: bool = False, min_value: Optional[float] = None,
                 integer: bool = False) -> float:
    """Type and range check of one scalar parameter; one-line FedbenchError otherwise."""
    ok_type = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number"
        raise FedbenchError(f"partition '{pname}': {key} must be {kind}, got {value!r}")
    if not np.isfinite(value):
        raise FedbenchError(f"partition '{pname}': {key} must be finite, got {value!r}")
    if positive and value <= 0:
        raise FedbenchError(f"partition '{pname}': {key} must be > 0, got {value!r}")
    if min_value is not None and value < min_value:
        raise FedbenchError(f"partition '{pname}': {key} must be >= {min_value}, got {value!r}")
    return value


def check_choice(pname: str, key: str, value, choices: Sequence[str]) -> str:
    if value not in choices:
        raise FedbenchError(f"partition '{pname}': {key} must be one of {', '.join(choices)}; got {value!r}")
    return value


def class_labels(pname: str, labels: np.ndarray, num_classes: Optional[int]) -> Tuple[np.ndarray, int]:
    """Integer class labels in [0, C) and C, for the families that split by class."""
    labels = np.asarray(labels)
    if labels.dtype.kind in "iub":
        y = labels.astype(np.int64, copy=False)
    elif labels.dtype.kind == "f" and labels.size and np.all(np.isfinite(labels)) \
            and np.all(labels == np.round(labels)):
        y = labels.astype(np.int64)
    else:
        raise FedbenchError(f"partition '{pname}' splits by class and needs integer class labels; these targets "
                            f"are real-valued (use homo or natural for regression data)")
    if y.size and y.min() < 0:
        raise FedbenchError(f"partition '{pname}': class labels must be >= 0, got {int(y.min())}")
    inferred = int(y.max()) + 1 if y.size else 0
    if num_classes is None:
        num_classes = inferred
    elif inferred > num_classes:
        raise FedbenchError(f"partition '{pname}': a label {inferred - 1} is outside num_classes={num_classes}")
    return y, int(num_classes)


def cumsum_cuts(proportions: np.ndarray, n: int) -> np.ndarray:
    """Cut points ``(cumsum(p) * n).astype(int)[:-1]`` as in NIID-Bench / FedFisher.

    NaN proportions happen in the reference code: a legacy Dirichlet draw with a tiny concentration
    (e.g. FedLPA's beta=0.001) can underflow to all zeros, and NIID-Bench's balance step zeroes a
    draw whose mass sits only on full clients; ``p / p.sum()`` is then 0/0. The reference casts NaN to
    int, which on x86 (INT64_MIN) and on ARM (0) alike puts the whole class on the *last* client. We
    produce that outcome explicitly instead of relying on an undefined cast (which warns in numpy 2).
    """
    if not np.all(np.isfinite(proportions)):
        return np.zeros(len(proportions) - 1, dtype=np.int64)
    return (np.cumsum(proportions) * n).astype(np.int64)[:-1]


def normalise(p: np.ndarray) -> np.ndarray:
    """``p / p.sum()``; an all-zero or NaN draw gives NaN without a warning (see ``cumsum_cuts``)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return p / p.sum()


def concat(pieces: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate index pieces into one int64 array (empty-safe)."""
    if not pieces:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces]).astype(np.int64, copy=False)
