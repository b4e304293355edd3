#!/usr/bin/env python
"""How close local training runs to this machine's limit: achieved GFLOP/s of a training step (forward, backward,
SGD update) against the peak fp32 GFLOP/s the script measures itself (a square matmul), per model, one thread.

    python scripts/bench_throughput.py                 # SimpleCNN and LeNet, batch 64, 1 thread
    python scripts/bench_throughput.py --threads 2 --batch-size 128
    python scripts/bench_throughput.py --compile       # also torch.compile the whole step (prints compile time)

Variants per model: ``contiguous`` (the default NCHW step, what the serial backend runs), ``channels_last`` (NHWC
model and batch, ``hardware.memory_format=channels_last``) and, with --compile, ``compiled`` (torch.compile of
forward + backward + SGD step). Each repeat round times every variant and the peak matmul back to back, so the
% of peak of a round uses a peak measured under the same load; the table shows medians over --repeats rounds.
FLOPs are counted by torch.utils.flop_counter on one step (matmuls and convolutions, forward and backward), so the
ratio is what the arithmetic needs over what the machine can do; prints numbers, never pass/fail. A last table
prints the ceiling the layer shapes allow: the step's products timed as plain matmuls of the same shapes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from fedbench.models import build_model  # noqa: E402

SHAPES = {"simple_cnn": (1, 28, 28), "lenet": (1, 28, 28)}


def matmul_seconds(n: int = 2048, repeats: int = 3) -> float:
    """Best of ``repeats`` fp32 n×n matmuls (2n³ FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b   # warm-up
    return min(_timed(lambda: a @ b) for _ in range(repeats))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_step(name: str, batch: int, variant: str):
    """(step function, compile seconds or 0) for one model and variant, on fixed random data."""
    torch.manual_seed(0)
    shape = SHAPES[name]
    model = build_model(name, input_shape=shape, num_classes=10)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    if variant == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)   # as the serial engine

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    if variant != "compiled":
        return step, 0.0
    compiled = torch.compile(step)
    t0 = time.perf_counter()
    compiled()   # the first two calls compile (the second one the momentum-buffer branch)
    compiled()
    return compiled, time.perf_counter() - t0


def gemm_shapes(name: str, batch: int):
    """The matrix products a training step's convolutions and linear layers amount to (im2col form), as
    (label, M, K, N): forward out[M, N] = in[M, K] · W[K, N], weight gradient (N×M)·(M×K), input gradient (M×N)·(N×K)
    except for the first layer (its input needs no gradient)."""
    model = build_model(name, input_shape=SHAPES[name], num_classes=10)
    shapes, first = [], [True]

    def hook(mod, inp, out):
        if isinstance(mod, torch.nn.Conv2d):
            m, k, n = out.shape[0] * out.shape[2] * out.shape[3], inp[0].shape[1] * mod.weight[0, 0].numel(), out.shape[1]
        else:
            m, k, n = inp[0].numel() // inp[0].shape[-1], inp[0].shape[-1], out.shape[-1]
        shapes.append((f"{mod._fb_name} fwd", m, k, n))
        shapes.append((f"{mod._fb_name} dW", n, m, k))
        if not first[0]:
            shapes.append((f"{mod._fb_name} dX", m, n, k))
        first[0] = False

    for mname, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Conv2d, torch.nn.Linear)):
            mod._fb_name = mname
            mod.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.randn(batch, *SHAPES[name]))
    return shapes


def gemm_ceiling(name: str, batch: int, repeats: int = 20):
    """(GFLOP, seconds in the default orientation, seconds in the faster of C = A·B and Cᵀ = Bᵀ·Aᵀ) of the step's
    products as plain contiguous matmuls: the rate a step could reach if its arithmetic were all it cost."""
    flop = plain = best = 0.0
    for _, m, k, n in gemm_shapes(name, batch):
        a, b = torch.randn(m, k), torch.randn(k, n)
        at, bt = torch.randn(n, k), torch.randn(k, m)
        t_ab = min(_timed(lambda: [a @ b for _ in range(repeats)]) for _ in range(3)) / repeats
        t_ba = min(_timed(lambda: [at @ bt for _ in range(repeats)]) for _ in range(3)) / repeats
        flop, plain, best = flop + 2 * m * k * n, plain + t_ab, best + min(t_ab, t_ba)
    return flop / 1e9, plain, best


def step_gflop(name: str, batch: int) -> float:
    step, _ = make_step(name, batch, "contiguous")
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="simple_cnn,lenet")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd step (compiles per model)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = ["contiguous", "channels_last"] + (["compiled"] if args.compile else [])
    models = args.models.split(",")
    gflop = {m: step_gflop(m, args.batch_size) for m in models}
    steps, compile_s = {}, {}
    for m in models:
        for v in variants:
            steps[m, v], compile_s[m, v] = make_step(m, args.batch_size, v)
            for _ in range(3):   # warm-up
                steps[m, v]()
    peaks, rates = [], {k: [] for k in steps}
    for _ in range(args.repeats):
        peaks.append(2 * 2048 ** 3 / matmul_seconds() / 1e9)
        for k, fn in steps.items():
            sec = _timed(lambda: [fn() for _ in range(args.steps)])
            rates[k].append(gflop[k[0]] * args.steps / sec)
    print(f"peak (2048² fp32 matmul, {args.threads} thread(s)): median {statistics.median(peaks):.1f} GFLOP/s "
          f"over {args.repeats} rounds {[round(p, 1) for p in peaks]}")
    print("| model | batch | variant | GFLOP per step | ms per step | achieved GFLOP/s | % of peak | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for (m, v), r in rates.items():
        pct = statistics.median(100 * a / p for a, p in zip(r, peaks))
        ach = statistics.median(r)
        print(f"| {m} | {args.batch_size} | {v} | {gflop[m]:.4f} | {1e3 * gflop[m] / ach:.2f} | {ach:.1f} | "
              f"{pct:.0f} % | {compile_s[m, v]:.0f} |")
    # The ceiling: the same FLOPs as plain matmuls of the layers' shapes (no im2col, pooling, activations, loss,
    # optimizer or dispatch). Small channel counts (LeNet's conv1: K = 25, N = 6) run far below the square matmul.
    print("| model | batch | products as matmuls, default orientation: % of peak | best orientation: % of peak |")
    print("|---|---|---|---|")
    peak = statistics.median(peaks)
    for m in models:
        g, plain, best = gemm_ceiling(m, args.batch_size)
        print(f"| {m} | {args.batch_size} | {100 * g / plain / peak:.0f} % | {100 * g / best / peak:.0f} % |")
    for m in models:
        base = statistics.median(rates[m, "contiguous"])
        print(f"{m}: " + ", ".join(f"{v} {statistics.median(rates[m, v]) / base:.2f}x" for v in variants[1:])
              + " the contiguous step's throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
