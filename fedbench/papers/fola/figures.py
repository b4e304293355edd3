"""FOLA's figures (fola.md §4, §6 R1-R8) from run and study records, registered as plot kinds (``PLOTS``).

A preset names its plots in ``table.plots`` (``fola_fig3`` ... ``fola_fig12``); fedbench.report.figures draws
them into ``results/figures/<paper>_<id>[_<profile>].png`` with the plotted numbers beside them
(``..._data.csv``), the profile in every title (quick = reduced, NOT the paper's protocol). The runs are exactly
the preset's sweep (the same selection as the tables); study presets (Figs. 10-12) read the files the study wrote
next to its record (fedbench.report.studies).

Selections that read the test set are named: Figs. 3-4 take the best GA over the other hyperparameters as the
paper does (``table.select: best_on_test``; ``mean`` averages over them instead). Paper points, where the text
gives numbers (Table II's α = 0.01 finals and rounds to 30/40 % GA in Figs. 6(c) and 7), are drawn as ``x``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pandas as pd
from omegaconf import OmegaConf

from fedbench.errors import FedbenchError
from fedbench.report.plotting import figure_title, pyplot, save_figure
from fedbench.report.registry import PlotRequest
from fedbench.report.runs import finished_studies, preset_records
from fedbench.report.tables import complete_seeds
from fedbench.results.reference import load_reference

SELECTS = ("best_on_test", "mean")
COLORS = {"FOLA": "C0", "FOLA agg.-only": "C2", "FOLA-offline": "C3", "FOLA prior + FedAvg agg.": "C4",
          "FedAvg": "C1", "FedCurv": "C5"}
STYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def method_label(algo: Dict[str, Any]) -> str:
    """The figure's name for a run's algorithm config (FOLA's variants share ``name: fola``, §1.7)."""
    name = algo.get("name")
    if name == "fedavg":
        return "FedAvg"
    if name == "fedcurv":
        return "FedCurv"
    if name != "fola":
        return str(name)
    if (algo.get("fisher") or {}).get("mode") == "offline":
        return "FOLA-offline"
    if algo.get("aggregation") == "mean":
        return "FOLA prior + FedAvg agg."
    return "FOLA agg.-only" if float(algo.get("lambda_prior", 0.0)) == 0 else "FOLA"


# ---- run selection -----------------------------------------------------------------------------------------
def describe_run(sub, a: Dict[str, Any]) -> Dict[str, Any]:
    """The settings the FOLA figures use, with the figure's method label, for one run of a preset's sweep."""
    return {"method": method_label(a),
            "algorithm": a.get("name"), "lambda": a.get("lambda_prior"),
            "alpha": sub.partition.get("alpha"), "num_clients": int(sub.num_clients),
            "epochs": int(sub.local.epochs), "lr": float(sub.local.lr),
            "batch_size": int(sub.local.batch_size), "seed": int(sub.seed), "rounds": int(sub.rounds),
            "profile": sub.get("profile")}


def fola_records(overrides, output_root: Path) -> pd.DataFrame:
    """One row per (run, aggregator) of the preset's sweep (fedbench.report.runs.preset_records) with
    ``describe_run``'s columns."""
    return preset_records(overrides, output_root, describe_run)


def _finished(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df["status"] == "ok"] if len(df) else df
    if ok.empty:
        raise FedbenchError("no finished runs to plot (run the sweep first)")
    return ok


def _histories(df: pd.DataFrame, output_root: Path) -> pd.DataFrame:
    """Long table of every finished run's history: the run's columns + round, accuracy, local_accuracy."""
    out = []
    for _, r in df.iterrows():
        try:
            h = pd.read_csv(Path(r["record_dir"] or Path(output_root) / "runs" / r["run_id"]) / "history.csv")
        except (OSError, ValueError):
            continue
        for col in ("accuracy", "local_accuracy"):
            if col not in h:
                h[col] = math.nan
        h = h[["round", "accuracy", "local_accuracy"]].copy()
        for k in ("method", "lambda", "alpha", "epochs", "seed"):
            h[k] = r[k]
        out.append(h)
    if not out:
        raise FedbenchError("no finished runs with a history to plot (run the sweep first)")
    return pd.concat(out, ignore_index=True)


# ---- plotting helpers ----------------------------------------------------------------------------------------
def _color(method: str, i: int = 0) -> str:
    return COLORS.get(method, f"C{6 + i % 4}")


def _fmt(v) -> str:
    return f"{float(v):g}" if v is not None and not (isinstance(v, float) and math.isnan(v)) else "-"


def _reference(metric: str, threshold: Optional[float] = None) -> pd.DataFrame:
    """Table II's α = 0.01 cells (the finals of Figs. 6(c)/7) with the figure's method names."""

    try:
        ref = load_reference("fola", "table2")
    except FedbenchError:
        return pd.DataFrame()
    ref = ref[ref["metric"] == metric]
    if threshold is not None:
        ref = ref[ref["threshold"].astype(float) == float(threshold)]
    ref = ref.assign(method=ref["method"].map({"fola": "FOLA", "fedavg": "FedAvg", "fedcurv": "FedCurv"}))
    return ref[ref["method"].notna() & ref["mean"].notna()]


def select_over(df: pd.DataFrame, keep: List[str], value: str, how: str) -> pd.DataFrame:
    """Mean over seeds per setting, then per ``keep`` group the best (``best_on_test``) or the mean (``mean``)
    over the remaining hyperparameters; also reports how many settings and seeds entered. Seeds that have not
    run every setting of their group are left out while a complete seed exists (fedbench.report.tables.complete_seeds)."""
    if how not in SELECTS:
        raise FedbenchError(f"table.select must be one of {', '.join(SELECTS)}, got {how!r}")
    setting = [k for k in ("method", "alpha", "num_clients", "epochs", "lr", "batch_size", "lambda") if k in df]
    per = complete_seeds(df, keep, setting).groupby(setting, dropna=False)[value].agg(["mean", "count"]).reset_index()
    out = []
    for kv, g in per.groupby(keep, dropna=False, sort=True):
        kv = kv if isinstance(kv, tuple) else (kv,)
        best = g.loc[g["mean"].idxmax()] if how == "best_on_test" else None
        out.append({**dict(zip(keep, kv)), value: float(best["mean"] if best is not None else g["mean"].mean()),
                    "settings": len(g), "seeds": int(g["count"].max()),
                    **({f"best_{k}": best[k] for k in setting if k not in keep} if best is not None else {})})
    return pd.DataFrame(out)


# ---- Figs. 3 and 4: MNIST MLP, first-round GA ---------------------------------------------------------------
def plot_fig3(df: pd.DataFrame, meta: Dict[str, Any], path: Path, profile: str) -> Path:
    """GA after round 1 vs α, one line per (N, method): colours = N, line styles = methods."""
    plt = pyplot()
    ok = _finished(df)
    how = meta.get("select", "best_on_test")
    sel = select_over(ok, ["method", "num_clients", "alpha"], "accuracy", how)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    methods = list(dict.fromkeys(ok["method"]))
    for i, n in enumerate(sorted(sel["num_clients"].unique())):
        for j, m in enumerate(methods):
            g = sel[(sel["num_clients"] == n) & (sel["method"] == m)].sort_values("alpha")
            ax.plot(g["alpha"], g["accuracy"], ls=STYLES[j % len(STYLES)], marker=MARKERS[j % len(MARKERS)], ms=4,
                    color=f"C{i}", label=f"N={n}, {m}")
    ax.set_xscale("log")
    ax.set_xlabel("Dirichlet α")
    ax.set_ylabel("GA after round 1 (%)")
    ax.set_title(f"{'best' if how == 'best_on_test' else 'mean'} over E, lr, B"
                 + (" (selected on the test set, as the paper)" if how == "best_on_test" else ""), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, path, sel, figure_title(meta, profile))


def plot_fig4(df: pd.DataFrame, meta: Dict[str, Any], path: Path, profile: str) -> Path:
    """GA after round 1 vs (a) B, (b) E, (c) lr, each the best (or mean) over the other two; one row per N,
    colours = methods, line styles = α."""
    plt = pyplot()
    ok = _finished(df)
    how = meta.get("select", "best_on_test")
    ns = sorted(ok["num_clients"].unique())
    alphas = sorted(ok["alpha"].unique())
    fig, axes = plt.subplots(len(ns), 3, figsize=(14, 3.6 * len(ns)), squeeze=False)
    data = []
    for r, n in enumerate(ns):
        for c, (x, label) in enumerate((("batch_size", "(a) B"), ("epochs", "(b) E"), ("lr", "(c) lr"))):
            sel = select_over(ok[ok["num_clients"] == n], ["method", "alpha", x], "accuracy", how)
            sel["num_clients"], sel["x"] = n, x
            data.append(sel)
            ax = axes[r, c]
            for m in dict.fromkeys(ok["method"]):
                for k, a in enumerate(alphas):
                    g = sel[(sel["method"] == m) & (sel["alpha"] == a)].sort_values(x)
                    ax.plot(g[x], g["accuracy"], ls=STYLES[k % len(STYLES)], marker="o", ms=3, color=_color(m),
                            label=f"{m}, α={_fmt(a)}")
            ax.set_xscale("log", base=10 if x == "lr" else 2)
            ax.set_xlabel(x)
            ax.set_ylabel("GA after round 1 (%)")
            ax.set_title(f"{label}, N={n}", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0, -1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return save_figure(fig, path, pd.concat(data, ignore_index=True), figure_title(meta, profile)
                 + f" — {'best' if how == 'best_on_test' else 'mean'} over the other hyperparameters"
                 + (" (test-set selection, as the paper)" if how == "best_on_test" else ""))


# ---- Figs. 6 and 8: CIFAR-10 20-round search -------------------------------------------------------------------
def _series_label(r) -> str:
    lam = r["lambda"]
    return r["method"] if lam is None or (isinstance(lam, float) and math.isnan(lam)) else f"{r['method']} λ={_fmt(lam)}"


def plot_fig6ab(df: pd.DataFrame, meta: Dict[str, Any], path: Path, profile: str) -> Path:
    """(a) GA and (b) LA after the last round vs E: colours = methods, line styles = λ (mean ± std over seeds)."""
    plt = pyplot()
    ok = _finished(df).copy()
    ok["series"] = ok.apply(_series_label, axis=1)
    stats = (ok.groupby(["method", "lambda", "series", "epochs"], dropna=False)[["accuracy", "local_accuracy"]]
             .agg(["mean", "std", "count"]))
    stats.columns = [f"{a}_{b}" for a, b in stats.columns]
    stats = stats.reset_index()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, col, lab in ((axes[0], "accuracy", "(a) GA"), (axes[1], "local_accuracy", "(b) LA")):
        for m in dict.fromkeys(stats["method"]):
            for k, (series, g) in enumerate(stats[stats["method"] == m].groupby("series", sort=False)):
                g = g.sort_values("epochs")
                ax.errorbar(g["epochs"], g[f"{col}_mean"], yerr=g[f"{col}_std"].fillna(0), fmt="o",
                            ls=STYLES[k % len(STYLES)], ms=3, capsize=2, color=_color(m), label=series)
        ax.set_xscale("log")
        ax.set_xlabel("local epochs E")
        ax.set_ylabel(f"{lab[4:]} after round {int(ok['rounds'].max())} (%)")
        ax.set_title(lab, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    return save_figure(fig, path, stats, figure_title(meta, profile))


def plot_fig8(df: pd.DataFrame, meta: Dict[str, Any], path: Path, profile: str) -> Path:
    """GA vs LA of every finished run (each seed a point), colours = methods."""
    plt = pyplot()
    ok = _finished(df)
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for m, g in ok.groupby("method", sort=False):
        ax.scatter(g["local_accuracy"], g["accuracy"], s=14, color=_color(m), label=f"{m} ({len(g)} runs)")
    ax.set_xlabel("LA (%)")
    ax.set_ylabel("GA (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    cols = ["method", "lambda", "epochs", "seed", "accuracy", "local_accuracy", "run_id"]
    return save_figure(fig, path, ok[cols], figure_title(meta, profile))


# ---- Figs. 6(c), 7, 9: CIFAR-10 100-round runs -------------------------------------------------------------------
def plot_fig6c(df: pd.DataFrame, meta: Dict[str, Any], path: Path, profile: str) -> Path:
    """GA after the last round vs α per method (mean ± std over seeds); Table II's α = 0.01 values as x."""
    plt = pyplot()
    ok = _finished(df)
    stats = ok.groupby(["method", "alpha"])["accuracy"].agg(["mean", "std", "count"]).reset_index()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for m in dict.fromkeys(ok["method"]):
        g = stats[stats["method"] == m].sort_values("alpha")
        ax.errorbar(g["alpha"], g["mean"], yerr=g["std"].fillna(0), fmt="-o", ms=4, capsize=2, color=_color(m),
                    label=f"{m} (E={ok.loc[ok['method'] == m, 'epochs'].iloc[0]})")
    ref = _reference("accuracy")
    for _, r in ref[ref["method"].isin(set(ok["method"]))].iterrows():
        ax.scatter([0.01], [r["mean"]], marker="x", s=50, color=_color(r["method"]), zorder=5)
    ax.set_xscale("log")
    ax.set_xlabel("Dirichlet α")
    ax.set_ylabel(f"GA after round {int(ok['rounds'].max())} (%)")
    ax.set_title("x = the paper's Table II (α = 0.01)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, stats, figure_title(meta, profile))


def _curves(ax, h: pd.DataFrame, col: str, by: List[str], style_key: Optional[str] = None) -> pd.DataFrame:
    stats = h.groupby(by + ["round"], dropna=False)[col].agg(["mean", "std", "count"]).reset_index()
    styles = {v: STYLES[i % len(STYLES)] for i, v in enumerate(sorted(h[style_key].unique()))} if style_key else {}
    for kv, g in stats.groupby(by, sort=False, dropna=False):
        kv = kv if isinstance(kv, tuple) else (kv,)
        d = dict(zip(by, kv))
        label = ", ".join([d["method"]] + [f"{k}={_fmt(v)}" for k, v in d.items() if k != "method"])
        line, = ax.plot(g["round"], g["mean"], ls=styles.get(d.get(style_key), "-"), color=_color(d["method"]),
                        lw=1.4, label=f"{label} (n={int(g['count'].max())})")
        if g["count"].max() > 1:
            ax.fill_between(g["round"], g["mean"] - g["std"].fillna(0), g["mean"] + g["std"].fillna(0),
                            color=line.get_color(), alpha=0.12)
    ax.set_xlabel("round")
    ax.grid(alpha=0.3)
    return stats


def plot_fig7(df: pd.DataFrame, meta: Dict[str, Any], path: Path, profile: str, output_root: Path) -> Path:
    """GA over rounds, colours = methods, line styles = α; Table II's α = 0.01 rounds to 30 / 40 % GA and
    final GA as x."""
    plt = pyplot()
    h = _histories(_finished(df), output_root)
    fig, ax = plt.subplots(figsize=(9, 5.2))
    stats = _curves(ax, h, "accuracy", ["method", "alpha"], "alpha")
    methods = set(h["method"])
    for t in (30, 40):
        ref = _reference("rounds_to_acc", t)
        for _, r in ref[ref["method"].isin(methods)].iterrows():
            ax.scatter([r["mean"]], [t], marker="x", s=40, color=_color(r["method"]), zorder=5)
    ref = _reference("accuracy")
    for _, r in ref[ref["method"].isin(methods)].iterrows():
        ax.scatter([int(r["rounds"])], [r["mean"]], marker="x", s=40, color=_color(r["method"]), zorder=5)
    ax.set_ylabel("GA (%)")
    ax.set_title("x = the paper's Table II (α = 0.01): rounds to 30 / 40 % GA, GA at round 100", fontsize=8)
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, path, stats, figure_title(meta, profile))


def plot_fig9(df: pd.DataFrame, meta: Dict[str, Any], path: Path, profile: str, output_root: Path) -> Path:
    """(a) GA: FOLA aggregation-only vs FOLA-offline (no prior loss); (b) GA and (c) LA: the prior loss with
    FedAvg vs product aggregation, plus aggregation-only and FedAvg."""
    plt = pyplot()
    h = _histories(_finished(df), output_root)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    a = h[h["method"].isin(["FOLA agg.-only", "FOLA-offline"])]
    b = h[h["method"].isin(["FOLA", "FOLA prior + FedAvg agg.", "FOLA agg.-only", "FedAvg"])]
    data = []
    for ax, part, col, title in ((axes[0], a, "accuracy", "(a) GA, no prior loss: online vs offline"),
                                 (axes[1], b, "accuracy", "(b) GA with the prior loss: aggregation"),
                                 (axes[2], b, "local_accuracy", "(c) LA")):
        if part.empty:
            ax.set_visible(False)
            continue
        st = _curves(ax, part, col, ["method"])
        st["panel"] = title[:3]
        data.append(st)
        ax.set_ylabel("GA (%)" if col == "accuracy" else "LA (%)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    return save_figure(fig, path, pd.concat(data, ignore_index=True), figure_title(meta, profile))


# ---- Figs. 10-12: the §IV-E softmax-regression study --------------------------------------------------------------
_CURV_COLORS = {"full": "C0", "efull": "C1", "diag": "C2", "identity": "C3"}
_STYLE_LS = {"online": "-", "offline": "--", "identity": ":"}


def plot_fig10(rounds: pd.DataFrame, sweep: pd.DataFrame, heatmaps: Dict[str, Any], path: Path, title: str) -> Path:
    """(a) normalised full-Laplace precision of client 1 (first parameters, round 1), (b)(c) GA along the π₁
    aggregation curves at the sweep rounds; colours = curvature, line styles = online / offline / identity."""
    plt = pyplot()
    sweep_rounds = sorted(sweep["round"].unique()) if len(sweep) else []
    fig, axes = plt.subplots(1, 1 + len(sweep_rounds), figsize=(5.2 * (1 + len(sweep_rounds)), 4.4), squeeze=False)
    axes = axes[0]
    if heatmaps:
        name = "full_online" if "full_online" in heatmaps else sorted(heatmaps)[0]
        im = axes[0].imshow(heatmaps[name].numpy(), cmap="viridis")
        fig.colorbar(im, ax=axes[0])
        axes[0].set_title(f"(a) normalised Σ₁⁻¹, first {heatmaps[name].shape[0]} params ({name}, round 1)", fontsize=8)
    else:   # the committed store keeps a study's tables, not its binary heat maps
        axes[0].axis("off")
        axes[0].text(0.5, 0.5, "(a) no heat map here: the committed record\nkeeps the study's tables only;\n"
                     "rerun the study to draw it", ha="center", va="center", fontsize=8)
    for k, (ax, r) in enumerate(zip(axes[1:], sweep_rounds)):
        for method, g in sweep[sweep["round"] == r].groupby("method", sort=False):
            ax.plot(g["pi1"], 100 * g["global_accuracy"], ls=_STYLE_LS[g["style"].iloc[0]],
                    color=_CURV_COLORS[g["curvature"].iloc[0]], label=method)
        ax.set_xlabel("π₁")
        ax.set_ylabel("GA (%)")
        ax.set_title(f"({'bc'[k] if k < 2 else k}) aggregation functions, round {r}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, sweep, title)


def plot_fig11(rounds: pd.DataFrame, path: Path, title: str) -> Path:
    """(a) cosine similarity of the normalised client precisions (round 1), (b) GA and (c) LA over rounds."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    first = rounds[rounds["round"] == rounds["round"].min()]
    axes[0].bar(first["method"], first["precision_cosine"], color=[_CURV_COLORS[c] for c in first["curvature"]])
    axes[0].set_title("(a) cosine(normalised Σ₁⁻¹, Σ₂⁻¹), round 1", fontsize=9)
    axes[0].tick_params(axis="x", rotation=45)
    for key, ax, lab in (("global_accuracy", axes[1], "(b) GA (%)"), ("local_accuracy", axes[2], "(c) LA (%)")):
        for method, g in rounds.groupby("method", sort=False):
            ax.plot(g["round"], 100 * g[key], ls=_STYLE_LS[g["style"].iloc[0]], color=_CURV_COLORS[g["curvature"].iloc[0]],
                    marker="o", ms=3, label=method)
        ax.set_xlabel("round")
        ax.set_title(lab, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, rounds, title)


def plot_fig12(corr: pd.DataFrame, path: Path, title: str, ae_round: int = 3,
               reference: str = "full_online") -> Path:
    """(a) GA vs AE at ``ae_round``, (b) LA vs LF of the round after the optimum per E; colours = α, markers =
    methods (the full-Laplace reference itself is left out of (a): its AE is measured against itself)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    alphas = sorted(corr["alpha"].unique())
    methods = list(dict.fromkeys(corr["method"]))
    ae = corr[(corr["kind"] == "ae") & (corr["round"] == ae_round) & (corr["method"] != reference)]
    lf = corr[corr["kind"] == "lf"]
    for i, a in enumerate(alphas):
        for j, m in enumerate(methods):
            g = ae[(ae["alpha"] == a) & (ae["method"] == m)]
            axes[0].scatter(g["distance"], 100 * g["accuracy"], color=f"C{i}", marker=MARKERS[j % len(MARKERS)], s=30,
                            label=f"α={_fmt(a)}, {m}" if len(g) else None)
            g = lf[(lf["alpha"] == a) & (lf["method"] == m)].sort_values("epochs")
            axes[1].plot(g["distance"], 100 * g["accuracy"], color=f"C{i}", marker=MARKERS[j % len(MARKERS)], ms=5,
                         lw=0.6, label=f"α={_fmt(a)}, {m}" if len(g) else None)
            for _, r in g.iterrows():
                axes[1].annotate(f"E={int(r['epochs'])}", (r["distance"], 100 * r["accuracy"]), fontsize=5)
    axes[0].set_xlabel(f"AE = D(θ_S, θ*) at round {ae_round}")
    axes[0].set_ylabel("GA (%)")
    axes[1].set_xlabel("LF = Σ π_n D(θ_n, θ*)")
    axes[1].set_ylabel("LA (%)")
    for ax, t, part in zip(axes, ("(a) GA vs AE", "(b) LA vs LF"), (ae, lf)):
        if len(part) and (part["distance"] > 0).all():
            ax.set_xscale("log")
        ax.set_title(t, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return save_figure(fig, path, corr, title)


# ---- the plot kinds FOLA registers (fedbench.report.registry) -----------------------------------------------
def _from_records(draw: Callable) -> Callable[[PlotRequest], Path]:
    """Figs. 3, 4, 6, 8: the final metrics of the preset's runs."""
    return lambda req: draw(req.frame(fola_records), req.meta, req.path, req.profile)


def _from_histories(draw: Callable) -> Callable[[PlotRequest], Path]:
    """Figs. 7, 9: the runs' histories."""
    return lambda req: draw(req.frame(fola_records), req.meta, req.path, req.profile, req.output_root)


def plot_study(req: PlotRequest) -> Path:
    """Figs. 10-12 from the files the §IV-E study runs wrote next to their records."""
    import torch

    kind, path = req.kind, req.path
    meta, done = finished_studies(req.overrides, req.output_root)
    title = figure_title(meta, req.profile)
    if kind == "fola_fig12":
        frames = []
        for cfg, folder in done:
            c = pd.read_csv(folder / "correlation.csv")
            c["alpha"], c["seed"] = cfg.partition.get("alpha"), int(cfg.seed)
            frames.append(c)
        corr = pd.concat(frames, ignore_index=True)
        if corr.empty:
            raise FedbenchError("the study runs wrote no AE/LF rows (study.kind must be correlation)")
        study = OmegaConf.to_container(done[0][0].get("study") or {}, resolve=True)
        return plot_fig12(corr, path, title, int(meta.get("ae_round", 3)), study.get("reference", "full_online"))
    cfg, folder = done[0]   # Figs. 10-11 show one study run (the first seed)
    if len(done) > 1:
        title += f" (seed {int(cfg.seed)} of {len(done)})"
    rounds = pd.read_csv(folder / "rounds.csv")
    if kind == "fola_fig11":
        return plot_fig11(rounds, path, title)
    heat = {p.stem[len("heatmap_"):]: torch.load(p, map_location="cpu", weights_only=True)
            for p in sorted(folder.glob("heatmap_*.pt"))}
    return plot_fig10(rounds, pd.read_csv(folder / "sweep.csv"), heat, path, title)


PLOTS: Dict[str, Callable[[PlotRequest], Path]] = {
    "fola_fig3": _from_records(plot_fig3), "fola_fig4": _from_records(plot_fig4),
    "fola_fig6ab": _from_records(plot_fig6ab), "fola_fig8": _from_records(plot_fig8),
    "fola_fig6c": _from_records(plot_fig6c), "fola_fig7": _from_histories(plot_fig7),
    "fola_fig9": _from_histories(plot_fig9),
    "fola_fig10": plot_study, "fola_fig11": plot_study, "fola_fig12": plot_study}
