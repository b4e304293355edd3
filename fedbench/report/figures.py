"""Figures from run records, two kinds (a preset's ``table.figure.kind``):

* ``rounds`` (default): accuracy over rounds (FedLap-style curves, FOLA Figs. 5/7/9/11, FedLPA Fig. 2,
  FedFisher Fig. 2, FedLap Fig. 1): one panel per table row, one line per method, mean over seeds with a
  ±1 std band; paper points from ``results/reference`` rows that carry a ``rounds`` column.
* ``sweep``: a metric against a swept setting ``x`` (one of the table's row keys: FedBEns' M, T, σ² in Figs.
  2–5, FedFisher's width / local steps in Fig. 1): mean ± std over seeds per x, one line per method (and per
  ``lines`` key, e.g. α), one panel per remaining row-key combination; the papers' numbers as x markers from
  the reference tables the preset names (``figure.reference``: FedBEns Table 7's M = 1 column is Fig. 2's
  M = 1 point).

The runs are exactly those of a preset's sweep (the same selection as the tables), so a figure never mixes
runs from other configurations.

A preset's named plots (``table.plots``) are plot kinds the papers register (fedbench.report.registry);
``plot_preset_figures`` draws them.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple
import textwrap

import pandas as pd

from omegaconf import OmegaConf

from fedbench.config.specs import figure_spec
from fedbench.errors import FedbenchError
from fedbench.launch.sweep import compose_run, expand_sweep
from fedbench.report.registry import PLOT_KINDS, PlotRequest, registered
from fedbench.results.records import read_history
from fedbench.report.tables import TableMeta, collection_stem, norm_key, table_runs
from fedbench.results.reference import load_reference


def _missing_methods(runs: pd.DataFrame) -> List[str]:
    if runs.empty or "missing_method" not in runs:
        return []
    return list(dict.fromkeys(runs.loc[runs["missing_method"].astype(bool), "algorithm"]))


def round_curves(overrides: Sequence[str], output_root: Path, metric: str = "accuracy",
                 runs: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Long table: row keys, method, seed, round, value — from each finished run's history.csv."""

    runs = table_runs(overrides, output_root) if runs is None else runs
    meta = runs.attrs.get("table") or {}
    keys = [k for k in (meta.get("rows") or ["dataset", "partition"]) if k != "rounds"]
    out = []
    if len(runs) == 0:
        return pd.DataFrame(out)
    base = runs.drop_duplicates("run_id")
    for _, r in base.iterrows():
        if r.get("missing_method"):
            continue
        if r.get("status") != "ok":
            continue
        for h in read_history(Path(r["record_dir"]) / "history.csv"):
            v = h.get(metric)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            out.append({**{k: r[k] for k in keys}, "method": r["method"], "seed": r["seed"],
                        "round": int(h["round"]), "value": float(v)})
    df = pd.DataFrame(out)
    df.attrs["table"] = TableMeta(meta or {})
    df.attrs["keys"] = keys
    df.attrs["missing"] = _missing_methods(runs)
    return df


def sweep_points(overrides: Sequence[str], output_root: Path, metric: Optional[str] = None,
                 runs: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Long table of a sweep figure: row keys except x, method, seed, x, value — one row per finished run
    (the final-round metric of its record)."""

    runs = table_runs(overrides, output_root) if runs is None else runs
    meta = runs.attrs.get("table") or {}
    spec = figure_spec(meta)
    if spec["kind"] != "sweep":
        raise FedbenchError(f"preset {meta.get('paper')}/{meta.get('id')} has no sweep figure (table.figure.kind)")
    metric = metric or spec["metric"] or "accuracy"
    keys = [k for k in (meta.get("rows") or ["dataset", "partition"]) if k not in ("rounds", spec["x"])]
    out = []
    for r in runs.to_dict("records") if len(runs) else []:
        v = r.get(metric)
        if r.get("missing_method") or r.get("status") != "ok" or v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        xv = pd.to_numeric(pd.Series([r[spec["x"]]]), errors="coerce").iloc[0]
        if pd.isna(xv):
            raise FedbenchError(f"sweep figure: {spec['x']} = {r[spec['x']]!r} of run {r['run_id']} is not a number")
        out.append({**{k: r[k] for k in keys}, "method": r["method"], "seed": r["seed"], "x": float(xv),
                    "value": float(v)})
    df = pd.DataFrame(out)
    df.attrs.update(table=meta, keys=keys, figure=spec, metric=metric, missing=_missing_methods(runs))
    return df


def sweep_reference(spec: Dict[str, Any]) -> Optional[pd.DataFrame]:
    """The papers' numbers for a sweep figure: rows of the named reference tables, filtered by ``where``, with
    ``x`` from the table's own x column or the entry's fixed ``x`` (a table reporting only the default setting)."""

    frames = []
    for ent in spec["reference"]:
        paper, tid = str(ent["table"]).split("/", 1)
        ref = load_reference(paper, tid)
        if "metric" in ref:
            ref = ref[ref["metric"] == ent.get("metric", "accuracy")]
        for k, v in (ent.get("where") or {}).items():
            if k not in ref:
                raise FedbenchError(f"figure reference {ent['table']}: no column {k!r} to filter on")
            vals = [norm_key(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
            ref = ref[ref[k].map(norm_key).isin(vals)]
        ref = ref.copy()
        if "x" in ent:
            ref["x"] = float(ent["x"])
        elif spec["x"] in ref:
            ref["x"] = pd.to_numeric(ref[spec["x"]].map(norm_key), errors="coerce")
        else:
            raise FedbenchError(f"figure reference {ent['table']} has no {spec['x']!r} column: give its x value")
        frames.append(ref[ref["x"].notna() & ref["mean"].notna()])
    return pd.concat(frames, ignore_index=True) if frames else None


def plot_sweep(points: pd.DataFrame, path: Path, *, title: str = "",
               reference: Optional[pd.DataFrame] = None) -> Tuple[Path, pd.DataFrame]:
    """Draw a sweep figure; returns the file and the data actually drawn (one row per plotted point: panel,
    line, x, y, std, n, source = ours | paper), read back from the plot's artists."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if points.empty:
        raise FedbenchError("no finished runs to plot (run the sweep first)")
    spec, keys, metric = points.attrs["figure"], points.attrs["keys"], points.attrs["metric"]
    lines = spec["lines"]
    panel_keys = [k for k in keys if k not in lines]
    xs = points["x"]
    log_x = spec["log_x"] if spec["log_x"] != "auto" else bool((xs > 0).all() and xs.max() / xs.min() >= 50)
    panels = list(points.groupby(panel_keys, sort=False, dropna=False)) if panel_keys else [((), points)]
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    drawn = []
    for ax, (kv, g) in zip(axes.flat, panels):
        kv = kv if isinstance(kv, tuple) else (kv,)
        panel = ", ".join(f"{k}={v}" for k, v in zip(panel_keys, kv))
        for lv, gl in g.groupby(lines + ["method"], sort=False, dropna=False):
            lv = lv if isinstance(lv, tuple) else (lv,)
            method = lv[-1]
            stats = gl.groupby("x")["value"].agg(["mean", "std", "count"]).reset_index().sort_values("x")
            std = stats["std"].fillna(0.0)
            label = ", ".join([str(method)] + [f"{k}={v}" for k, v in zip(lines, lv[:-1])])
            line, = ax.plot(stats["x"], stats["mean"], marker="o", ms=3.5, lw=1.6,
                            label=f"{label} (n={int(stats['count'].max())})")
            if stats["count"].max() > 1:
                ax.fill_between(stats["x"], stats["mean"] - std, stats["mean"] + std, color=line.get_color(), alpha=0.15)
            for (x, y), s, n in zip(line.get_xydata(), std, stats["count"]):
                drawn.append({"panel": panel, "line": label, "x": float(x), "y": float(y), "std": float(s),
                              "n": int(n), "source": "ours"})
            if reference is not None and not reference.empty:
                base = str(method).split("(", 1)[0]
                sel = reference[reference["method"].isin([method, base])]
                for k, v in zip(panel_keys + lines, list(kv) + list(lv[:-1])):
                    if k in sel:
                        sel = sel[sel[k].map(norm_key) == norm_key(v)]
                if len(sel):
                    pts = ax.scatter(sel["x"].astype(float), sel["mean"].astype(float), marker="x", s=45,
                                     color=line.get_color(), zorder=5)
                    for x, y in pts.get_offsets():
                        drawn.append({"panel": panel, "line": label, "x": float(x), "y": float(y), "std": math.nan,
                                      "n": 0, "source": "paper"})
        if log_x:
            ax.set_xscale("log", base=2 if (xs.round() == xs).all() else 10)
        elif (xs.round() == xs).all():   # M, clients: integer ticks only
            from matplotlib.ticker import MaxNLocator
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if spec["log_y"]:   # losses spanning decades (FedFisher Fig. 1's closed-form vs GD servers)
            ax.set_yscale("log")
        _style_axes(ax, panel, spec["x"], metric)
    _save_panels(fig, axes, len(panels), cols, title, path)
    return path, pd.DataFrame(drawn)


def plot_curves(curves: pd.DataFrame, path: Path, *, metric: str = "accuracy", title: str = "",
                reference: Optional[pd.DataFrame] = None, log_y: bool = False) -> Path:
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
        if log_y:   # distances to an optimum spanning decades (FedLap App. D.2's train-NLL gap)
            ax.set_yscale("log")
        _style_axes(ax, ", ".join(f"{k}={v}" for k, v in zip(keys, kv)), "round", metric)
    _save_panels(fig, axes, len(panels), cols, title, path)
    return path


def _style_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save_panels(fig, axes, used: int, cols: int, title: str, path: Path) -> None:
    """Hide unused panels, add the wrapped title, write the PNG and close the figure."""

    import matplotlib.pyplot as plt

    for ax in list(axes.flat)[used:]:
        ax.set_visible(False)
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 60 * cols)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _name_and_title(meta: Dict[str, Any], overrides: Sequence[str], metric: str,
                    suffix: Optional[str] = None) -> Tuple[str, str]:
    """The figure's file stem ``<paper>_<id>[_<profile>][_<suffix>]_<metric>`` (the suffix of its table: a
    ``--name`` or tuned collection never overwrites the preset's own figure) and its title."""
    profile = next((o.split("=", 1)[1] for o in overrides if o.startswith("profile=")), "paper")
    name = collection_stem(f"{meta['paper']}_{meta['id']}", profile, suffix) + f"_{metric}"
    quick = " — reduced settings, NOT the paper's protocol" if profile == "quick" else ""
    return name, f"{meta['paper']} {meta['id']}: {meta.get('title', '')} [profile: {profile}{quick}]"


def _no_runs(runs: pd.DataFrame) -> FedbenchError:
    missing = _missing_methods(runs)
    return FedbenchError("no finished runs to plot" + (f": methods not implemented yet: {', '.join(missing)}"
                                                       if missing else " (run the sweep first)"))


def plot_sweep_table(overrides: Sequence[str], output_root: Path, figures_dir: Path, metric: Optional[str] = None,
                     runs: Optional[pd.DataFrame] = None, suffix: Optional[str] = None) -> Tuple[Path, pd.DataFrame]:
    """A preset's sweep figure (``table.figure.kind: sweep``) and the data drawn."""

    runs = table_runs(overrides, output_root) if runs is None else runs
    points = sweep_points(overrides, output_root, metric, runs=runs)
    if points.empty:
        raise _no_runs(runs)
    meta = points.attrs["table"]
    name, title = _name_and_title(meta, overrides, points.attrs["metric"], suffix)
    ref = sweep_reference(points.attrs["figure"])
    if ref is not None:
        title += " (x = paper)"
    return plot_sweep(points, figures_dir / f"{name}.png", title=title, reference=ref)


def curve_reference(ref: pd.DataFrame, metric: str) -> Optional[pd.DataFrame]:
    """The paper's points for a curve over rounds: rows of ``metric`` that name a round. Where a table prints the
    same round as several statistics (FedLap App. E.5: mean and max of the last 3 rounds), only the mean of the
    last 3 is drawn, the statistic a smoothed curve shows; two markers per round would read as two runs."""
    ref = ref[ref["metric"] == metric] if "metric" in ref else ref
    if "rounds" not in ref:
        return None
    ref = ref[ref["rounds"].notna()]
    if "metric_variant" in ref:
        variants = set(ref["metric_variant"].dropna()) - {""}
        if "mean_last3" in variants and len(variants) > 1:
            ref = ref[ref["metric_variant"] == "mean_last3"]
    return ref


def plot_table(overrides: Sequence[str], output_root: Path, figures_dir: Path, metric: Optional[str] = None,
               suffix: Optional[str] = None) -> Path:
    """The preset's figure: ``results/figures/<paper>_<id>[_<profile>]_<metric>.png`` — accuracy over rounds, or
    a metric against a swept setting (``table.figure``)."""

    runs = table_runs(overrides, output_root)
    meta = runs.attrs.get("table") or {}
    if not meta:
        raise FedbenchError("plot needs an experiment preset (experiment=<paper>/<table>)")
    spec = figure_spec(meta)
    if spec["kind"] == "sweep":
        return plot_sweep_table(overrides, output_root, figures_dir, metric, runs=runs, suffix=suffix)[0]
    metric = metric or spec["metric"] or meta.get("metric") or "accuracy"   # a table of NLL draws NLL
    curves = round_curves(overrides, output_root, metric, runs=runs)
    if curves.empty:
        raise _no_runs(runs)
    if curves["round"].max() <= 1:
        raise FedbenchError("a one-shot table (every run has one round): nothing to draw over rounds")
    name, title = _name_and_title(meta, overrides, metric, suffix)
    try:
        ref = curve_reference(load_reference(meta["paper"], meta["id"]), metric)
    except Exception:  # noqa: BLE001  (a table without transcribed numbers still gets its figure)
        ref = None
    return plot_curves(curves, figures_dir / f"{name}.png", metric=metric, title=title, reference=ref,
                       log_y=spec["log_y"])


# ---- a preset's named plots (table.plots): the plot kinds the papers register --------------------------------
def _profile(overrides: Sequence[str]) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("profile=")), "paper")


def plot_preset_figures(overrides: Sequence[str], output_root: Path, figures_dir: Path,
                        suffix: Optional[str] = None) -> List[Path]:
    """Draw the preset's ``table.plots`` into ``<figures_dir>/<paper>_<id>[_<profile>][_<suffix>][_<kind>].png``
    (``suffix``: a named collection's, as its table's); [] for a preset that declares none."""

    runs = expand_sweep(overrides)
    cfg = compose_run(runs[0]) if runs else None
    meta = OmegaConf.to_container(cfg.table, resolve=True) if cfg is not None and cfg.get("table") else {}
    kinds = list(meta.get("plots") or [])
    bad = [k for k in kinds if k not in registered(PLOT_KINDS)]
    if bad:
        raise FedbenchError(f"table.plots: unknown plot(s) {', '.join(map(str, bad))}; known: {', '.join(PLOT_KINDS)}")
    if not kinds:
        return []
    profile = _profile(overrides)
    base = collection_stem(f"{meta['paper']}_{meta['id']}", profile, suffix)
    frames: Dict = {}   # one scan of the records for every plot of the preset
    paths = []
    for k in kinds:
        path = Path(figures_dir) / (f"{base}.png" if len(kinds) == 1 else f"{base}_{k}.png")
        paths.append(PLOT_KINDS[k](PlotRequest(k, overrides, output_root, path, profile, meta, frames)))
    return paths
