#!/usr/bin/env python
"""FOLA §IV-E (Figs. 10-11): full / e-full / diagonal Laplace (online, offline) and FedAvg on softmax
regression 784-10 with two MNIST clients holding classes {0-4} and {5-9} (fola.md §3.3-3.4, §6 R7).
The presets fola/figure10, figure11 and figure12 (``make reproduce EXP=fola/figure10``) run the same study
from a fedbench config and keep run records; this script is the standalone version.

    python scripts/fola_laplace_study.py --data-root data --out results/fola_laplace
    python scripts/fola_laplace_study.py --max-per-client 1000 --rounds 3 --methods full_online diag_online fedavg

Writes ``fola_laplace_rounds.csv`` (per method and round: global accuracy/NLL of the aggregated model,
local accuracy Σπ_n acc(θ_n), cosine similarity of the normalised client precisions),
``fola_laplace_sweep.csv`` (GA along the π₁ ∈ [0, 1] aggregation curves at the sweep rounds),
``fola_laplace_heatmap_<method>.pt`` and, unless --no-plot, ``fola_laplace_fig10.png`` /
``fola_laplace_fig11.png``. The full Hessian is 7,850² (0.5 GB in float64); each client-round costs
≈ 2·100·785²·N_k flops (≈ 4 TFLOP at N_k = 30,000), an eigendecomposition for e-full and one for each
dense π₁ sweep: seconds on a GPU, long on a laptop CPU (use --max-per-client there).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fedbench.data import load_dataset  # noqa: E402
from fedbench.errors import FedbenchError  # noqa: E402
from fedbench.papers.fola import laplace_study as fl  # noqa: E402


def client_split(labels: np.ndarray, seed: int):
    """{0-4} / {5-9}: the ``disjoint_classes`` partition, or the classes selected directly."""
    try:
        from fedbench.partition import make_partition
        return make_partition("disjoint_classes", labels, 2, seed, num_classes=10)
    except (ImportError, KeyError, FedbenchError):
        return [np.flatnonzero(labels < 5), np.flatnonzero(labels >= 5)]


def flat_inputs(x: torch.Tensor, mean, std) -> torch.Tensor:
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    if mean is not None:
        x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
    return x.reshape(x.shape[0], -1)


def plot(rounds, sweep, heatmaps, out: Path) -> None:
    from fedbench.papers.fola.figures import plot_fig10, plot_fig11

    title = "FOLA §IV-E study (scripts/fola_laplace_study.py)"
    plot_fig10(rounds, sweep, heatmaps, out / "fola_laplace_fig10.png", title)
    plot_fig11(rounds, out / "fola_laplace_fig11.png", title)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default=os.environ.get("FEDBENCH_DATA", "data"))
    ap.add_argument("--out", default="results/fola_laplace")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=200)
    ap.add_argument("--lambda-prior", type=float, default=1.0)
    ap.add_argument("--prior-precision", type=float, default=0.0)
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--pi1", type=float, default=None, help="between-round weight of client 1 (default: data sizes)")
    ap.add_argument("--sweep-points", type=int, default=101)
    ap.add_argument("--sweep-rounds", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--methods", nargs="+", default=list(fl.METHODS), choices=list(fl.METHODS))
    ap.add_argument("--max-per-client", type=int, default=0, help="random subset per client (0 = all)")
    ap.add_argument("--init", choices=["model", "zeros"], default="model",
                    help="model: fedbench's softmax_regression initialisation under --seed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    try:
        cfg = fl.StudyConfig(rounds=args.rounds, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                             lambda_prior=args.lambda_prior, prior_precision=args.prior_precision, eps=args.eps,
                             pi1=args.pi1, sweep_points=args.sweep_points, sweep_rounds=tuple(args.sweep_rounds),
                             methods=tuple(args.methods), seed=args.seed)
        cfg.validate()
        data = load_dataset("mnist", args.data_root)
    except FedbenchError as e:
        print(f"fola_laplace_study: error: {e}", file=sys.stderr)
        return 2
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    labels = np.asarray(data.train_y)
    parts = client_split(labels, args.seed)
    rng = np.random.default_rng(args.seed)
    if args.max_per_client:
        parts = [np.sort(rng.choice(p, size=min(args.max_per_client, len(p)), replace=False)) for p in parts]
    xtr = flat_inputs(data.train_x, data.mean, data.std)
    xte = flat_inputs(data.test_x, data.mean, data.std)
    clients = [(xtr[torch.as_tensor(p)].to(dev, dt), data.train_y[torch.as_tensor(p)].long().to(dev)) for p in parts]
    test = (xte.to(dev, dt), data.test_y.long().to(dev))
    init = (fl.initial_theta(args.seed, xtr.shape[1], 10) if args.init == "model"
            else torch.zeros(10 * (xtr.shape[1] + 1))).to(dev, dt)
    print(f"fola_laplace_study: clients {[len(p) for p in parts]} samples, device {dev}, {args.dtype}")
    t0 = time.perf_counter()

    def log(row):
        print(f"  [{time.perf_counter() - t0:7.1f}s] {row['method']:>13} round {row['round']:>2}: "
              f"GA {row['global_accuracy']:.4f}  LA {row['local_accuracy']:.4f}  cos {row['precision_cosine']:.3f}")

    res = fl.run_study(clients, test, cfg, init=init, num_classes=10, log=log)

    import pandas as pd
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = pd.DataFrame(res.rounds)
    sweep = pd.DataFrame(res.sweep)
    rounds.to_csv(out / "fola_laplace_rounds.csv", index=False)
    sweep.to_csv(out / "fola_laplace_sweep.csv", index=False)
    for name, h in res.heatmaps.items():
        torch.save(h, out / f"fola_laplace_heatmap_{name}.pt")
    if not args.no_plot:
        plot(rounds, sweep, res.heatmaps, out)
    print(f"fola_laplace_study: wrote {out}/fola_laplace_rounds.csv, fola_laplace_sweep.csv"
          + ("" if args.no_plot else ", fola_laplace_fig10.png, fola_laplace_fig11.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
