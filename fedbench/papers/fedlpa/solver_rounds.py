"""FedLPA's multi-round series, round by round, against the exact solution of each round's system: the plot kind
``fedlpa_solver_rounds`` of a collection run with ``algorithm.reference_solve=cg`` (results/gaps.md#fedlpa-figure2).

Panel (a): test accuracy of the carried model (the configured solver, the released fixed-step GD in Fig. 2), of the
exact product-of-Gaussians mean of the same round's messages (CG to 1e-8, evaluated, not carried) and of EA. Panel
(b): the worst layer's relative residual of the solver's and of the exact solution, log scale. Rounds where the
solver's residual is at least ``DIP_RESIDUAL`` are shaded in both panels."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pandas as pd

from fedbench.errors import FedbenchError
from fedbench.report.plotting import figure_title, pyplot, save_figure
from fedbench.report.registry import PlotRequest
from fedbench.report.runs import preset_records

PLOTS = ("fedlpa_solver_rounds",)
DIP_RESIDUAL = 0.05   # a GD solve this far from the solution (session 44: every dip of seed 0 had 0.092 or more)
COLUMNS = ("accuracy", "reference_accuracy", "ea_accuracy", "solver_rel_residual", "reference_rel_residual")


def _describe(sub, algorithm: Dict[str, Any]) -> Dict[str, Any]:
    return {"seed": int(sub.seed), "method": algorithm.get("name")}


def solver_histories(overrides, output_root: Path) -> pd.DataFrame:
    """One row per (finished run, round): seed, method and ``COLUMNS`` from the run's history."""
    runs = preset_records(overrides, output_root, _describe)
    out = []
    for _, r in runs[runs["status"] == "ok"].iterrows() if len(runs) else []:
        h = pd.read_csv(Path(r["record_dir"] or Path(output_root) / "runs" / r["run_id"]) / "history.csv")
        missing = [c for c in COLUMNS if c not in h]
        if missing:
            raise FedbenchError(f"run {r['run_id']} has no {', '.join(missing)} in its history: the solver plot needs "
                                f"a FedLPA run with algorithm.reference_solve=cg")
        h = h[["round", *COLUMNS]].copy()
        h["seed"], h["method"] = r["seed"], r["method"]
        out.append(h)
    if not out:
        raise FedbenchError("no finished runs to plot (run the sweep first)")
    return pd.concat(out, ignore_index=True)


def plot_solver_rounds(h: pd.DataFrame, path: Path, title: str) -> Path:
    plt = pyplot()
    seeds = sorted(h["seed"].unique())
    fig, axes = plt.subplots(2, len(seeds), figsize=(9 * len(seeds), 7), squeeze=False, sharex=True)
    for j, seed in enumerate(seeds):
        s = h[h["seed"] == seed].sort_values("round")
        top, bottom = axes[0][j], axes[1][j]
        for ax in (top, bottom):
            for rnd in s.loc[s["solver_rel_residual"] >= DIP_RESIDUAL, "round"]:
                ax.axvspan(rnd - 0.5, rnd + 0.5, color="0.88", lw=0)
        top.plot(s["round"], s["accuracy"], "o-", ms=3, label="carried model (the configured solver)")
        top.plot(s["round"], s["reference_accuracy"], "s--", ms=3, label="exact solution of the same round (CG)")
        top.plot(s["round"], s["ea_accuracy"], ":", color="0.4", label="EA")
        top.set_ylabel("test accuracy (%)")
        low = min(s[["accuracy", "reference_accuracy"]].min())
        top.set_ylim(max(low - 2, 0), 100)
        top.set_title(f"(a) seed {seed}: shaded = solver residual ≥ {DIP_RESIDUAL:g}", fontsize=9)
        top.legend(fontsize=7, loc="lower right")
        bottom.semilogy(s["round"], s["solver_rel_residual"], "o-", ms=3, label="configured solver")
        bottom.semilogy(s["round"], s["reference_rel_residual"], "s--", ms=3, label="exact (CG)")
        bottom.axhline(DIP_RESIDUAL, color="0.5", lw=0.8)
        bottom.set_xlabel("round")
        bottom.set_ylabel("worst layer's relative residual")
        bottom.set_title("(b) how far each solution is from solving the round's system", fontsize=9)
        bottom.legend(fontsize=7)
    return save_figure(fig, path, h, title)


def plot_kind(req: PlotRequest) -> Path:
    return plot_solver_rounds(req.frame(solver_histories), req.path, figure_title(req.meta, req.profile))
