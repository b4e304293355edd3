#!/usr/bin/env python
"""How close local training runs to this machine's limit: achieved GFLOP/s of a training step (forward, backward,
SGD update) against the peak fp32 GFLOP/s the script measures itself (a square matmul), per model, one thread.

    python scripts/bench_throughput.py                 # SimpleCNN and LeNet, batch 64, 1 thread
    python scripts/bench_throughput.py --threads 2 --batch-size 128

FLOPs are counted by torch.utils.flop_counter on one step (matmuls and convolutions, forward and backward), so the
ratio is what the arithmetic needs over what the machine can do; prints numbers, never pass/fail.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from fedbench.models import build_model  # noqa: E402

SHAPES = {"simple_cnn": (1, 28, 28), "lenet": (1, 28, 28)}


def peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best of ``repeats`` fp32 n×n matmuls (2n³ FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b   # warm-up
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_fn(model, x, y, opt):
    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def training_gflops(name: str, batch: int, steps: int) -> tuple:
    """(GFLOP per step, achieved GFLOP/s: the best of 3 timings of ``steps`` steps)."""
    torch.manual_seed(0)
    shape = SHAPES[name]
    model = build_model(name, input_shape=shape, num_classes=10)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = step_fn(model, x, y, opt)
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    for _ in range(3):   # warm-up
        step()
    best = min(_timed(lambda: [step() for _ in range(steps)]) for _ in range(3))
    return flops / 1e9, flops * steps / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="simple_cnn,lenet")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    peak = peak_gflops()
    print(f"peak (2048² fp32 matmul, {args.threads} thread(s)): {peak:.1f} GFLOP/s")
    print("| model | batch | GFLOP per step | achieved GFLOP/s | % of peak |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        per_step, achieved = training_gflops(name, args.batch_size, args.steps)
        print(f"| {name} | {args.batch_size} | {per_step:.4f} | {achieved:.1f} | {100 * achieved / peak:.0f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
