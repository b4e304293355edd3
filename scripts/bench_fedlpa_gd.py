"""Time FedLPA's GD server (10,000 steps of the released mean-MSE GD, notes/fedlpa.md §1.4 step 5).

Per layer of the simple CNN (Fashion-MNIST shapes by default, K clients), random SPD factors with the
damped scale of real ones; one CPU thread. Prints seconds per solve for float32 and float64, the
minimum over --repeats (the machine may be shared), for fedbench's ``gd_solve`` and for a per-client
loop written like the released code (Σ_k p_k G_k M A_k as K small products, autograd MSELoss).

    python scripts/bench_fedlpa_gd.py [--steps 10000] [--repeats 3] [--clients 10] [--cifar]
"""
import argparse
import time

import torch

from fedbench.algorithms.fedlpa import ea_solve, gd_solve

# (d_out, d_in + 1) per K-FAC layer of the simple CNN (notes/fedlpa.md §3 "K-FAC factor shapes")
SHAPES = {"mnist": [(6, 26), (16, 151), (120, 257), (84, 121), (10, 85)],
          "cifar": [(6, 76), (16, 151), (120, 401), (84, 121), (10, 85)]}


def spd(n, g, dtype):
    X = torch.randn(n, 2 * n, generator=g, dtype=torch.float64) / (2 * n) ** 0.5
    return (X @ X.T * 0.1 + 0.0316 * torch.eye(n, dtype=torch.float64)).to(dtype)


def layer_problem(o, i, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    Gs = torch.stack([spd(o, g, dtype) for _ in range(K)])
    As = torch.stack([spd(i, g, dtype) for _ in range(K)])
    Ms = (0.1 * torch.randn(K, o, i, generator=g, dtype=torch.float64)).to(dtype)
    p = torch.full((K,), 1.0 / K, dtype=dtype)
    return Gs, As, Ms, p


def released_style_gd(Gs, As, p, Z, M0, steps):
    """The released loop's arithmetic (K small products per apply, autograd on MSELoss); timing reference."""
    M = M0.clone()
    pk = [float(x) for x in p]
    mse = torch.nn.MSELoss()
    for _ in range(steps):
        M.requires_grad_(True)
        loss = mse(sum(pk[k] * Gs[k] @ M @ As[k] for k in range(len(pk))), Z)
        (g,) = torch.autograd.grad(loss, M)
        M = (M - g).detach()
    return M


def time_solver(fn, problems, steps):
    t0 = time.perf_counter()
    for Gs, As, Ms, p in problems:
        M_ea, Z, _, _ = ea_solve(Gs, As, p, Ms)
        fn(Gs, As, p, Z, M_ea, steps)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--cifar", action="store_true", help="CIFAR-10/SVHN shapes instead of (F)MNIST")
    ap.add_argument("--released", action="store_true", help="also time the released-style per-client loop")
    a = ap.parse_args()
    torch.set_num_threads(1)
    shapes = SHAPES["cifar" if a.cifar else "mnist"]
    solvers = {"fedbench gd_solve": lambda *x: gd_solve(*x[:5], x[5], 1.0)}
    if a.released:
        solvers["released-style loop"] = released_style_gd
    for dtype in (torch.float32, torch.float64):
        problems = [layer_problem(o, i, a.clients, dtype, seed) for seed, (o, i) in enumerate(shapes)]
        for name, fn in solvers.items():
            best = min(time_solver(fn, problems, a.steps) for _ in range(a.repeats))
            print(f"{name:22s} {str(dtype).replace('torch.', ''):8s} {a.steps} steps x {len(shapes)} layers, "
                  f"K={a.clients}: {best:.1f} s (min of {a.repeats})", flush=True)


if __name__ == "__main__":
    main()
