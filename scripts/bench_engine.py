#!/usr/bin/env python
"""Local-training speed: serial, serial channels-last and batched engine vs a plain per-client DataLoader loop.

    python scripts/bench_engine.py --dataset fmnist --model lenet --clients 10 --epochs 2

Backends: plain, serial, serial_nhwc (serial with hardware.memory_format=channels_last), batched.
Prints wall time per backend and the ratio against the plain loop (a torch DataLoader over
the client's samples, a deep-copied model per client, torch.optim.SGD), on this machine.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fedbench.data import load_dataset  # noqa: E402
from fedbench.models import build_model  # noqa: E402
from fedbench.partition import make_partition  # noqa: E402
from fedbench.train.config import LocalTrainConfig  # noqa: E402
from fedbench.train.engine import TrainData, train_clients  # noqa: E402
from fedbench.train.stacked import choose_conv_strategies  # noqa: E402


def plain_loop(model, data: TrainData, parts, cfg: LocalTrainConfig, seed: int):
    """The baseline most FL code runs: DataLoader per client, model copy per client."""
    out = []
    for k, idx in enumerate(parts):
        torch.manual_seed(seed + k)
        ds = torch.utils.data.TensorDataset(data.inputs(idx), data.y[idx])
        dl = torch.utils.data.DataLoader(ds, batch_size=cfg.batch_size, shuffle=True)
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        for _ in range(cfg.epochs):
            for x, y in dl:
                loss = torch.nn.functional.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        out.append({n: p.detach() for n, p in m.named_parameters()})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.5, help="noniid-labeldir concentration")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data-root", default=os.environ.get("FEDBENCH_DATA", "data"))
    ap.add_argument("--backends", default="plain,serial,serial_nhwc,batched")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dev = torch.device(args.device)
    if args.dataset.startswith("synthetic:"):   # e.g. synthetic:fmnist — same shape, random pixels (timing only)
        data = load_dataset("synthetic", args.data_root, like=args.dataset.split(":", 1)[1])
    else:
        data = load_dataset(args.dataset, args.data_root)
    parts = make_partition("noniid-labeldir", np.asarray(data.train_y), args.clients, args.seed, beta=args.beta)
    data = data.to(dev)
    td = TrainData(data.train_x, data.train_y, data.mean, data.std)
    torch.manual_seed(args.seed)
    model = build_model(args.model, input_shape=tuple(data.input_shape), num_classes=data.num_classes).to(dev)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = LocalTrainConfig(lr=0.01, momentum=0.9, batch_size=args.batch_size, epochs=args.epochs)
    idx = [torch.as_tensor(p, device=dev) for p in parts]
    print(f"{args.dataset} / {args.model}: {args.clients} clients x {args.epochs} epochs, batch {args.batch_size}, "
          f"{len(data.train_y)} samples, device {dev}, torch threads {torch.get_num_threads()}")
    if "batched" in args.backends:
        strat = choose_conv_strategies(model, tuple(data.input_shape), args.clients, args.batch_size, dev)
        print(f"batched conv kernels chosen by measurement: {strat}")
    times = {}
    for name in args.backends.split(","):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if name == "plain":
            plain_loop(model, td, idx, cfg, args.seed)
        else:
            fmt = "channels_last" if name == "serial_nhwc" else "contiguous"
            train_clients(model, td, idx, start, cfg, backend=name.split("_")[0], seed=args.seed, memory_format=fmt)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times[name] = time.perf_counter() - t0
        print(f"  {name:8s} {times[name]:8.2f} s")
    base = times.get("plain")
    if base:
        print("ratio vs plain DataLoader loop (lower is faster): " +
              ", ".join(f"{k} {v / base:.2f}x" for k, v in times.items()))
    if "serial" in times and "batched" in times:
        print(f"batched / serial = {times['batched'] / times['serial']:.2f}x")
    if "serial" in times and "serial_nhwc" in times:
        print(f"serial_nhwc / serial = {times['serial_nhwc'] / times['serial']:.2f}x")


if __name__ == "__main__":
    main()
