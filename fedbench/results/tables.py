"""Collect run records into a paper's table: ours (mean ± std over seeds) beside the paper's number.

A table is defined by its experiment preset: the preset's sweep is expanded into runs, each run's
config gives its row keys (data set, partition label, clients, epochs, ...) and method, and its
run_id finds its record. Records therefore belong to every table whose sweep contains them (FedLPA
Table 3's λ = 0.001 column is Table 1's runs), and cells whose runs are missing are marked.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from fedbench.errors import FedbenchError
from fedbench.results.records import compute_run_id, read_record
from fedbench.results.summaries import last_k


def partition_label(p: Dict[str, Any]) -> str:
    """The label the papers' tables use for a partition config."""
    name = p.get("name")
    if name == "niid-bench":
        return str(p.get("spec"))
    if name == "noniid-labeldir" or name == "iid-diff-quantity":
        return f"beta={p.get('beta'):g}"
    if str(name).startswith("noniid-#label"):
        return f"#C={p.get('k')}"
    if name in ("dirichlet_clientwise", "dirichlet_per_class_contiguous"):
        return f"alpha={p.get('alpha'):g}"
    if name in ("size_class_dirichlet", "uci_inhomogeneous"):
        return "heterog"
    if name == "homo":
        return "homog"
    if name == "natural":
        return "heterog"   # FedLap writes FLamby's natural hospital split as heterogeneous
    return str(name)


def method_label(a: Dict[str, Any]) -> str:
    name = a.get("name")
    if name == "fedprox":
        return f"fedprox(mu={a.get('mu'):g})"
    if name == "fedbens" and a.get("laplace") in ("diag_full_last", "diag"):   # FedBEns' Hessian columns
        return "fedbens_diag_full" if a.get("laplace") == "diag_full_last" else "fedbens_diag"
    if name == "fola" and (a.get("fisher") or {}).get("mode") == "offline":
        return "fola_offline"
    return str(name)


def _algo_key(c: Dict[str, Any], names, fn):
    a = c.get("algorithm") or {}
    return fn(a) if str(a.get("name", "")).startswith(names) else None


def _s_q(a: Dict[str, Any]):
    """FedFisher Tables 4/5's s_q: 1 = uncompressed, else 32 // bits of the curvature upload."""
    if not a.get("compression", True):
        return 1
    return 32 // int(a.get("factor_bits") or a.get("fisher_bits") or 16)


KEY_FUNCS: Dict[str, Callable[[Dict[str, Any]], Any]] = {
    "dataset": lambda c: c["dataset"]["name"],
    "partition": lambda c: partition_label(c["partition"]),
    "num_clients": lambda c: c["num_clients"],
    "local_epochs": lambda c: c["local"]["epochs"],
    "rounds": lambda c: c["rounds"],
    "seed": lambda c: c["seed"],
    # method-variant axes of single tables (results/reference/README.md key columns)
    "lambda": lambda c: _algo_key(c, "fedlpa", lambda a: a.get("damping")),                 # FedLPA Table 3
    "s_q": lambda c: _algo_key(c, "fedfisher", _s_q),                                        # FedFisher Tables 4-5
    "M": lambda c: _algo_key(c, "fedbens", lambda a: "custom" if a.get("members_per_client") else a.get("members")),
}


def row_value(cfg: Dict[str, Any], key: str):
    if key in KEY_FUNCS:
        return KEY_FUNCS[key](cfg)
    node: Any = cfg
    for part in key.split("."):  # any dotted config path, e.g. algorithm.lam
        node = node.get(part) if isinstance(node, dict) else None
    return node


def table_runs(overrides: Sequence[str], output_root: Path, *, conf_dir: Optional[Path] = None) -> pd.DataFrame:
    """One row per (run of the table's sweep, aggregator): keys, method, run_id, status, metrics."""
    from fedbench.launch.sweep import CONF_DIR, compose_run, expand_sweep
    from fedbench.runner import expand_aggregators

    conf_dir = conf_dir or CONF_DIR
    rows = []
    meta = None
    for ovs in expand_sweep(overrides, conf_dir):
        cfg = compose_run(ovs, conf_dir)
        meta = meta or (OmegaConf.to_container(cfg.table, resolve=True) if cfg.get("table") else {})
        subs = expand_aggregators(cfg, conf_dir, allow_missing=True) if cfg.get("aggregators") else [cfg]
        for sub in subs:
            c = OmegaConf.to_container(sub, resolve=True)
            rid = compute_run_id(sub)
            rec = read_record(output_root / "runs" / rid / "metrics.json") or {}
            keys = [k for k in (meta.get("rows") or ["dataset", "partition"]) if k != "rounds"]
            row = {k: row_value(c, k) for k in keys}
            row.update({"method": method_label(c["algorithm"]), "algorithm": c["algorithm"]["name"],
                        "seed": c["seed"], "profile": c.get("profile"), "run_id": rid,
                        "status": rec.get("status", "missing"),
                        "missing_method": bool(c["algorithm"].get("_missing"))})
            at_rounds = meta.get("at_rounds")
            if not at_rounds:
                row.update(rec.get("metrics") or {})
                rows.append(row)
                continue
            # multi-round tables: one row per reported round, summarised from the run's history
            hist = _history(output_root / "runs" / rid / "history.csv") if rec.get("status") == "ok" else []
            how = meta.get("summary", "last3_mean")
            k = int(how[4]) if how.startswith("last") else 1
            for r in at_rounds:
                if r > int(c["rounds"]):
                    continue
                upto = [h for h in hist if int(h["round"]) <= r]
                val = last_k(upto, "accuracy", k, "max" if how.endswith("max") else "mean") \
                    if len(upto) and int(upto[-1]["round"]) == r else None
                rows.append({**row, "rounds": r, "accuracy": val,
                             "status": row["status"] if val is not None else "missing"})
    df = pd.DataFrame(rows)
    df.attrs["table"] = meta or {}
    return df


def _history(path: Path) -> List[Dict[str, Any]]:
    try:
        return pd.read_csv(path).to_dict("records")
    except (OSError, ValueError):
        return []


def summarise(df: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    keys = list((df.attrs.get("table") or {}).get("rows") or ["dataset", "partition"])
    ok = df[df["status"] == "ok"] if "status" in df else df
    groups = []
    for key_vals, g in df.groupby(keys + ["method"], sort=False, dropna=False):
        vals = ok.loc[ok.index.intersection(g.index), metric] if metric in ok else pd.Series(dtype=float)
        vals = vals.dropna().astype(float)
        groups.append({**dict(zip(keys + ["method"], key_vals)), "n": len(vals), "planned": len(g),
                       "mean": vals.mean() if len(vals) else math.nan,
                       "std": vals.std(ddof=1) if len(vals) > 1 else (0.0 if len(vals) == 1 else math.nan)})
    return merge_row_variants(pd.DataFrame(groups), keys)


def merge_row_variants(summary: pd.DataFrame, keys: List[str]) -> pd.DataFrame:
    """One column per method when a hyperparameter differs only between rows (FedLap Table 1's FedProx μ
    is set per data set): labels ``name(…)`` that never share a row become ``name``, the setting is kept
    in ``variant`` and shown in the cell. Variants that share a row (FedLPA's μ sweep) stay separate columns."""
    if summary.empty:
        return summary
    out = summary.copy()
    out["variant"] = ""
    base = out["method"].str.replace(r"\(.*\)$", "", regex=True)
    for b in base[base != out["method"]].unique():
        sel = base == b
        per_row = out[sel].groupby(keys, sort=False, dropna=False)["method"].nunique()
        if (per_row <= 1).all() and out.loc[sel, "method"].nunique() > 1:
            out.loc[sel, "variant"] = out.loc[sel, "method"].str[len(b):]
            out.loc[sel, "method"] = b
    return out


def attach_reference(summary: pd.DataFrame, paper: str, table: str, metric: str = "accuracy") -> pd.DataFrame:
    try:
        from fedbench.results.reference import load_reference
        ref = load_reference(paper, table)
    except (ImportError, FedbenchError, FileNotFoundError):
        summary["paper"] = math.nan
        return summary
    ref = ref[ref["metric"] == metric] if "metric" in ref else ref
    ref = ref.copy()
    ref["base_method"] = ref["method"]
    summary = summary.copy()
    summary["base_method"] = summary["method"].str.replace(r"\(.*\)$", "", regex=True)
    on = [k for k in summary.columns if k in ref.columns and k not in ("method", "mean", "std", "n")]
    on = [k for k in on if k != "base_method"] + ["base_method"]
    for k in on:  # compare as strings: numeric keys print the same in both
        summary[k + "__j"] = summary[k].astype(str)
        ref[k + "__j"] = ref[k].astype(str)
    merged = summary.merge(ref[[k + "__j" for k in on] + ["mean", "std"]].rename(
        columns={"mean": "paper", "std": "paper_std"}), on=[k + "__j" for k in on], how="left")
    return merged.drop(columns=[k + "__j" for k in on] + ["base_method"])


def _fmt(x, digits=2):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def to_markdown(summary: pd.DataFrame, meta: Dict[str, Any], profile: str, approx_note: str = "") -> str:
    keys = list(meta.get("rows") or ["dataset", "partition"])
    methods = list(dict.fromkeys(summary["method"]))
    lines = [f"# {meta.get('paper', '?')} {meta.get('id', '?')}: {meta.get('title', '')}", "",
             f"Profile: **{profile}**" + (" (reduced settings — NOT the paper's protocol)" if profile == "quick" else "")
             + f". Generated {_dt.datetime.now().isoformat(timespec='seconds')} from run records.",
             "Cell: ours mean ± std over n seeds (sample std) / the paper's number / difference. "
             "`not run` = no ok record yet; `—` = no paper number.", ""]
    if approx_note:
        lines += [f"**Approximate data:** {approx_note}", ""]
    lines.append("| " + " | ".join(keys + methods) + " |")
    lines.append("|" + "---|" * (len(keys) + len(methods)))
    for key_vals, g in summary.groupby(keys, sort=False, dropna=False):
        key_vals = key_vals if isinstance(key_vals, tuple) else (key_vals,)
        cells = []
        for m in methods:
            r = g[g["method"] == m]
            if r.empty:
                cells.append("")
                continue
            r = r.iloc[0]
            paper = r.get("paper", math.nan)
            ours = (f"{_fmt(r['mean'])} ± {_fmt(r['std'])} (n={int(r['n'])})" if r["n"] > 0
                    else f"not run (0/{int(r['planned'])})")
            ref = "—" if paper is None or (isinstance(paper, float) and math.isnan(paper)) else _fmt(paper)
            diff = (f" / Δ {r['mean'] - paper:+.2f}" if r["n"] > 0 and ref != "—" else "")
            variant = f" {r['variant']}" if isinstance(r.get("variant"), str) and r.get("variant") else ""
            cells.append(f"{ours} / {ref}{diff}{variant}")
        lines.append("| " + " | ".join([str(v) for v in key_vals] + cells) + " |")
    return "\n".join(lines) + "\n"


def collect(overrides: Sequence[str], output_root: Path, tables_dir: Path, metric: str = "accuracy") -> Path:
    df = table_runs(overrides, output_root)
    meta = df.attrs.get("table") or {}
    if not meta:
        raise FedbenchError("collect needs an experiment preset (experiment=<paper>/<table>)")
    profile = str(df["profile"].iloc[0]) if len(df) else "paper"
    name = f"{meta['paper']}_{meta['id']}" + ("" if profile in ("paper", "None") else f"_{profile}")
    tables_dir.mkdir(parents=True, exist_ok=True)
    df.to_csv(tables_dir / f"{name}_runs.csv", index=False)
    summary = attach_reference(summarise(df, metric), meta["paper"], meta["id"], metric)
    out = tables_dir / f"{name}.md"
    out.write_text(to_markdown(summary, meta, profile))
    return out
