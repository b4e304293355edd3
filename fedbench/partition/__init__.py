"""Client partitions: which training samples each client holds.

``make_partition(name, labels, num_clients, seed, ...)`` returns one int64 index array per client.
Families (one module each; the papers use four different "Dirichlet" splits, never merged):

================================  ==========================================================  =========================
name                              what                                                        source / note
================================  ==========================================================  =========================
``noniid-labeldir``               per-class Dir(beta) over clients, balance trick, min size     NIID-Bench; FedLPA
``noniid-#label`` (``#label2``)   each client k classes (i % C + random), equal class split   NIID-Bench; FedLPA
``homo``                          IID equal split (contiguous or PVI strided)                 NIID-Bench; PVI/FedLap
``iid-diff-quantity``             IID content, Dir(beta) sizes                                NIID-Bench
``dirichlet_clientwise``          per-client Dir(alpha) over classes                          FedFisher, FedBEns
``fedfisher_attack``              client 1 = all of one class + 1000 others; Dir rest          FedFisher App. E (Tab. 6)
``dirichlet_per_class_contiguous``  per-class Dir(alpha), contiguous slices                   FOLA (FedMA)
``size_class_dirichlet``          sizes ~ Dir(alpha1), class mix ~ Dir(alpha2)                FedLap App. E.1
``uci_inhomogeneous``             half small/negative-heavy, half big clients                 PVI; FedLap UCI
``disjoint_classes``              contiguous class groups                                     FOLA §IV-E
``natural``                       one client per group id                                     FLamby-Heart
================================  ==========================================================  =========================

Everything is pure: local RNGs only (``np.random.RandomState`` / ``random.Random``, whose streams equal
the legacy global ones the papers seed), same inputs -> same output.
"""
from __future__ import annotations

import inspect
import numbers
import re
from typing import List, Optional, Sequence

import numpy as np

from fedbench.errors import FedbenchError
from fedbench.partition.base import PARTITIONS, PartitionFn
from fedbench.partition import (dirichlet_clientwise, dirichlet_per_class_contiguous, disjoint_classes,  # noqa: F401
                                fedfisher_attack, natural, niid_bench, niid_cell, size_class_dirichlet,
                                uci_inhomogeneous)

__all__ = ["PARTITIONS", "make_partition", "client_label_counts", "partition_params"]

#: Extra entropy that separates the data_fraction subset stream from the partition stream of the same seed.
_SUBSET_STREAM = 0x5B5E7
#: ... and the coarse_clients shuffle stream from both.
_COARSE_STREAM = 0x5B5E8
_LABEL_K = re.compile(r"^noniid-#label(\d+)$")
_INTERNAL = ("num_classes", "groups")


def _check_seed(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < 2 ** 32:
        raise FedbenchError(f"partition {key} must be an integer in [0, 2**32), got {value!r}")
    return int(value)


def partition_params(name: str) -> List[str]:
    """The keyword parameters a partition family accepts (besides data_fraction, fixed_seed and coarse_clients)."""
    fn = PARTITIONS.get(_LABEL_K.sub("noniid-#label", name))
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _INTERNAL]


def make_partition(name: str, labels, num_clients: int, seed: int, *, groups: Optional[np.ndarray] = None,
                   data_fraction: float = 1.0, fixed_seed: Optional[int] = None,
                   coarse_clients: Optional[int] = None,
                   num_classes: Optional[int] = None, **params) -> List[np.ndarray]:
    """Split the samples behind ``labels`` into ``num_clients`` disjoint int64 index arrays.

    * ``name``: a registered family; ``noniid-#label2`` etc. is read as ``noniid-#label`` with k=2.
    * ``data_fraction`` < 1: first a random subset of that fraction of the samples is drawn (seeded by
      the run ``seed`` on its own stream; FedLap's 10% FMNIST), only it is partitioned, and the
      indices returned refer to the full ``labels``.
    * ``fixed_seed``: if not None the partition draws use it instead of ``seed`` (FedFisher/FedBEns fix
      ``np.random.seed(3)`` for the split whatever the run seed; fedfisher.md §3.2).
    * ``coarse_clients`` = M (a what-if, no paper's split; None = off): the family splits the data among
      M clients, then each of them is cut at random into ``num_clients / M`` near-equal IID shards: the
      number and size of ``num_clients`` clients with the label mixes of M (gaps.md#fola-figures3-4).
    * ``groups``: per-sample group ids, used by ``natural`` only.
    * ``params``: the family's parameters (beta, alpha, k, ...).

    Bad input raises a one-line FedbenchError before any draw.
    """
    m = _LABEL_K.match(str(name))
    if m:
        k = int(m.group(1))
        if "k" in params and params["k"] != k:
            raise FedbenchError(f"partition '{name}' names k={k} but k={params['k']} was also given; set one")
        name, params = "noniid-#label", {**params, "k": k}
    fn: PartitionFn = PARTITIONS.get(name)
    sig = inspect.signature(fn).parameters
    allowed = [p for p in sig if sig[p].kind is inspect.Parameter.KEYWORD_ONLY and p not in _INTERNAL]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise FedbenchError(f"partition '{name}' has no parameter {', '.join(map(repr, unknown))} "
                            f"(it takes: {', '.join(allowed + ['data_fraction', 'fixed_seed', 'coarse_clients'])})")

    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise FedbenchError(f"partition labels must be a 1-D array, got shape {labels.shape}")
    seed = _check_seed("seed", seed)
    part_seed = seed if fixed_seed is None else _check_seed("fixed_seed", fixed_seed)
    if isinstance(data_fraction, bool) or not isinstance(data_fraction, numbers.Real) \
            or not 0 < data_fraction <= 1:
        raise FedbenchError(f"partition data_fraction must be in (0, 1], got {data_fraction!r}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, numbers.Integral) or num_clients < 1:
        raise FedbenchError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    num_clients = int(num_clients)
    if coarse_clients is None:
        coarse_clients = num_clients
    if isinstance(coarse_clients, bool) or not isinstance(coarse_clients, numbers.Integral) or coarse_clients < 1 \
            or num_clients % coarse_clients:
        raise FedbenchError(f"partition coarse_clients must be an integer >= 1 that divides num_clients={num_clients}, "
                            f"got {coarse_clients!r}")
    coarse_clients = int(coarse_clients)
    n = len(labels)
    n_used = n if data_fraction == 1 else max(1, int(round(float(data_fraction) * n)))
    if num_clients > n_used:
        what = f"the {n_used} samples" if n_used == n else f"the {n_used} samples of data_fraction={data_fraction}"
        raise FedbenchError(f"num_clients={num_clients} exceeds {what}; use fewer clients")
    if num_classes is None and labels.dtype.kind in "iub" and n:
        num_classes = int(labels.max()) + 1   # from all labels, so a subset missing a class draws the same
    if groups is not None:
        groups = np.asarray(groups)
        if groups.shape != labels.shape:
            raise FedbenchError(f"partition groups has shape {groups.shape}, expected {labels.shape}")

    subset = None
    if n_used < n:
        rng = np.random.default_rng([_SUBSET_STREAM, seed])
        subset = np.sort(rng.choice(n, size=n_used, replace=False)).astype(np.int64)
        labels = labels[subset]
        groups = None if groups is None else groups[subset]
    extra = {"groups": groups} if "groups" in sig else {}
    parts = fn(labels, coarse_clients, part_seed, num_classes=num_classes, **extra, **params)
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    if coarse_clients < num_clients:
        parts = _cut_into_shards(parts, num_clients // coarse_clients, part_seed)
    if subset is not None:
        parts = [subset[p] for p in parts]
    return parts


def _cut_into_shards(parts: Sequence[np.ndarray], k: int, seed: int) -> List[np.ndarray]:
    """Each part shuffled and cut into k near-equal shards, in order: part 0's shards first."""
    rng = np.random.default_rng([_COARSE_STREAM, seed])
    out = []
    for p in parts:
        if len(p) < k:
            raise FedbenchError(f"partition coarse_clients: a client of the coarse split holds {len(p)} "
                                f"sample(s), fewer than its {k} shards; use more coarse_clients")
        out.extend(np.sort(shard) for shard in np.array_split(rng.permutation(p), k))
    return out


def client_label_counts(parts: Sequence[np.ndarray], labels, num_classes: int) -> np.ndarray:
    """[K, C] int64 matrix: how many samples of each class every client holds."""
    y = np.asarray(labels).astype(np.int64)
    if not parts:
        return np.zeros((0, num_classes), dtype=np.int64)
    return np.stack([np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=num_classes)[:num_classes]
                     for p in parts]).astype(np.int64)
