"""Time the exact softmax-regression Hessian of FOLA's §IV-E study (fola/figure10-12), the study's largest cost:
the "online" styles accumulate it on every local minibatch (150 per client and round on MNIST, B = 200).

fedbench's accumulator computes only the C(C+1)/2 class blocks with c ≤ d (the curvature is symmetric in the class
pair) and mirrors them; the plain baseline below computes all C² blocks in one GEMM. Both give the same Hessian (the
script checks it, bitwise); the ratio is what the symmetry saves. One thread, minimum over --repeats.

    python scripts/bench_fola_hessian.py [--batch 200] [--repeats 3] [--inputs 784] [--classes 10]
"""
import argparse
import time

import torch

from fedbench.papers.fola.laplace_study import HessianAccumulator, logits


def all_blocks(theta, xc, C, out):
    """The plain accumulation into ``out`` [C²·D1, D1]: every (c, d) block, X̃ᵀ diag(A_{:,c,d}) X̃, in one GEMM."""
    p = torch.softmax(logits(theta, xc), 1)
    a = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    yk = (a.reshape(-1, C * C)[:, :, None] * xc[:, None, :]).reshape(xc.shape[0], -1)
    return out.addmm_(yk.T, xc)


def as_dense(blocks, C, D1):
    return blocks.view(C, C, D1, D1).permute(0, 2, 1, 3).reshape(C * D1, C * D1)


def best_of(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--inputs", type=int, default=784)
    ap.add_argument("--classes", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    D1, C = a.inputs + 1, a.classes
    xc = torch.randn(a.batch, D1, generator=g, dtype=torch.float64)
    theta = torch.randn(C * D1, generator=g, dtype=torch.float64) * 0.05

    def ours():
        acc = HessianAccumulator(C, D1, torch.float64, "cpu", chunk_size=a.batch)
        acc.add(theta, xc)
        return acc

    plain = torch.zeros(C * C * D1, D1, dtype=torch.float64)
    same = torch.equal(ours().dense(), as_dense(all_blocks(theta, xc, C, plain), C, D1))
    t_plain = best_of(lambda: all_blocks(theta, xc, C, plain), a.repeats)
    acc = ours()
    t_ours = best_of(lambda: acc.add(theta, xc), a.repeats)
    print(f"softmax regression {C} x {D1}, a {a.batch}-sample minibatch, float64, 1 thread: all C² blocks "
          f"{t_plain:.3f} s, the c <= d blocks {t_ours:.3f} s (accumulation only); ratio {t_plain / t_ours:.2f}x; "
          f"same Hessian bitwise: {same}")


if __name__ == "__main__":
    main()
