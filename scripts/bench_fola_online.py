"""Time FOLA's per-step work beside the engine (fola/figure5's setting): the online hook removes the live prior's
gradient from the engine's (g − c ω ⊙ (θ − μ)), squares it into the Fisher, and replays the clipped SGD step to
know θ. On the 784-500-300-10 MLP that is a handful of element-wise passes over 545k weights per step, which cost
more in fresh allocations than in arithmetic.

fedbench's hook reuses scratch tensors; the plain baseline below writes the same formulas as dict comprehensions
(a new tensor per operation), as the hook did before. Both give the same bits (checked). One thread, minimum over
--repeats of --steps steps.

``--engine``: local training itself with the paper's per-sample Fisher (fola/figure3's step: MNIST-shaped inputs,
channels_last, B = 32, clip 10): the serial engine handing the hook its weights and minibatch (``wants_batch``)
against the hook replaying the SGD update and the batch stream, as before, and the hook reading the per-sample
squares off the engine's own forward pass (``watch``, a tap) against a second forward pass; same bits checked.

    python scripts/bench_fola_online.py [--steps 200] [--repeats 5] [--engine]
"""
import argparse
import copy
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fedbench.algorithms.fola import FolaOnlineHook  # noqa: E402
from fedbench.curvature.online import OnlineDiagFisher  # noqa: E402
from fedbench.train.config import LocalTrainConfig  # noqa: E402
from fedbench.train.engine import LocalObjective, TrainData, train_clients  # noqa: E402

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


def bench_engine(steps: int, repeats: int) -> int:
    """One client's local training with the per-sample online Fisher: the hook given the batch vs replaying it."""
    gen = torch.Generator().manual_seed(0)
    n = 32 * steps
    data = TrainData(torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen),
                     mean=(0.1307,), std=(0.3081,))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 500), torch.nn.ReLU(),
                                torch.nn.Linear(500, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    local = LocalTrainConfig(lr=0.01, momentum=0.0, batch_size=32, epochs=1, clip_grad_norm=10.0)
    setup = SimpleNamespace(train=data, client_indices=[torch.arange(n)], local=local, seed=0,
                            task="classification")

    def train(passed: bool, tapped: bool):
        hook = FolaOnlineHook(setup, [0], start, 1, grad="per_sample_sq", gradient="task",
                              worker=copy.deepcopy(model))
        hook.wants_batch, hook.tap_forward = passed, tapped
        res = train_clients(model, data, setup.client_indices, start, local, objective=LocalObjective(step_hooks=[hook]),
                            seed=0, round_idx=1, backend="serial", memory_format="channels_last")
        return hook[0].fisher("none"), res.params[0]

    modes = {"replay": (False, False), "second pass": (True, False), "tap": (True, True)}
    out = {name: train(*m) for name, m in modes.items()}
    f_a, w_a = out["replay"]
    same = all(torch.equal(f[k], f_a[k]) and torch.equal(w[k], w_a[k]) for f, w in out.values() for k in f_a)
    times = {name: float("inf") for name in modes}
    for _ in range(repeats):   # interleaved, so a busy machine slows all alike
        for name, m in modes.items():
            t0 = time.perf_counter()
            train(*m)
            times[name] = min(times[name], time.perf_counter() - t0)
    per = {k: v / steps * 1e3 for k, v in times.items()}
    print(f"FOLA per-sample online Fisher, serial engine, MLP 784-500-300-10, B = 32, {steps} steps, best of {repeats}: "
          f"hook replays the step and batch {per['replay']:.2f} ms/step, engine passes them (second forward pass) "
          f"{per['second pass']:.2f} ms/step, squares read off the engine's forward pass {per['tap']:.2f} ms/step; "
          f"ratios {times['replay'] / times['second pass']:.2f}x and {times['second pass'] / times['tap']:.2f}x; "
          f"same bits: {same}")
    return 0 if same else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="time local training with the per-sample Fisher")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.engine:
        return bench_engine(args.steps, args.repeats)
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
