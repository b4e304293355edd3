"""The validation split of a tuning selection run (``tuning_val``): carved from the training data, never the test set."""
from __future__ import annotations

from dataclasses import replace
from typing import Tuple

import numpy as np
import torch

from fedbench.data.base import FedDataset
from fedbench.errors import FedbenchError


def validation_indices(n_train: int, fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(validation, kept) indices into the training set: a seeded ``fraction`` of it (at least one point), sorted."""
    n_val = max(1, int(round(fraction * n_train)))
    if n_val >= n_train:
        raise FedbenchError(f"tuning_val.fraction={fraction} leaves no training data ({n_train} training points)")
    perm = np.random.default_rng(seed).permutation(n_train)
    return np.sort(perm[:n_val]), np.sort(perm[n_val:])


def hold_out_validation(data: FedDataset, fraction: float, seed: int) -> FedDataset:
    """The data set a selection run sees: the kept training points train, the held-out ones are evaluated on in place
    of the test set, and the test set itself is dropped, so nothing of it can reach a selection."""
    val, keep = validation_indices(len(data.train_y), fraction, seed)
    groups = None if data.train_groups is None else np.asarray(data.train_groups)
    vi, ki = torch.as_tensor(val), torch.as_tensor(keep)
    return replace(data, train_x=data.train_x[ki], train_y=data.train_y[ki],
                   train_groups=None if groups is None else groups[keep],
                   test_x=data.train_x[vi], test_y=data.train_y[vi],
                   test_groups=None if groups is None else groups[val])
