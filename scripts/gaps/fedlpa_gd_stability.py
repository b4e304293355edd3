#!/usr/bin/env python
"""Is FedLPA's released GD server step beyond its stability limit? (results/gaps.md, FedLPA Table 6 "Extreme splits").

For one preset cell, load the cached trained clients and their cached K-FAC factors, build each layer's server system
𝒜(M) = Σ_k p_k G_k M A_k exactly as ``FedLPA.solve`` does, and print per layer:

    λ_max(𝒜)          Lanczos (scipy eigsh) on ``KronSystem``; the Kronecker bound Σ_k p_k λ_max(A_k) λ_max(G_k) beside it
    h = 2 λ_max² / n   the largest Hessian eigenvalue of GD's loss mean((𝒜(M) − Z)²), n = numel(M)
    gd_lr · h          GD (M ← M − gd_lr ∇) is stable iff gd_lr · h < 2, i.e. gd_lr < n / λ_max²
    probe              the relative residual after --probe-steps GD steps from the EA start (the released iteration)

    FEDBENCH_OUTPUTS=/work/campaign/outputs PYTHONPATH=$PWD python scripts/gaps/fedlpa_gd_stability.py \\
        experiment=fedlpa/table6 profile=paper dataset=fmnist "partition.spec='beta=0.01'" seed=0 \\
        hardware=cpu hardware.num_threads=1

Read-only on the cache: a client stage or factor set that is not cached stops the script (nothing is trained or
written). The aggregator is the first fedlpa entry of the preset's ``aggregators`` (or ``algorithm``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from fedbench.errors import FedbenchError  # noqa: E402


def fedlpa_config(overrides):
    """The composed single-run config of the cell's fedlpa aggregator (profile settings applied as run.py does)."""
    from fedbench.config import CONF_DIR
    from fedbench.config.aggregators import expand_runs
    from fedbench.config.compose import compose_config
    from fedbench.config.preflight import preflight

    cfg = compose_config(preflight(overrides, CONF_DIR), CONF_DIR)
    subs = expand_runs(cfg, CONF_DIR)
    subs = [s for s in subs if s.algorithm.name == "fedlpa"]
    if not subs:
        raise FedbenchError("no fedlpa aggregator in this cell (set algorithm=fedlpa or aggregators=[fedlpa])")
    return subs[0]


def cached_messages(fl, algo):
    """Round-1 client messages from the cache only; FedbenchError when the clients or their factors are not cached."""
    from fedbench.fl.products import ProductStage
    from fedbench.train.engine import TrainResult

    if fl.cache is None or not fl.cache.enabled:
        raise FedbenchError("the client-stage cache is off (cache=false); nothing to read")
    stage = {**fl.stage_parts, "round": 1, "local_objective": algo.client_stage_key(1)}
    payload = fl.cache.load({**stage, "product": "local_training"})
    if payload is None:
        raise FedbenchError(f"client stage not cached under {fl.cache.root}; not retraining (10+ minutes)")
    result = TrainResult(payload["params"], payload["steps"], payload["mean_loss"], payload["seconds"])
    missing = [c for c in range(fl.num_clients) if not factors_cached(fl, algo, c, stage)]
    if missing:
        raise FedbenchError(f"K-FAC factors of clients {missing} not cached; not computing them here")
    products = ProductStage(fl)
    return [products.message(algo, c, result.params[c], result, c, {}, 1, stage) for c in range(fl.num_clients)]


def factors_cached(fl, algo, client_id, stage) -> bool:
    from fedbench.algorithms.fedlpa import CURVATURE

    parts = {**CURVATURE, "factor_data": algo.factor_data}
    key = {**stage, "product": "fedlpa_kfac", "client": int(client_id), "params": parts}
    return fl.cache.load(key) is not None


def layer_systems(algo, messages):
    """Per layer (spec, Gs, As, Ms, p) in float64, the uploaded (damped) factors as ``FedLPA.solve`` stacks them."""
    import torch

    p = algo._weights(messages, torch.device("cpu"))
    for s in algo.specs:
        Gs = torch.stack([algo._unpack(m.payload["G"][s.module]) for m in messages]).double()
        As = torch.stack([algo._unpack(m.payload["A"][s.module]) for m in messages]).double()
        Ms = torch.stack([s.to_matrix(m.payload["params"]) for m in messages]).double()
        yield s, Gs, As, Ms, p


def lambda_max(op, shape) -> float:
    """Largest eigenvalue of the SPD operator ``op`` on matrices of ``shape`` (Lanczos)."""
    import numpy as np
    import torch
    from scipy.sparse.linalg import LinearOperator, eigsh

    n = shape[0] * shape[1]

    def matvec(v):
        M = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64).reshape(shape))
        return op(M).reshape(-1).numpy()

    lin = LinearOperator((n, n), matvec=matvec, dtype=np.float64)
    return float(eigsh(lin, k=1, which="LA", tol=1e-10, return_eigenvectors=False)[0])


def kron_bound(Gs, As, p) -> float:
    """Σ_k p_k λ_max(A_k) λ_max(G_k) ≥ λ_max(𝒜) (each A_k ⊗ G_k has top eigenvalue λ_max(A_k) λ_max(G_k))."""
    import torch

    la, lg = torch.linalg.eigvalsh(As)[:, -1], torch.linalg.eigvalsh(Gs)[:, -1]
    return float((p * la * lg).sum())


def layer_report(s, Gs, As, Ms, p, lr: float, probe_steps: int) -> dict:
    from fedbench.algorithms.fedlpa import KronSystem, ea_solve, gd_solve, rel_residual

    lam = lambda_max(KronSystem(Gs, As, p), (s.d_out, s.d_in))
    n = s.d_out * s.d_in
    h = 2.0 * lam ** 2 / n                       # GD's step is M -= lr (2/n) 𝒜(𝒜(M) − Z): Hessian (2/n) 𝒜²
    M_ea, Z, _, _ = ea_solve(Gs, As, p, Ms)
    M = gd_solve(Gs, As, p, Z, M_ea, probe_steps, lr) if probe_steps else M_ea
    return {"layer": s.module, "shape": f"{s.d_out}x{s.d_in}", "lam": lam, "bound": kron_bound(Gs, As, p),
            "h": h, "lr_h": lr * h, "lr_max": n / lam ** 2, "res_ea": rel_residual(Gs, As, Ms, p, M_ea),
            "res_probe": rel_residual(Gs, As, Ms, p, M)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--probe-steps", type=int, default=100, help="GD steps from EA for the residual probe (0: none)")
    args = ap.parse_args(argv)
    try:
        cfg = fedlpa_config(args.overrides)
        import torch
        from fedbench.algorithms import build_algorithm
        from fedbench.run.setup import build_setup, config_group

        run = build_setup(cfg)
        algo = build_algorithm(config_group(cfg, "algorithm"), run.fl)
        messages = cached_messages(run.fl, algo)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print(f"cell: {cfg.dataset.name} {cfg.partition.spec} seed {cfg.seed}; solver {algo.solver}, gd_lr {algo.gd_lr}, "
          f"gd_steps {algo.gd_steps}, server_dtype {algo.server_dtype}; client sizes {run.client_sizes}")
    print(f"{'layer':10s} {'M':>7s} {'lam_max':>10s} {'kron_bound':>10s} {'h=2lam^2/n':>11s} {'lr*h':>10s} "
          f"{'lr_max':>10s} {'>2?':>4s} {'res_EA':>9s} {f'res_GD{args.probe_steps}':>9s}")
    for sysargs in layer_systems(algo, messages):
        r = layer_report(*sysargs, algo.gd_lr, args.probe_steps)
        print(f"{r['layer']:10s} {r['shape']:>7s} {r['lam']:10.4g} {r['bound']:10.4g} {r['h']:11.4g} "
              f"{r['lr_h']:10.4g} {r['lr_max']:10.4g} {'YES' if r['lr_h'] > 2 else 'no':>4s} "
              f"{r['res_ea']:9.3g} {r['res_probe']:9.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
