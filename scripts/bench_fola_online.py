"""Time FOLA's per-step work beside the engine (fola/figure5's setting): the online hook removes the live prior's
gradient from the engine's (g − c ω ⊙ (θ − μ)), squares it into the Fisher, and replays the clipped SGD step to
know θ. On the 784-500-300-10 MLP that is a handful of element-wise passes over 545k weights per step, which cost
more in fresh allocations than in arithmetic.

fedbench's hook reuses scratch tensors; the plain baseline below writes the same formulas as dict comprehensions
(a new tensor per operation), as the hook did before. Both give the same bits (checked). One thread, minimum over
--repeats of --steps steps.

    python scripts/bench_fola_online.py [--steps 200] [--repeats 5]
"""
import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fedbench.algorithms.fola import FolaOnlineHook  # noqa: E402
from fedbench.curvature.online import OnlineDiagFisher  # noqa: E402

SHAPES = {"0.weight": (500, 784), "0.bias": (500,), "2.weight": (300, 500), "2.bias": (300,),
          "4.weight": (10, 300), "4.bias": (10,)}


def plain_step(acc, theta, g, prior, lr, clip, batch):
    """The same step written plainly: every operation returns a new tensor."""
    coef, mu, om = prior
    g_task = {n: g[n] - coef * om[n] * (theta[n] - mu[n]) for n in g}
    acc._add({n: g_task[n] * g_task[n] for n in g_task}, batch)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in g.values()]))
    c = torch.clamp(clip / (norm + 1e-6), max=1.0)
    for n, t in {n: t * c for n, t in g.items()}.items():
        theta[n].add_(t, alpha=-lr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    start = {n: torch.randn(s, generator=gen) * 0.05 for n, s in SHAPES.items()}
    mu = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in start.items()}
    om = {n: torch.rand(t.shape, generator=gen) for n, t in start.items()}
    grads = [{n: torch.randn((1,) + s, generator=gen) for n, s in SHAPES.items()} for _ in range(8)]
    local = SimpleNamespace(optimizer="sgd", lr=0.01, clip_grad_norm=10.0, weight_decay=0.0, momentum=0.0,
                            dampening=0.0, nesterov=False)
    setup = SimpleNamespace(client_indices={0: list(range(6000))}, local=local, task="classification",
                            likelihood=None)
    prior = (50.0, mu, om)

    def make_hook():
        return FolaOnlineHook(setup, [0], start, 2, grad="minibatch_sq", gradient="task", prior=prior)

    def ours():
        hook = make_hook()
        for s in range(args.steps):
            hook.after_backward([0], grads[s % len(grads)], [64])
        return hook

    def plain():
        acc = OnlineDiagFisher(start, 6000, "minibatch_sq")
        theta = {n: t.clone() for n, t in start.items()}
        for s in range(args.steps):
            plain_step(acc, theta, {n: t[0] for n, t in grads[s % len(grads)].items()}, prior, local.lr, 10.0, 64)
        return acc, theta

    hook, (acc, theta) = ours(), plain()
    same = all(torch.equal(hook[0].weighted[n], acc.weighted[n]) and torch.equal(hook.theta[0][n], theta[n])
               for n in SHAPES)
    times = {"plain": float("inf"), "fedbench": float("inf")}
    for _ in range(args.repeats):   # interleaved, so a busy machine slows both alike
        for name, fn in (("plain", plain), ("fedbench", ours)):
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    per = {k: v / args.steps * 1e3 for k, v in times.items()}
    print(f"FOLA online hook, MLP 784-500-300-10, {args.steps} steps, best of {args.repeats}: "
          f"plain {per['plain']:.2f} ms/step, fedbench {per['fedbench']:.2f} ms/step, "
          f"ratio {times['plain'] / times['fedbench']:.2f}x; same bits: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
