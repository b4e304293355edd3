#!/usr/bin/env python
"""Why does FedFisher's closed-form server blow up in Fig. 1a? (results/gaps.md, FedFisher Fig. 1a).

Runs the Fig. 1a cell (synthetic two-layer ReLU, 2 clients, full Fisher, K local steps) for several widths and seeds,
with four servers on the same trained clients: the paper's GD from W̄ (η_S = 0.001, ``server_steps`` steps) and the
closed form W̄ + F⁺(b − F W̄) with the pseudo-inverse cut at rtol = d·eps (the default), 1e-6 and 1e-4. Prints, per
width and server, the mean ± std over seeds of the global training loss L(W*) (the figure's y axis) and of the
quadratic objective Σ_i p_i (W − W_i)ᵀ F_i (W − W_i) that the server minimises (``laplace_objective``).

Hypothesis: the closed form solves the quadratic problem exactly (its objective is the lowest), but F is nearly
singular, so F⁺ moves W far along weakly curved directions where the quadratic (Gauss-Newton) model of the ReLU
network is no longer valid; GD with a small η_S and finite T never moves along those directions (λ η_S T ≪ 1).

    PYTHONPATH=$PWD python scripts/gaps/fedfisher_fig1a_closed_form.py --widths 16 64 256 1024 --seeds 10

Runs go to $FEDBENCH_OUTPUTS (default /tmp/fedfisher-fig1a-gap); finished runs are skipped on a rerun.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SERVERS = {"gd": "fedfisher_full",
           "closed (rtol d·eps)": "{name:fedfisher_full,server:closed_form}",
           "closed (rtol 1e-6)": "{name:fedfisher_full,server:closed_form,pinv_rtol:1e-6}",
           "closed (rtol 1e-4)": "{name:fedfisher_full,server:closed_form,pinv_rtol:1e-4}"}


def server_label(algo: dict) -> str:
    if algo.get("server") != "closed_form":
        return "gd"
    rtol = algo.get("pinv_rtol")
    return "closed (rtol d·eps)" if rtol is None else f"closed (rtol {float(rtol):.0e})".replace("e-0", "e-")


def run_sweep(args, out: Path) -> None:
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", "experiment=fedfisher/figure1a",
           f"model.width={','.join(map(str, args.widths))}", f"local.epochs={args.steps}",
           f"seed=range(0,{args.seeds})", f"aggregators=[{','.join(SERVERS.values())}]",
           "hardware=cpu", "hardware.num_threads=1", f"hardware.jobs={args.jobs}", "progress=false"]
    env = {**os.environ, "FEDBENCH_OUTPUTS": str(out), "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def summarise(out: Path) -> None:
    rows = {}
    for path in sorted(out.glob("runs/*/metrics.json")):
        rec = json.loads(path.read_text())
        if rec.get("status") != "ok" or rec["algorithm"] != "fedfisher_full":
            continue
        cfg, m = rec["config"], rec["metrics"]
        key = (cfg["model"]["width"], server_label(cfg["algorithm"]))
        rows.setdefault(key, []).append((m["global_train_loss"], m["laplace_objective"], m.get("fisher_rank", np.nan),
                                         m["fedavg_train_loss"]))
    print("| width m | server | n | L(W*) mean ± std | L(W*) median | quadratic objective mean | Fisher rank kept "
          "| FedAvg L(W̄) mean |")
    print("|---|---|---|---|---|---|---|---|")
    for (width, server), vals in sorted(rows.items(), key=lambda kv: (kv[0][0], list(SERVERS).index(kv[0][1]))):
        loss, obj, rank, avg = (np.array([v[i] for v in vals], dtype=float) for i in range(4))
        ranks = "—" if np.isnan(rank).all() else f"{np.nanmin(rank):.0f}–{np.nanmax(rank):.0f} of {2 * width}"
        print(f"| {width} | {server} | {len(vals)} | {loss.mean():.4g} ± {loss.std(ddof=1) if len(vals) > 1 else 0:.3g} "
              f"| {np.median(loss):.4g} | {obj.mean():.3g} | {ranks} | {avg.mean():.4g} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=2048, help="local full-batch GD steps K (the paper's Fig. 1a: 2048)")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    out = Path(os.environ.get("FEDBENCH_OUTPUTS", "/tmp/fedfisher-fig1a-gap"))
    run_sweep(args, out)
    summarise(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
