"""FedLPA Fig. 3 (App. D.1): the full empirical Fisher of a small 3-conv + 1-FC net trained on MNIST beside its
block-diagonal K-FAC approximation (FedLPA's), as heat maps with the relative Frobenius error.

Notes: fedlpa.md §4 "Fig. 3": "a network with 3 conv + 1 FC layers trained on MNIST (an architecture different from
the simple CNN)"; the paper gives no layer sizes, training settings or data size. [I] fedbench's net is made tiny so
that the full P×P Fisher is cheap: conv 1→4, 4→6, 6→8 (3×3, padding 1, each followed by ReLU and 2×2 max-pooling:
28→14→7→3) and a linear 72→10 head, 1,432 parameters. It is trained briefly (SGD) on an MNIST subset, and both
curvatures are computed with ``fedbench.curvature.compute_curvature`` on held-out training images at the trained
weights: ``structure="full"`` and FedLPA's K-FAC (``fedbench.algorithms.fedlpa.CURVATURE``: empirical Fisher,
dataset mean, convention ``fedlpa_kfc``, bias folded into A), undamped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple
import textwrap
import io

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fedbench.curvature import compute_curvature
from fedbench.algorithms.fedlpa import CURVATURE
from fedbench.data import load_dataset

CHANNELS = (4, 6, 8)


def tiny_cnn(in_channels: int = 1, image_size: int = 28, num_classes: int = 10,
             channels: Sequence[int] = CHANNELS) -> nn.Sequential:
    """3 × (3×3 conv, padding 1 → ReLU → 2×2 max-pool) → flatten → linear."""
    layers, c, s = [], in_channels, image_size
    for out in channels:
        layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c, s = out, s // 2
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(c * s * s, num_classes))


def train(model: nn.Module, x: Tensor, y: Tensor, *, epochs: int = 2, lr: float = 0.05, momentum: float = 0.9,
          batch_size: int = 128, seed: int = 0) -> List[float]:
    """Plain SGD with momentum; returns the mean training loss of each epoch."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    model.train()
    for _ in range(epochs):
        total = 0.0
        for b in torch.split(torch.randperm(len(x), generator=gen), batch_size):
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
        losses.append(total / len(x))
    return losses


def layer_slices(model: nn.Module) -> List[Tuple[str, slice]]:
    """(layer label, its rows/columns in the flat parameter order) for every layer with parameters:
    conv1, conv2, ... and fc1, ... in module order."""
    out, start, counts = [], 0, {}
    for mod in model.modules():
        n = sum(p.numel() for p in mod.parameters(recurse=False))
        if n:
            kind = "conv" if isinstance(mod, nn.Conv2d) else "fc"
            counts[kind] = counts.get(kind, 0) + 1
            out.append((f"{kind}{counts[kind]}", slice(start, start + n)))
            start += n
    return out


def fisher_pair(model: nn.Module, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
    """(full empirical Fisher, FedLPA's K-FAC as a dense block-diagonal matrix), both (1/N) Σ_n, P×P."""

    full = compute_curvature(model, x, y, structure="full", fisher="empirical", scale="mean").to_dense()
    kfac = compute_curvature(model, x, y, **CURVATURE).to_dense()
    return full, kfac


def block_diagonal(matrix: Tensor, slices: Sequence[Tuple[str, slice]]) -> Tensor:
    """``matrix`` with every entry outside the layers' diagonal blocks set to 0."""
    out = torch.zeros_like(matrix)
    for _, s in slices:
        out[s, s] = matrix[s, s]
    return out


def relative_frobenius(approx: Tensor, exact: Tensor) -> float:
    return float(torch.linalg.norm(approx - exact) / torch.linalg.norm(exact))


def mnist_tensors(data_root: str, n_train: int, n_fisher: int, seed: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Normalised MNIST: ``n_train`` training images to fit on, ``n_fisher`` other training images for the Fisher."""

    data = load_dataset("mnist", data_root)
    idx = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(seed))[: n_train + n_fisher]
    mean, std = torch.tensor(data.mean).view(1, -1, 1, 1), torch.tensor(data.std).view(1, -1, 1, 1)
    x = (data.train_x[idx].float() / 255.0 - mean) / std
    y = data.train_y[idx].long()
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def fedlpa_fig3_numbers(data_root: str = "data", *, n_train: int = 6_000, n_fisher: int = 1_000, epochs: int = 2,
                        seed: int = 0) -> Dict[str, object]:
    """Train the tiny net, compute both Fishers; returns the matrices, the layer slices and the errors."""
    xt, yt, xf, yf = mnist_tensors(data_root, n_train, n_fisher, seed)
    torch.manual_seed(seed)
    model = tiny_cnn()
    losses = train(model, xt, yt, epochs=epochs, seed=seed)
    with torch.no_grad():
        acc = float((model(xf).argmax(1) == yf).float().mean())
    full, kfac = fisher_pair(model, xf, yf)
    slices = layer_slices(model)
    return {"full": full, "kfac": kfac, "slices": slices, "train_losses": losses, "heldout_accuracy": acc,
            "num_params": full.shape[0], "kfac_error": relative_frobenius(kfac, full),
            "blockdiag_error": relative_frobenius(block_diagonal(full, slices), full)}


def figure_fedlpa3(path, **kw) -> Dict[str, object]:
    """Heat maps of |F| (full), |K-FAC| and |F − K-FAC| on one log colour scale, layer boundaries marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    r = fedlpa_fig3_numbers(**kw)
    full, kfac = r["full"].abs().numpy(), r["kfac"].abs().numpy()
    vmax = float(full.max())
    norm = LogNorm(vmin=vmax * 1e-5, vmax=vmax)
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.9))
    fig.subplots_adjust(left=0.03, right=0.93, top=0.86, bottom=0.2, wspace=0.08)
    panels = [("full empirical Fisher |F|", full),
              (f"FedLPA's block-diagonal K-FAC |K|\n‖K − F‖_F / ‖F‖_F = {r['kfac_error']:.3f}", kfac),
              ("|F − K|", np.abs(full - kfac))]
    for ax, (title, m) in zip(axes, panels):
        im = ax.imshow(np.maximum(m, vmax * 1e-5), norm=norm, cmap="magma", interpolation="antialiased")
        for _, s in r["slices"][1:]:
            ax.axhline(s.start - 0.5, color="cyan", lw=0.5)
            ax.axvline(s.start - 0.5, color="cyan", lw=0.5)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([(s.start + s.stop) / 2 for _, s in r["slices"]], [n for n, _ in r["slices"]], fontsize=7,
                      rotation=90)
        ax.set_yticks([])
    cax = fig.add_axes([0.94, 0.2, 0.012, 0.66])
    fig.colorbar(im, cax=cax)
    fig.suptitle("FedLPA Fig. 3: full empirical Fisher vs its block-diagonal K-FAC approximation (MNIST, 3 conv + 1 FC)",
                 fontsize=10)
    text = (f"fedbench's net (the paper gives no sizes): conv 1→4, 4→6, 6→8 (3×3, ReLU, 2×2 max-pool) + linear 72→10, "
            f"{r['num_params']} parameters, trained {len(r['train_losses'])} epochs of SGD (batch 128, lr 0.05, momentum 0.9) on {kw.get('n_train', 6_000)} "
            f"MNIST images (held-out accuracy {100 * r['heldout_accuracy']:.1f} %); both curvatures on "
            f"{kw.get('n_fisher', 1_000)} other training images, (1/N)Σ_n, undamped, via compute_curvature "
            f"(structure full; FedLPA's kfac, convention fedlpa_kfc). Cyan lines: layer blocks (weights then bias "
            f"per layer). Relative Frobenius error of K-FAC: {r['kfac_error']:.3f}; of the exact block diagonal of F "
            f"(what any layer-wise approximation drops): {r['blockdiag_error']:.3f}.")
    fig.text(0.01, 0.01, textwrap.fill(text, 205), fontsize=7.5, ha="left", va="bottom")
    save_quantized(fig, path)
    plt.close(fig)
    return r


def save_quantized(fig, path, colors: int = 96) -> None:
    """PNG with an adaptive palette: heat maps of 1,432² noisy entries compress badly in RGB (~650 KB)."""

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    buf.seek(0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.open(buf).convert("RGB").quantize(colors=colors).save(path, optimize=True)
