"""fedbench's FedLPA server on the released code's own clients (results/gaps.md#fedlpa-table5-mnist).

The released FedLPA run (github.com/lebronlambert/FedLPA_NeurIPS2024 @ 08dd729, unchanged) saves its trained clients,
their damped K-FAC factors (A_k + sqrt(1 - coor) I, G_k + sqrt(1 - coor) I), the weights p_k = n_k / N and its logged
test accuracies of the GD and EA models when the wrapper is given DUMP:

    DUMP=/tmp/c.pt DATASET=mnist bash scripts/gaps/fedlpa_released_baseline.sh <checkout> 1 'noniid-labeldir --beta=0.01' our 10 0
    python scripts/gaps/fedlpa_cross_server.py <checkout> /tmp/c.pt [more dumps]

For each dump this solves every layer's system sum_k p_k G_k M A_k = sum_k p_k G_k M_k A_k with fedbench's own
solvers (fedbench.algorithms.fedlpa: ea_solve, gd_solve at the released fixed step gd_lr = 1 for 10,000 steps, in
float32 as the released code and float64 as fedbench's default server_dtype, and cg_solve) and prints their test
accuracies beside the released log's, with the worst layer's relative residual, and the test accuracy of the clients'
FedAvg (their p_k-weighted average: what the clients give without the curvature). Equal numbers mean the two servers
agree on those clients, so a difference between the two pipelines lies in the client stage.

With ``--fedbench OVERRIDES`` (the fedbench run of the same split, e.g. ``experiment=fedlpa/table5 profile=paper
dataset=mnist "partition.spec='beta=0.01'" partition.fixed_seed=1 seed=1``) it also computes fedbench's own K-FAC
factors (fedbench.curvature, FedLPA's convention) on the released clients' weights and each client's data of
fedbench's split, prints their largest relative difference from the released factors, and the accuracies of the
EA / GD solutions with fedbench's factors: the client stage's curvature, checked apart from its training.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedbench.algorithms.base import weighted_average  # noqa: E402
from fedbench.algorithms.fedlpa import (LayerSpec, cg_solve, ea_solve, gd_solve, layer_specs, rel_residual,  # noqa: E402
                                       worst_residual)

TEST_SETS = {"mnist": "MNIST", "fmnist": "FashionMNIST"}


def layer_systems(dump: dict) -> Iterator[Tuple[LayerSpec, Tensor, Tensor, Tensor]]:
    """(layer, M_k stacked, A_k stacked, G_k stacked) for each Linear/Conv2d layer of the dump's network, with
    M_k = [W | b] laid out as fedbench's FedLPA server lays it out (LayerSpec.to_matrix)."""
    for spec in layer_specs(dump["model"])[0]:
        yield (spec, torch.stack([spec.to_matrix(sd) for sd in dump["clients"]]),
               torch.stack([f[spec.module][0] for f in dump["factors"]]),
               torch.stack([f[spec.module][1] for f in dump["factors"]]))


def fedavg_params(dump: dict) -> Dict[str, Tensor]:
    """The clients' p_k-weighted average (float64) of every entry of their state dicts: FedAvg's own average."""
    return weighted_average([{k: v.double() for k, v in sd.items()} for sd in dump["clients"]], dump["p"])


def solve_all(dump: dict, dtype: torch.dtype, gd_lr: float, gd_steps: int,
              solvers: Sequence[str] = ("ea", "gd", "cg")) -> Dict[str, Tuple[Dict[str, Tensor], float]]:
    """Each requested solver's parameters (fedbench's names) and its worst layer relative residual (in float64)."""
    p = torch.tensor(dump["p"], dtype=dtype)
    out: Dict[str, Tuple[Dict[str, Tensor], List[float]]] = {k: ({}, []) for k in solvers}
    for spec, Ms, As, Gs in layer_systems(dump):
        Ms, As, Gs = Ms.to(dtype), As.to(dtype), Gs.to(dtype)
        M_ea, Z, A_bar, G_bar = ea_solve(Gs, As, p, Ms)
        sols = {"ea": lambda: M_ea, "gd": lambda: gd_solve(Gs, As, p, Z, M_ea, gd_steps, gd_lr),
                "cg": lambda: cg_solve(Gs, As, p, Z, M_ea, tol=1e-8, max_iters=1000, precond=(G_bar, A_bar))[0]}
        for k in solvers:
            M = sols[k]()
            out[k][0].update(spec.from_matrix(M))
            out[k][1].append(rel_residual(Gs, As, Ms, p, M))
    return {k: (params, worst_residual(res)) for k, (params, res) in out.items()}


def accuracy(model: torch.nn.Module, params: Dict[str, Tensor], test) -> float:
    """Test accuracy (%) of the released network with the solved ``params`` (non-finite weights: 'nan')."""
    if not all(torch.isfinite(v).all() for v in params.values()):
        return float("nan")
    ref = model.state_dict()
    model.load_state_dict({**ref, **{n: v.to(ref[n].dtype) for n, v in params.items()}})
    model.eval()
    x, y = test
    with torch.no_grad():
        pred = torch.cat([model(x[i:i + 1000]).argmax(1) for i in range(0, len(x), 1000)])
    return 100.0 * float((pred == y).float().mean())


def fedbench_factors(dump: dict, overrides: List[str]) -> Tuple[List[Dict[str, Tuple[Tensor, Tensor]]], float]:
    """fedbench's damped FedLPA factors at each released client's weights on that client's data of fedbench's split,
    and the largest relative Frobenius difference from the released ones. Clients are matched by size n_k = p_k N;
    where several of fedbench's clients have that size (`#C=k` splits), by the closest factors among them (the
    released dump lists its clients in its own shuffled order)."""
    from fedbench.algorithms.fedlpa import CURVATURE
    from fedbench.curvature.damping import damp_kfac
    from fedbench.config.compose import compose_config
    from fedbench.curvature.compute import compute_curvature
    from fedbench.run.setup import build_setup
    cfg = compose_config(list(overrides) + ["algorithm=fedlpa", "hardware=cpu", "cache=false"])
    run = build_setup(cfg)
    sizes = run.client_sizes
    n = sum(sizes)
    candidates = [[k for k, s in enumerate(sizes) if s == round(p * n)] for p in dump["p"]]
    if not all(candidates):
        print(f"error: the dump's client sizes {[round(p * n) for p in dump['p']]} do not match fedbench's split "
              f"{sizes}", file=sys.stderr)
        raise SystemExit(2)
    alg = cfg.algorithm
    lam, pi = float(alg.damping), alg.pi
    model, worst, out, order = run.fl.model, 0.0, [], []
    for sd, released, cands in zip(dump["clients"], dump["factors"], candidates):
        model.load_state_dict({**model.state_dict(), **sd})
        best = None
        for k in cands:
            idx = run.fl.client_indices[k]
            curv = compute_curvature(model, run.fl.train.inputs(idx), run.fl.train.y[idx], batch_size=64, **CURVATURE)
            mine, diff = {}, 0.0
            for name, (A_rel, G_rel) in released.items():
                A, G = damp_kfac(curv.blocks[name].A.detach(), curv.blocks[name].G.detach(), lam, pi)
                mine[name] = (A, G)
                for a, b in ((A, A_rel), (G, G_rel)):
                    diff = max(diff, float(torch.linalg.norm(a - b) / torch.linalg.norm(b)))
            if best is None or diff < best[0]:
                best = (diff, k, mine)
        worst = max(worst, best[0])
        order.append(best[1])
        out.append(best[2])
    if sorted(order) != list(range(len(sizes))):
        print(f"error: the dump's clients match fedbench's clients {order}, not one to one", file=sys.stderr)
        raise SystemExit(2)
    return out, worst


def load_test(checkout: Path, dataset: str):
    from torchvision import datasets, transforms
    cls = getattr(datasets, TEST_SETS[dataset])
    ds = cls(str(checkout / "data"), train=False, download=False, transform=transforms.ToTensor())
    return torch.stack([ds[i][0] for i in range(len(ds))]), torch.as_tensor(ds.targets)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkout", type=Path, help="the released FedLPA checkout (its model classes unpickle the dump)")
    ap.add_argument("dumps", type=Path, nargs="+", help="files written by fedlpa_released_baseline.sh with DUMP=")
    ap.add_argument("--gd-lr", type=float, default=1.0)
    ap.add_argument("--gd-steps", type=int, default=10000)
    ap.add_argument("--fedbench", nargs="+", metavar="OVERRIDE",
                    help="fedbench overrides of the same split: also solve with fedbench's factors on these clients")
    a = ap.parse_args(argv)
    if not (a.checkout / "experiments_our.py").is_file():
        print(f"error: {a.checkout} has no experiments_our.py (not FedLPA's released code)", file=sys.stderr)
        return 2
    missing = [str(d) for d in a.dumps if not d.is_file()]
    if missing:
        print(f"error: no such dump: {', '.join(missing)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(a.checkout.resolve()))
    torch.set_num_threads(1)
    tests = {}
    print("dump | released GD / EA | fedbench EA | GD float32 | GD float64 | CG float64 (worst layer residual) | "
          "FedAvg of the clients")
    for path in a.dumps:
        dump = torch.load(path, map_location="cpu", weights_only=False)
        dataset = dump["args"]["dataset"]
        if dataset not in TEST_SETS:
            print(f"error: {path}: dataset {dataset!r} is not one of {sorted(TEST_SETS)}", file=sys.stderr)
            return 2
        if dataset not in tests:
            tests[dataset] = load_test(a.checkout, dataset)
        test, model = tests[dataset], dump["model"]
        s32 = solve_all(dump, torch.float32, a.gd_lr, a.gd_steps, solvers=("gd",))   # the released precision
        s64 = solve_all(dump, torch.float64, a.gd_lr, a.gd_steps)
        cell = [f"{accuracy(model, m, test):.2f} ({r:.2g})" for m, r in (s64["ea"], s32["gd"], s64["gd"], s64["cg"])]
        cell.append(f"{accuracy(model, fedavg_params(dump), test):.2f}")
        print(f"{path.name} | {100 * dump['released_gd']:.2f} / {100 * dump['released_ea']:.2f} | " + " | ".join(cell))
        if a.fedbench:
            factors, worst = fedbench_factors(dump, a.fedbench)
            mine = solve_all({**dump, "factors": factors}, torch.float64, a.gd_lr, a.gd_steps, solvers=("ea", "gd"))
            print(f"  fedbench's factors on these clients: largest relative difference {worst:.2g}; EA "
                  f"{accuracy(model, mine['ea'][0], test):.2f}, GD float64 {accuracy(model, mine['gd'][0], test):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
