"""Tabular sets of FedLap: UCI Credit Approval (PVI preprocessing) and FLamby Fed-Heart-Disease.

Both read the original UCI files (``<root>/uci/`` or the mirror's ``uci/``), verified by SHA-256.
Features come out float32 [N, D], already standardised, so their ``mean``/``std`` are None.
"""
from __future__ import annotations

import math
import urllib.request
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from fedbench.data.base import DATASETS, FedDataset
from fedbench.data.sources import atomic_path, check_sha256, one_line, sha256_file
from fedbench.errors import DataError, FedbenchError

UCI_DIR = "uci"
UCI_SHA256 = {
    "crx.data": "fff49bc186cbddb3ace7371d40d9fbbb3af4f126019c13ff3f562249b1454f4d",
    "processed.cleveland.data": "a74b7efa387bc9d108d7d0115d831fe9b414b29ae7124f331b622b4efa0427c8",
    "processed.hungarian.data": "31134d83efc3266e486acece5e259585d7a52f16afa5567f195e70a993327afe",
    "processed.switzerland.data": "422aa0182e5b95ff4ef2d95512caf3335e114fc1816db477a5a30286b267c2d7",
    "processed.va.data": "1a12cdc1aa204bc5506aa22f04b6c45224b23f36adbd1c62039f65f370e334ea",
}
UCI_URLS = {
    "crx.data": "https://archive.ics.uci.edu/ml/machine-learning-databases/credit-screening/crx.data",
    **{f"processed.{c}.data": f"https://archive.ics.uci.edu/ml/machine-learning-databases/heart-disease/"
                              f"processed.{c}.data" for c in ("cleveland", "hungarian", "switzerland", "va")},
}


def uci_file(name: str, fname: str, root: Path, mirror: Optional[Path], download: bool) -> Path:
    """Path of a verified UCI file: the root's copy, else the mirror's, else a download into the root."""
    sha = UCI_SHA256[fname]
    local = root / UCI_DIR / fname
    if local.exists():
        check_sha256(local, sha, f"data set '{name}'", "delete it and load again (mirror / download)")
        return local
    if mirror is not None and (Path(mirror) / UCI_DIR / fname).is_file():
        src = Path(mirror) / UCI_DIR / fname
        check_sha256(src, sha, f"data set '{name}' (mirror)", "replace the mirror copy with a good one")
        return src
    if download:
        try:
            with atomic_path(local) as tmp:
                urllib.request.urlretrieve(UCI_URLS[fname], tmp)
                if sha256_file(tmp) != sha:
                    raise DataError(f"data set '{name}': the downloaded {fname} has the wrong SHA-256; "
                                    f"place a good copy in {root / UCI_DIR}")
            return local
        except DataError:
            raise
        except Exception as e:
            why = f"download failed: {one_line(e)}"
    else:
        why = "download=False"
    mir = f"mirror {mirror}" if mirror is not None else "no offline mirror"
    raise DataError(f"data set '{name}' not found (looked for {local}; {mir}; {why}); place the UCI file "
                    f"{fname} in {root / UCI_DIR} or set FEDBENCH_DATA_MIRROR to an offline copy")


# ---------------------------------------------------------------------------------------------
# UCI Credit Approval, preprocessed as in the PVI repository (FedLap note §3.1).
# ---------------------------------------------------------------------------------------------
CREDIT_NUMERIC = (1, 2, 7, 10, 13, 14)
CREDIT_CATEGORICAL = (0, 3, 4, 5, 6, 8, 9, 11, 12)


CREDIT_CLASSES = ("+", "-")


def credit_arrays(path: Path, positive_class: str = "+", standardize: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """All complete rows of crx.data, shuffled and encoded: x float64 [653, 46], y int64 (positive_class = 1).

    Rows with any '?' are dropped (690 -> 653); rows are permuted with the legacy NumPy
    generator seeded 0 (``np.random.seed(0); np.random.permutation(n)``); the numeric columns
    1,2,7,10,13,14 are standardised over all rows (population std); the categorical columns
    0,3,4,5,6,8,9,11,12 are one-hot encoded (categories in sorted order, numeric block first).
    ``positive_class`` '+' (approved, 45%: the paper's "45% positive") or '-' (PVI's OrdinalEncoder, which
    sorts '+' before '-' and so codes '-' as 1). Only the label coding changes, but PVI's split gives its
    small clients mostly label-0 rows, so the two codings hand different rows to different clients.
    ``standardize=False`` keeps the numeric columns raw (A15 reaches 100000): a reading of a paper that does not state
    its preprocessing (results/gaps.md#fedlap-table1), not PVI's.
    """
    if positive_class not in CREDIT_CLASSES:
        raise FedbenchError(f"uci_credit: positive_class must be '+' or '-', got {positive_class!r}")
    import pandas as pd   # here, not at import: pandas costs every run (image sets included) ~0.3 s

    try:
        raw = pd.read_csv(path, header=None, dtype=str, keep_default_na=False).to_numpy()
    except Exception as e:
        raise DataError(f"data set 'uci_credit': cannot parse {path} ({one_line(e)}); "
                        f"replace it with a good copy") from None
    if raw.shape[1] != 16:
        raise DataError(f"data set 'uci_credit': {path} has {raw.shape[1]} columns, expected 16")
    raw = raw[~np.any(raw == "?", axis=1)]
    raw = raw[np.random.RandomState(0).permutation(len(raw))]
    num = raw[:, list(CREDIT_NUMERIC)].astype(np.float64)
    if standardize:
        num = (num - num.mean(0)) / num.std(0)
    blocks = [num]
    for j in CREDIT_CATEGORICAL:
        cats = np.unique(raw[:, j])
        blocks.append((raw[:, j][:, None] == cats[None, :]).astype(np.float64))
    x = np.concatenate(blocks, axis=1)
    y = (raw[:, 15] == positive_class).astype(np.int64)
    return x, y


@DATASETS.register("uci_credit")
def load_uci_credit(root: Path, mirror: Optional[Path], download: bool, *, num_folds: int = 5,
                    test_fold: int = 0, positive_class: str = "+", standardize: bool = True) -> FedDataset:
    """UCI Credit Approval: 653 complete rows, 46 features, test = fold ``test_fold`` of ``num_folds``.

    The folds are contiguous blocks of the shuffled rows (like sklearn's unshuffled KFold), so the
    default (5 folds, fold 0) tests on the first 131 shuffled rows and trains on the other 522.
    """
    if not (2 <= int(num_folds) and 0 <= int(test_fold) < int(num_folds)):
        raise FedbenchError(f"uci_credit: need num_folds >= 2 and 0 <= test_fold < num_folds, "
                            f"got {num_folds} and {test_fold}")
    if positive_class not in CREDIT_CLASSES:
        raise FedbenchError(f"uci_credit: positive_class must be '+' or '-', got {positive_class!r}")
    if not isinstance(standardize, bool):
        raise FedbenchError(f"uci_credit: standardize must be true or false, got {standardize!r}")
    x, y = credit_arrays(uci_file("uci_credit", "crx.data", root, mirror, download), positive_class, standardize)
    n, k = len(y), int(num_folds)
    sizes = [n // k + (1 if f < n % k else 0) for f in range(k)]
    start = sum(sizes[:int(test_fold)])
    test = np.zeros(n, dtype=bool)
    test[start:start + sizes[int(test_fold)]] = True
    f32 = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    return FedDataset(name="uci_credit", train_x=f32(x[~test]), train_y=torch.as_tensor(y[~test]),
                      test_x=f32(x[test]), test_y=torch.as_tensor(y[test]), num_classes=2,
                      task="classification", mean=None, std=None)


# ---------------------------------------------------------------------------------------------
# FLamby Fed-Heart-Disease (FedLap note §3.1): 4 hospitals, FLamby's preprocessing and split.
# ---------------------------------------------------------------------------------------------
HEART_CENTERS = ("cleveland", "hungarian", "switzerland", "va")   # hospital ids 0..3
HEART_TRAIN_FRACTION = 0.66
HEART_SPLIT_SEED = 43


def _approximate_mode(counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Per-class draw counts closest to proportional; ties in the remainders broken at random."""
    cont = counts / counts.sum() * n_draws
    floored = np.floor(cont)
    need = int(n_draws - floored.sum())
    if need > 0:
        rem = cont - floored
        for value in np.sort(np.unique(rem))[::-1]:
            (idx,) = np.where(rem == value)
            take = min(len(idx), need)
            floored[rng.choice(idx, size=take, replace=False)] += 1
            need -= take
            if need == 0:
                break
    return floored.astype(int)


def shuffle_split(n: int, train_fraction: float, seed: int,
                  stratify: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Train/test indices drawn exactly as scikit-learn's ``train_test_split`` draws them.

    Sizes: test = ceil((1 - f) n), train = floor(f n). Without ``stratify``: one permutation of
    ``RandomState(seed)``, test first. With it: per-class counts by the approximate mode, a
    permutation per class, then both sets permuted (StratifiedShuffleSplit's order of draws).
    """
    n_test = math.ceil((1.0 - train_fraction) * n)
    n_train = math.floor(train_fraction * n)
    rng = np.random.RandomState(seed)
    if stratify is None:
        perm = rng.permutation(n)
        return perm[n_test:n_test + n_train], perm[:n_test]
    classes, y_idx = np.unique(stratify, return_inverse=True)
    counts = np.bincount(y_idx)
    class_indices = np.split(np.argsort(y_idx, kind="mergesort"), np.cumsum(counts)[:-1])
    n_i = _approximate_mode(counts, n_train, rng)
    t_i = _approximate_mode(counts - n_i, n_test, rng)
    train, test = [], []
    for i in range(len(classes)):
        perm = class_indices[i].take(rng.permutation(counts[i]), mode="clip")
        train.extend(perm[:n_i[i]])
        test.extend(perm[n_i[i]:n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def heart_frames(paths: Sequence[Path]):
    """FLamby's preprocessing: per hospital, drop columns 10-12 (slope, ca, thal) and rows with
    missing values; binary label ``num > 0``; per-hospital stratified 66/34 split (seed 43,
    stratified when both classes have > 2 rows); one-hot cp and restecg with drop_first over the
    pooled data. Returns (features DataFrame, labels, hospital ids, is_train)."""
    import pandas as pd

    feats, labels, centers, is_train = [], [], [], []
    for cid, path in enumerate(paths):
        try:
            df = pd.read_csv(path, header=None, na_values="?")
            df = df.drop(columns=[10, 11, 12]).dropna(axis=0).apply(pd.to_numeric)
        except Exception as e:
            raise DataError(f"data set 'flamby_heart': cannot parse {path} ({one_line(e)}); "
                            f"replace it with a good copy") from None
        y = (df.iloc[:, -1].to_numpy() > 0).astype(np.int64)
        n = len(df)
        levels, counts = np.unique(y, return_counts=True)
        strat = y if len(levels) > 1 and np.all(counts > 2) else None
        _, test_idx = shuffle_split(n, HEART_TRAIN_FRACTION, HEART_SPLIT_SEED, strat)
        tr = np.ones(n, dtype=bool)
        tr[test_idx] = False
        feats.append(df.iloc[:, :-1])
        labels.append(y)
        centers.append(np.full(n, cid, dtype=np.int64))
        is_train.append(tr)
    x = pd.get_dummies(pd.concat(feats, ignore_index=True), columns=[2, 6], drop_first=True)
    return x.astype(np.float64), np.concatenate(labels), np.concatenate(centers), np.concatenate(is_train)


@DATASETS.register("flamby_heart")
def load_flamby_heart(root: Path, mirror: Optional[Path], download: bool, *,
                      standardize: str = "center") -> FedDataset:
    """FLamby Fed-Heart-Disease: 13 features, 486 train / 254 test over 4 hospitals (groups 0..3).

    ``standardize``: ``center`` (FLamby's federated default: each hospital's rows, train and test,
    standardised with that hospital's train mean and unbiased std), ``pooled`` (FLamby's pooled
    mode: statistics of all train rows), ``center_train_pooled_test`` (what FLamby hands a user who
    trains on ``FedHeartDisease(center=k, train=True)`` and tests on ``FedHeartDisease(train=False,
    pooled=True)``: train rows per hospital, test rows with the pooled train statistics) or ``none``
    (FLamby before it standardised at all).
    """
    modes = ("center", "pooled", "center_train_pooled_test", "none")
    if standardize not in modes:
        raise FedbenchError(f"flamby_heart: standardize must be one of {', '.join(modes)}, got '{standardize}'")
    paths = [uci_file("flamby_heart", f"processed.{c}.data", root, mirror, download) for c in HEART_CENTERS]
    df, y, centers, is_train = heart_frames(paths)
    raw = df.to_numpy()
    x = raw.copy()
    mixed = standardize == "center_train_pooled_test"
    if standardize == "pooled" or mixed:   # the pooled train statistics: every row, or the test rows only
        rows = ~is_train if mixed else slice(None)
        x[rows] = (raw[rows] - raw[is_train].mean(0)) / (raw[is_train].std(0, ddof=1) + 1e-9)
    if standardize == "center" or mixed:   # each hospital's train statistics: all its rows, or its train rows only
        for c in range(len(HEART_CENTERS)):
            tr = (centers == c) & is_train
            rows = tr if mixed else centers == c
            x[rows] = (raw[rows] - raw[tr].mean(0)) / (raw[tr].std(0, ddof=1) + 1e-9)
    f32 = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    return FedDataset(name="flamby_heart", train_x=f32(x[is_train]), train_y=torch.as_tensor(y[is_train]),
                      test_x=f32(x[~is_train]), test_y=torch.as_tensor(y[~is_train]), num_classes=2,
                      task="classification", mean=None, std=None,
                      train_groups=centers[is_train], test_groups=centers[~is_train])
