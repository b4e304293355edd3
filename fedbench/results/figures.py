"""Accuracy-over-rounds figures from run records (FedLap-style curves, FOLA Figs. 5/7/9/11, FedLPA Fig. 2,
FedFisher Fig. 2): one panel per table row, one line per method, mean over seeds with a ±1 std band.

The runs are exactly those of a preset's sweep (the same selection as the tables), so a figure never mixes
runs from other configurations. Paper points, where a note gives numbers for a curve, are drawn as markers
from ``results/reference`` rows that carry a ``rounds`` column.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pandas as pd

from fedbench.errors import FedbenchError


def round_curves(overrides: Sequence[str], output_root: Path, metric: str = "accuracy") -> pd.DataFrame:
    """Long table: row keys, method, seed, round, value — from each finished run's history.csv."""
    from fedbench.results.tables import _history, table_runs

    runs = table_runs(overrides, output_root)
    meta = runs.attrs.get("table") or {}
    keys = [k for k in (meta.get("rows") or ["dataset", "partition"]) if k != "rounds"]
    out = []
    if len(runs) == 0:
        return pd.DataFrame(out)
    base = runs.drop_duplicates("run_id")
    for _, r in base.iterrows():
        if r.get("missing_method"):
            continue
        for h in _history(output_root / "runs" / r["run_id"] / "history.csv"):
            v = h.get(metric)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            out.append({**{k: r[k] for k in keys}, "method": r["method"], "seed": r["seed"],
                        "round": int(h["round"]), "value": float(v)})
    df = pd.DataFrame(out)
    df.attrs["table"] = meta
    df.attrs["keys"] = keys
    return df


def plot_curves(curves: pd.DataFrame, path: Path, *, metric: str = "accuracy", title: str = "",
                reference: Optional[pd.DataFrame] = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if curves.empty:
        raise FedbenchError("no finished runs with a history to plot (run the sweep first)")
    keys: List[str] = curves.attrs.get("keys") or ["dataset", "partition"]
    panels = list(curves.groupby(keys, sort=False, dropna=False))
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (kv, g) in zip(axes.flat, panels):
        kv = kv if isinstance(kv, tuple) else (kv,)
        for method, gm in g.groupby("method", sort=False):
            stats = gm.groupby("round")["value"].agg(["mean", "std", "count"]).reset_index()
            n = int(stats["count"].max())
            line, = ax.plot(stats["round"], stats["mean"], label=f"{method} (n={n})", lw=1.6)
            if n > 1:
                ax.fill_between(stats["round"], stats["mean"] - stats["std"].fillna(0),
                                stats["mean"] + stats["std"].fillna(0), color=line.get_color(), alpha=0.15)
            if reference is not None and not reference.empty:
                base = method.split("(", 1)[0]   # "fedprox(mu=1)" is the paper's "fedprox" column
                sel = reference[reference["method"].isin([method, base])]
                for k, v in zip(keys, kv):
                    if k in sel:
                        sel = sel[sel[k].astype(str) == str(v)]
                if len(sel):
                    ax.scatter(sel["rounds"].astype(float), sel["mean"].astype(float), marker="x",
                               color=line.get_color(), zorder=5)
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(keys, kv)), fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        import textwrap
        fig.suptitle("\n".join(textwrap.wrap(title, 60 * cols)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_table(overrides: Sequence[str], output_root: Path, figures_dir: Path, metric: str = "accuracy") -> Path:
    """The preset's multi-round figure: ``results/figures/<paper>_<id>[_<profile>]_<metric>.png``."""
    from fedbench.results.reference import load_reference

    curves = round_curves(overrides, output_root, metric)
    meta = curves.attrs.get("table") or {}
    if not meta:
        raise FedbenchError("plot needs an experiment preset (experiment=<paper>/<table>)")
    if not curves.empty and curves["round"].max() <= 1:
        raise FedbenchError("a one-shot table (every run has one round): nothing to draw over rounds")
    profile = next((o.split("=", 1)[1] for o in overrides if o.startswith("profile=")), "paper")
    name = f"{meta['paper']}_{meta['id']}" + ("" if profile == "paper" else f"_{profile}") + f"_{metric}"
    try:
        ref = load_reference(meta["paper"], meta["id"])
        ref = ref[(ref["metric"] == metric)] if "metric" in ref else ref
        ref = ref[ref["rounds"].notna()] if "rounds" in ref else None
    except Exception:  # noqa: BLE001  (a table without transcribed numbers still gets its figure)
        ref = None
    title = f"{meta['paper']} {meta['id']}: {meta.get('title', '')} [profile: {profile}]"
    return plot_curves(curves, figures_dir / f"{name}.png", metric=metric, title=title, reference=ref)
