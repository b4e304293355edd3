#!/usr/bin/env python
"""Curvature cost vs one local training epoch (issue #3, "Speed").

    python scripts/bench_curvature.py                       # LeNet, 12,000 FMNIST samples, CPU/GPU
    python scripts/bench_curvature.py --samples 12000 --repeats 5 --device cpu

Times, on the same device and the same 12,000-sample client:
  * epoch: one epoch of plain local training (SGD lr 0.01 momentum 0.9, batch 64, a shuffled loop
    over in-memory tensors, cross-entropy);
  * kfac:  K-FAC with FedLPA's conventions (empirical Fisher, KFC conv scaling, dataset average);
  * kfac_gram: the same with the opt-in ``kfac_input_factor="gram"`` (conv A factors from the input Gram;
    equal to float rounding, not bit-identical);
  * diag:  the true-Fisher diagonal (exact expectation over the 10 classes, FedFisher, Fisher Merge);
  * diag_mc: the MC-Fisher diagonal, one sampled label per sample (``fisher: mc``, e.g. FedLap-Cov's option);
  * diag_emp: the empirical-Fisher diagonal (true labels; FOLA, FedCurv, online Fisher);
and prints each time and the ratios ``<job>/epoch``, then each job's FLOPs (``torch.utils.flop_counter``), the
GFLOP/s it ran at, and its FLOP ratio to the epoch: the time ratio it would have at equal efficiency (K-FAC's conv
factors and the true Fisher's 10 per-class backward passes do several epochs' worth of arithmetic). The three are run in
interleaved rounds; the reported time is the median over ``--repeats`` rounds (the minimum is
printed too, since the shared CPU machines are noisy). Data: the first N Fashion-MNIST training
images when the data set can be loaded offline, else random N(0, 1) images (said in the output).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fedbench.curvature import compute_curvature  # noqa: E402


def lenet() -> nn.Module:
    try:
        from fedbench.models import build_model
        return build_model("lenet", input_shape=(1, 28, 28), num_classes=10)
    except Exception:  # models not importable: FedFisher's bias-free LeNet, defined here
        return nn.Sequential(
            nn.Conv2d(1, 6, 5, bias=False), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, bias=False), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(256, 120, bias=False), nn.ReLU(), nn.Linear(120, 84, bias=False), nn.ReLU(),
            nn.Linear(84, 10, bias=False))


def client_data(n: int, root: str, device):
    try:
        from fedbench.data import load_dataset
        ds = load_dataset("fmnist", root, download=False)
        x = ds.train_x[:n].float().div_(255.0)
        x = (x - ds.mean[0]) / ds.std[0]
        return x.to(device), ds.train_y[:n].long().to(device), f"Fashion-MNIST (first {n} training images)"
    except Exception as e:  # noqa: BLE001
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
        return x.to(device), y.to(device), f"random N(0,1) images ({type(e).__name__}: FMNIST not loadable)"


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_epoch(model, x, y, gen, batch_size=64):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    perm = torch.randperm(x.shape[0], generator=gen).to(x.device)
    for b in perm.split(batch_size):
        loss = F.cross_entropy(model(x[b]), y[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=12000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=None, help="curvature chunk size (default per device)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data-root", default=os.environ.get("FEDBENCH_DATA", "data"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--extra", action="store_true",
                    help="also time the true-Fisher K-FAC (FedFisher) and the GGN K-FAC (FedBEns) through the hooks "
                         "engine and through curvlinops")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    bs = args.batch_size or (4096 if dev.type == "cuda" else 512)

    torch.manual_seed(0)
    model = lenet().to(dev)
    x, y, what = client_data(args.samples, args.data_root, dev)
    gen = torch.Generator().manual_seed(0)
    print(f"device: {dev} ({torch.get_num_threads()} CPU threads); data: {what}; model: LeNet "
          f"({sum(p.numel() for p in model.parameters())} params); curvature chunk {bs}")
    train_epoch(model, x, y, gen)          # warm-up, and weights that have seen some training

    jobs = {
        "epoch": lambda: train_epoch(model, x, y, gen),
        "kfac": lambda: compute_curvature(model, x, y, structure="kfac", fisher="empirical",
                                          conv_convention="fedlpa_kfc", scale="mean", batch_size=bs),
        "kfac_gram": lambda: compute_curvature(model, x, y, structure="kfac", fisher="empirical",
                                               conv_convention="fedlpa_kfc", scale="mean", batch_size=bs,
                                               kfac_input_factor="gram"),
        "diag": lambda: compute_curvature(model, x, y, structure="diag", fisher="true", scale="mean",
                                          batch_size=bs),
        "diag_mc": lambda: compute_curvature(model, x, y, structure="diag", fisher="mc", scale="mean",
                                             batch_size=bs, generator=torch.Generator().manual_seed(0)),
        "diag_emp": lambda: compute_curvature(model, x, y, structure="diag", fisher="empirical", scale="mean",
                                              batch_size=bs),
    }
    if args.extra:
        jobs["kfac_true"] = lambda: compute_curvature(model, x, y, structure="kfac", fisher="true",
                                                      conv_convention="nngeometry", scale="mean", batch_size=bs)
        jobs["kfac_ggn"] = lambda: compute_curvature(model, x, y, structure="kfac", fisher="ggn",
                                                     conv_convention="expand", scale="sum", batch_size=bs)
        jobs["kfac_ggn_cl"] = lambda: compute_curvature(model, x, y, structure="kfac", fisher="ggn",
                                                        conv_convention="expand", scale="sum", batch_size=bs,
                                                        backend="curvlinops")
    for fn in jobs.values():               # warm-up (allocator, kernels)
        fn()
    times = {k: [] for k in jobs}
    for _ in range(args.repeats):
        for k, fn in jobs.items():
            sync(dev)
            t = time.perf_counter()
            fn()
            sync(dev)
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    mn = {k: min(v) for k, v in times.items()}
    for k in jobs:
        print(f"{k:11s} median {med[k]:.3f} s   min {mn[k]:.3f} s   all {[round(t, 3) for t in times[k]]}")
    for k in [j for j in jobs if j != "epoch"]:
        print(f"{k}/epoch = {med[k] / med['epoch']:.2f}x (median)   {mn[k] / mn['epoch']:.2f}x (min)")
    flops = count_flops(jobs)
    print("work (torch.utils.flop_counter: matmuls and convolutions) and the rate it ran at; 'FLOP floor' is the time "
          "ratio to one epoch if both ran at the same GFLOP/s:")
    for k in jobs:
        print(f"{k:11s} {flops[k] / 1e9:8.2f} GFLOP  {flops[k] / 1e9 / med[k]:6.1f} GFLOP/s" +
              ("" if k == "epoch" else f"   FLOP floor {flops[k] / flops['epoch']:.2f}x epoch"))


def count_flops(jobs) -> dict:
    """FLOPs of one call of each job (matmul and convolution FLOPs, as torch counts them)."""
    from torch.utils.flop_counter import FlopCounterMode
    out = {}
    for k, fn in jobs.items():
        with FlopCounterMode(display=False) as counter:
            fn()
        out[k] = counter.get_total_flops()
    return out


if __name__ == "__main__":
    main()
