"""Generated data sets: a same-shape stand-in for any image set, and FedFisher's regression generator."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedbench.data.base import DATASETS, FedDataset
from fedbench.data.images import SHAPES, STATS
from fedbench.errors import FedbenchError

# Image model of the stand-in: every class c has a random low-resolution pattern P_c
# (C x 4 x 4, N(0, s^2) with s = _PROTO / sqrt(C), so the class separation does not grow with the
# number of channels); an image of class c is
#     x = 128 + 40 * up(P_c + NUISANCE * Z) + 32 * eps,     Z ~ N(0,1) at 4x4, eps ~ N(0,1) per pixel,
# bilinearly upsampled to H x W, rounded and clipped to uint8. The per-image nuisance Z lives in the
# same low-resolution space as the class signal, so the classes overlap: a nearest-class-mean rule
# gets well above chance but far from 100% (a test checks the range).
_GRID = 4
_PROTO = 1.2
_SIGNAL = 40.0
_NUISANCE = 1.6
_PIXEL_NOISE = 32.0
_CHUNK = 8192


def _images(n: int, labels: torch.Tensor, protos: torch.Tensor, hw, g: torch.Generator) -> torch.Tensor:
    c = protos.shape[1]
    out = torch.empty((n, c, *hw), dtype=torch.uint8)
    for s in range(0, n, _CHUNK):
        y = labels[s:s + _CHUNK]
        low = protos[y] + _NUISANCE * torch.randn((len(y), c, _GRID, _GRID), generator=g)
        img = 128.0 + _SIGNAL * F.interpolate(low, size=hw, mode="bilinear", align_corners=False)
        img += _PIXEL_NOISE * torch.randn(img.shape, generator=g)
        out[s:s + _CHUNK] = img.round_().clamp_(0, 255).to(torch.uint8)
    return out


def _balanced_labels(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return (torch.arange(n) % k)[torch.randperm(n, generator=g)]


@DATASETS.register("synthetic")
def load_synthetic(root: Path, mirror: Optional[Path], download: bool, *, like: str = "cifar10",
                   train_size: Optional[int] = None, test_size: Optional[int] = None,
                   seed: int = 0) -> FedDataset:
    """Random uint8 images with the shape, class count and (by default) split sizes of ``like``.

    Labels are balanced; each class has its own low-frequency mean pattern, so models learn
    well above chance. Normalisation statistics are those of ``like`` so that every pipeline
    stage runs exactly as on the real set. Needs no files.
    """
    if like not in SHAPES:
        raise FedbenchError(f"synthetic: unknown like='{like}'; choose one of: {', '.join(sorted(SHAPES))}")
    (c, h, w), k, n_train, n_test = SHAPES[like]
    n_train = n_train if train_size is None else int(train_size)
    n_test = n_test if test_size is None else int(test_size)
    if n_train < 1 or n_test < 1:
        raise FedbenchError(f"synthetic: train_size and test_size must be >= 1, got {n_train} and {n_test}")
    g = torch.Generator().manual_seed(int(seed))
    protos = torch.randn((k, c, _GRID, _GRID), generator=g) * (_PROTO / c ** 0.5)
    y_tr, y_te = _balanced_labels(n_train, k, g), _balanced_labels(n_test, k, g)
    x_tr = _images(n_train, y_tr, protos, (h, w), g)
    x_te = _images(n_test, y_te, protos, (h, w), g)
    mean, std = STATS[like]
    return FedDataset(name="synthetic", train_x=x_tr, train_y=y_tr, test_x=x_te, test_y=y_te,
                      num_classes=k, task="classification", mean=mean, std=std)


# ---------------------------------------------------------------------------------------------
# FedFisher §1.8 (Sec. 3 / App. D.1): a FedProx-style regression generator, p = 2.
# ---------------------------------------------------------------------------------------------
def fedfisher_synthetic_arrays(num_clients: int = 2, n_per_client: int = 100, seed: int = 0,
                               n_test_per_client: Optional[int] = None):
    """Draw the data as numpy arrays; returns (x_tr, y_tr, g_tr, x_te, y_te, g_te, w) with w the teachers.

    For client i: scalars u_i, B_i ~ N(0,1); teacher w_i ~ N(u_i 1, I_2); centre b_i ~ N(B_i 1, I_2);
    x~ ~ N(b_i, diag(1, 2^-1.2)); x = x~ / ||x~||_2; y = w_i^T x (noiseless).
    The test set is a fresh draw of n_test_per_client points (default: n_per_client) from the same
    clients' distributions (same w_i, b_i), drawn after all training points.
    """
    p = 2
    n_test = n_per_client if n_test_per_client is None else int(n_test_per_client)
    rng = np.random.default_rng(int(seed))
    sigma_sd = np.sqrt(np.arange(1, p + 1, dtype=np.float64) ** -1.2)  # Sigma = diag(j^-1.2)
    teachers, centres = [], []
    for _ in range(num_clients):
        u, b_scalar = rng.standard_normal(2)
        teachers.append(u + rng.standard_normal(p))
        centres.append(b_scalar + rng.standard_normal(p))

    def draw(n):
        xs, ys, gs = [], [], []
        for i in range(num_clients):
            xt = centres[i] + sigma_sd * rng.standard_normal((n, p))
            x = xt / np.linalg.norm(xt, axis=1, keepdims=True)
            xs.append(x)
            ys.append(x @ teachers[i])
            gs.append(np.full(n, i, dtype=np.int64))
        return np.concatenate(xs), np.concatenate(ys), np.concatenate(gs)

    x_tr, y_tr, g_tr = draw(n_per_client)
    x_te, y_te, g_te = draw(n_test)
    return x_tr, y_tr, g_tr, x_te, y_te, g_te, np.stack(teachers)


@DATASETS.register("fedfisher_synthetic")
def load_fedfisher_synthetic(root: Path, mirror: Optional[Path], download: bool, *, num_clients: int = 2,
                             n_per_client: int = 100, seed: int = 0,
                             n_test_per_client: Optional[int] = None) -> FedDataset:
    """FedFisher's synthetic regression data (M clients x n points, p=2); groups = client ids."""
    if int(num_clients) < 1 or int(n_per_client) < 1 or (n_test_per_client is not None and int(n_test_per_client) < 1):
        raise FedbenchError("fedfisher_synthetic: num_clients, n_per_client and n_test_per_client must be >= 1")
    x_tr, y_tr, g_tr, x_te, y_te, g_te, _ = fedfisher_synthetic_arrays(
        int(num_clients), int(n_per_client), seed, n_test_per_client)
    f32 = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    return FedDataset(name="fedfisher_synthetic", train_x=f32(x_tr), train_y=f32(y_tr), test_x=f32(x_te),
                      test_y=f32(y_te), num_classes=0, task="regression", mean=None, std=None,
                      train_groups=g_tr, test_groups=g_te)
